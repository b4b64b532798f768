"""The rules of ``tenants:`` that its types cannot say (``checks.py``'s, for the named
tenants and their keys)."""

from __future__ import annotations

from gateway.policy.checks import Found, check_rate_limit
from gateway.policy.generation import check_generation
from gateway.policy.model import RateLimit, Tenants

MAX_WEIGHT = 100
"""A tenant's weight in a fair queue at most: turns of more calls than that are a FIFO."""


def check_tenants(tenants: Tenants) -> Found:
    """``tenants``: each key a sha256 in hex, listed once, its tenant's limit and models
    given once, every concurrency cap at least 1."""
    found: Found = []
    if tenants.required and not tenants.keys:
        found.append(("keys", "`required: true` with no keys would refuse every request"))
    if 0 < len(tenants.response_id_secret) < 16:
        found.append(("response_id_secret", "must hold at least 16 characters"))
    caps = [("max_concurrency", tenants.max_concurrency)]
    caps += [(f"keys[{i}].max_concurrency", k.max_concurrency) for i, k in enumerate(tenants.keys)]
    found.extend((key, "must be at least 1") for key, cap in caps if cap is not None and cap < 1)
    if tenants.concurrency_replicas < 1:
        found.append(("concurrency_replicas", "must be at least 1"))
    found.extend(
        (f"keys[{i}].weight", f"must be 1 to {MAX_WEIGHT}")
        for i, k in enumerate(tenants.keys)
        if not 1 <= k.weight <= MAX_WEIGHT
    )
    names: dict[str, str] = {}
    limits: dict[str, RateLimit] = {}
    models: dict[str, tuple[str, ...]] = {}
    for i, key in enumerate(tenants.keys):
        digest = key.sha256.strip().lower()
        if not key.name:
            found.append((f"keys[{i}].name", "must not be empty"))
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            found.append((f"keys[{i}].sha256", "must be a sha256 in hex (64 characters)"))
        elif digest in names and names[digest] != key.name:
            found.append((f"keys[{i}].sha256", f"is also tenant {names[digest]!r}'s key"))
        names.setdefault(digest, key.name)
        if key.generation is not None:
            found.extend((f"keys[{i}].{k}", m) for k, m in check_generation(key.generation, True))
        if key.rate_limit is not None:
            found.extend((f"keys[{i}].{k}", m) for k, m in check_rate_limit(key.rate_limit))
            if limits.setdefault(key.name, key.rate_limit) != key.rate_limit:
                found.append(
                    (f"keys[{i}].rate_limit", f"differs from another of {key.name!r}'s keys")
                )
        if key.models is not None:
            if not key.models:
                found.append((f"keys[{i}].models", "is empty: leave it out for every model"))
            found.extend(
                (f"keys[{i}].models[{j}]", "must not be empty")
                for j, glob in enumerate(key.models)
                if not glob.strip()
            )
            if models.setdefault(key.name, key.models) != key.models:
                found.append((f"keys[{i}].models", f"differs from another of {key.name!r}'s keys"))
    return found
