"""Who a request belongs to: the tenant scope that isolates cache entries, shared calls and
batches, and the key a per-tenant rate limit counts.

Both come from the headers as the client sent them, before hop-by-hop stripping (so a
``Connection: authorization`` cannot move a request into another scope), and in canonical
form: whitespace runs collapsed and trimmed, an auth scheme in lower case (RFC 9110 11.1),
so ``bearer  K`` and ``Bearer K`` are one tenant.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization"})


def canonical(name: str, value: str) -> str:
    """A header value as the scope and the rate limit compare it."""
    value = " ".join(value.split())
    if name.lower() in CREDENTIAL_HEADERS:
        scheme, sep, rest = value.partition(" ")
        return scheme.lower() + sep + rest
    return value


def scope_hash(headers: Iterable[tuple[str, str]], scope_headers: Iterable[str]) -> str:
    """A hash of the scope headers' canonical values: equal only for the same tenant.

    A missing header and an empty one hash differently; an empty ``scope_headers`` makes one
    scope shared by all clients (only for a single-tenant deployment).
    """
    wanted = [h.lower() for h in scope_headers]
    values: dict[str, list[str]] = {h: [] for h in wanted}
    for name, value in headers:
        lower = name.lower()
        if lower in values:
            values[lower].append(canonical(lower, value))
    digest = hashlib.sha256(b"scope\x00")
    for name in wanted:
        digest.update(name.encode() + b"\x00" + json.dumps(values[name]).encode() + b"\x00")
    return digest.hexdigest()[:32]


def rate_key(headers: Iterable[tuple[str, str]], client: str) -> str:
    """Who a rate limit counts: a hash of the canonical ``Authorization`` (never kept in
    clear), else the client's address."""
    for name, value in headers:
        if name.lower() == "authorization":
            credential = canonical("authorization", value).encode("utf-8", "surrogateescape")
            return "auth:" + hashlib.sha256(credential).hexdigest()[:16]
    return "addr:" + client
