"""Per-item caching for ``/v1/embeddings``: each input is cached on its own.

A request with N inputs of which some are cached goes upstream once, with only the missing
inputs (same model and parameters); the answer to the client has all N embeddings in
input order with ``index`` 0..N-1.  Usage is apportioned: each item is stored with its share
of the upstream ``prompt_tokens`` (the backend's own count of each entry where it gives one,
else by ``openai.usage.token_weight``: exact for token arrays, words and punctuation for
texts; largest remainder so the shares add up), and the answer reports the sum over all N
items, as if the whole request had gone upstream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.cache.keys import canonical_json, item_key
from gateway.openai.usage import entry_tokens, token_weight


@dataclass(frozen=True, slots=True)
class ItemPlan:
    """The inputs of one embeddings request and the cache key of each."""

    inputs: tuple[Any, ...]
    keys: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class CachedItem:
    """One stored embedding (a float list, or a base64 string) and its token share;
    ``created_at`` is the wall time it was stored (set on reads, for ``Age``; not encoded)."""

    embedding: Any
    tokens: int
    model: str
    created_at: float = field(default=0.0, compare=False)


def plan_items(
    body: Mapping[str, Any],
    *,
    scope: str,
    route: str,
    backend: str,
    model_version: str,
    path: str,
    query: str = "",
    vary: str = "",
) -> ItemPlan | None:
    """Split an embeddings body into items; None when ``input`` is not a list shape that
    can be split (then the request goes through whole)."""
    inputs = split_input(body.get("input"))
    if not inputs:
        return None
    params = canonical_json(body, drop=("input",))
    keys = tuple(
        item_key(
            params,
            item,
            scope=scope,
            route=route,
            backend=backend,
            model_version=model_version,
            path=path,
            query=query,
            vary=vary,
        )
        for item in inputs
    )
    return ItemPlan(tuple(inputs), keys)


def split_input(value: Any) -> list[Any] | None:
    """``input`` as a list of items: a string or a token array is one item."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if all(isinstance(v, str) for v in value) or all(_is_tokens(v) for v in value):
        return list(value)
    return None


def missing(cached: Sequence[CachedItem | None]) -> tuple[int, ...]:
    """Positions of the items the cache did not have."""
    return tuple(i for i, item in enumerate(cached) if item is None)


def upstream_body(
    body: Mapping[str, Any], plan: ItemPlan, positions: Sequence[int]
) -> dict[str, Any]:
    """The request to send upstream: the same parameters, only the missing inputs."""
    return {**body, "input": [plan.inputs[i] for i in positions]}


def fresh_items(
    answer: Mapping[str, Any], plan: ItemPlan, positions: Sequence[int]
) -> dict[int, CachedItem]:
    """The upstream answer's embeddings as items, keyed by position in the original request.

    Raises ``ValueError`` when the answer does not hold one embedding per sent input.
    """
    data = answer.get("data")
    if not isinstance(data, list) or len(data) != len(positions):
        raise ValueError("upstream answer does not hold one embedding per input")
    by_index = {d.get("index", n): d for n, d in enumerate(data)}
    if sorted(by_index) != list(range(len(positions))):
        raise ValueError("upstream answer indexes are not 0..n-1")
    usage = answer.get("usage") or {}
    total = int(usage.get("prompt_tokens") or 0)
    own = entry_tokens([by_index[n] for n in range(len(positions))])
    shares = own or _apportion(total, [token_weight(plan.inputs[p]) for p in positions])
    model = str(answer.get("model", ""))
    return {
        p: CachedItem(by_index[n]["embedding"], shares[n], model) for n, p in enumerate(positions)
    }


def assemble(
    body: Mapping[str, Any],
    cached: Sequence[CachedItem | None],
    fresh: Mapping[int, CachedItem],
) -> dict[str, Any]:
    """The client's answer: every item in input order, indexed 0..N-1, usage summed."""
    items: list[CachedItem] = []
    for i, item in enumerate(cached):
        chosen = item if item is not None else fresh.get(i)
        if chosen is None:
            raise ValueError(f"no embedding for input {i}")
        items.append(chosen)
    tokens = sum(item.tokens for item in items)
    model = next((f.model for f in fresh.values() if f.model), None) or str(body.get("model", ""))
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": item.embedding}
            for i, item in enumerate(items)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def encode_item(item: CachedItem) -> bytes:
    return json.dumps(
        {"e": item.embedding, "t": item.tokens, "m": item.model}, separators=(",", ":")
    ).encode()


def decode_item(data: bytes) -> CachedItem:
    """Parse what ``encode_item`` wrote; ``ValueError`` if it is not an item."""
    try:
        raw = json.loads(data)
        return CachedItem(raw["e"], int(raw["t"]), str(raw["m"]))
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"corrupt cached item: {exc}") from exc


def _is_tokens(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    )


def _apportion(total: int, weights: Sequence[int]) -> list[int]:
    """Split ``total`` in proportion to ``weights``; the shares add up to ``total``."""
    whole = sum(weights)
    raw = [total * w / whole for w in weights]
    shares = [int(r) for r in raw]
    by_remainder = sorted(range(len(raw)), key=lambda i: raw[i] - shares[i], reverse=True)
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares
