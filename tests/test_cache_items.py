"""Per-item caching of ``/v1/embeddings``: only missing inputs go upstream."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gateway.cache import ResponseCache
from gateway.cache.items import (
    CachedItem,
    assemble,
    fresh_items,
    missing,
    plan_items,
    split_input,
    upstream_body,
)
from gateway.cache.stores import MemoryStore

WHERE = {"scope": "s", "route": "r", "backend": "emb", "model_version": "v1"}
PATH = "/v1/embeddings"


def upstream_answer(inputs: Sequence[str], tokens: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": [float(len(x))]}
            for i, x in enumerate(inputs)
        ],
        "model": "e5",
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


async def test_hundred_inputs_ninety_cached_sends_only_ten_upstream() -> None:
    cache = ResponseCache(MemoryStore())
    inputs = [f"sentence number {i}" for i in range(100)]
    warm = {"model": "e5", "input": inputs[:90]}
    warm_plan = plan_items(warm, path=PATH, **WHERE)
    assert warm_plan is not None
    warm_fresh = fresh_items(upstream_answer(inputs[:90], 900), warm_plan, range(90))
    await cache.put_items(warm_plan, warm_fresh, 60, **WHERE)

    body = {"model": "e5", "input": inputs}
    plan = plan_items(body, path=PATH, **WHERE)
    assert plan is not None
    cached = await cache.get_items(plan)
    todo = missing(cached)
    assert todo == tuple(range(90, 100))
    sent = upstream_body(body, plan, todo)
    assert sent["input"] == inputs[90:] and sent["model"] == "e5"
    fresh = fresh_items(upstream_answer(sent["input"], 70), plan, todo)
    answer = assemble(body, cached, fresh)
    assert [d["index"] for d in answer["data"]] == list(range(100))
    assert [d["embedding"] for d in answer["data"]] == [[float(len(x))] for x in inputs]
    assert answer["usage"] == {"prompt_tokens": 970, "total_tokens": 970}
    assert cache.results["item_hit"] == 90 and cache.results["item_miss"] == 10


def test_usage_is_apportioned_by_tokens_and_adds_up() -> None:
    """Each item's share follows its words and punctuation (what a tokenizer's count
    follows), not its number of characters or of items."""
    body = {"model": "e", "input": ["Hi", "two words", "and, three more"]}
    plan = plan_items(body, path=PATH, **WHERE)
    assert plan is not None
    fresh = fresh_items(upstream_answer(body["input"], 14), plan, [0, 1, 2])
    assert [fresh[i].tokens for i in range(3)] == [2, 4, 8]
    fresh = fresh_items(upstream_answer(body["input"], 7), plan, [0, 1, 2])
    assert sum(f.tokens for f in fresh.values()) == 7


def test_the_backends_own_count_of_each_item_wins() -> None:
    body = {"model": "e", "input": ["Hi", "two words"]}
    plan = plan_items(body, path=PATH, **WHERE)
    assert plan is not None
    answer = upstream_answer(body["input"], 9)
    for entry, own in zip(answer["data"], (5, 4), strict=True):
        entry["usage"] = {"prompt_tokens": own}
    fresh = fresh_items(answer, plan, [0, 1])
    assert [fresh[i].tokens for i in range(2)] == [5, 4]


def test_upstream_answers_out_of_order_are_placed_by_index() -> None:
    body = {"model": "e", "input": ["x", "yy"]}
    plan = plan_items(body, path=PATH, **WHERE)
    assert plan is not None
    answer = upstream_answer(body["input"], 3)
    answer["data"].reverse()
    fresh = fresh_items(answer, plan, [0, 1])
    assert fresh[0].embedding == [1.0] and fresh[1].embedding == [2.0]
    answer["data"].pop()
    with pytest.raises(ValueError):
        fresh_items(answer, plan, [0, 1])


def test_input_shapes() -> None:
    assert split_input("one") == ["one"]
    assert split_input([1, 2, 3]) == [[1, 2, 3]]
    assert split_input([[1, 2], [3]]) == [[1, 2], [3]]
    assert split_input(["a", "b"]) == ["a", "b"]
    assert split_input([]) is None and split_input(["a", [1]]) is None


def test_item_keys_depend_on_parameters_and_item_but_not_position() -> None:
    a = plan_items({"model": "e", "input": ["x", "y"]}, path=PATH, **WHERE)
    b = plan_items({"model": "e", "input": ["y", "x"]}, path=PATH, **WHERE)
    c = plan_items({"model": "e", "input": ["x"], "dimensions": 64}, path=PATH, **WHERE)
    d = plan_items({"model": "e", "input": ["x"]}, path=PATH, **(WHERE | {"scope": "t"}))
    assert a and b and c and d
    assert a.keys == tuple(reversed(b.keys))
    assert c.keys[0] != a.keys[0] and d.keys[0] != a.keys[0]


def test_fully_cached_request_is_assembled_without_upstream() -> None:
    body = {"model": "e", "input": ["x"]}
    answer = assemble(body, [CachedItem([0.5], 2, "e")], {})
    assert answer["data"] == [{"object": "embedding", "index": 0, "embedding": [0.5]}]
    assert answer["model"] == "e" and answer["usage"]["total_tokens"] == 2
