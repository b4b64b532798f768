"""SGLang's native ``/generate`` through the gateway, in front of the sim's SGLang API
(``gateway/sim/sglang_api.py``; SGLang's server needs a GPU build and its client ships
inside it, so the client here posts as SGLang's own docs do, with a plain HTTP client):
whole and streamed, a greedy question (``sampling_params.temperature`` 0) asked again is
answered from the cache (``cache.own_apis``), the stream replayed byte for byte; a sampled
one, or one in a session, reaches the model each time; another tenant's key never shares an
entry; TGI's body at the same path is still TGI's; a route's bound clamps
``sampling_params.max_new_tokens``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.openai.generation import BOUND_HEADER
from tests.helpers import caching_sim, shipped_behind_sim

QUESTION = "Which jacket keeps the rain out?"
GREEDY = {"text": QUESTION, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}


@pytest.fixture
async def served(start_gateway: Any, tmp_path: Any) -> AsyncIterator[tuple[Any, Any]]:
    async with caching_sim(
        start_gateway, tmp_path, "sglang", generation={"max_tokens": 64}
    ) as both:
        yield both


async def post(gw: Any, body: dict[str, Any], key: str = "alice") -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(
            gw.url + "/generate", json=body, headers={"Authorization": f"Bearer {key}"}
        )


def events(answer: httpx.Response) -> list[Any]:
    """A stream's events, ``[DONE]`` as a string."""
    parts = [p for p in answer.content.split(b"\n\n") if p.strip()]
    assert all(p.startswith(b"data: ") for p in parts)
    return [p[6:].decode() if p == b"data: [DONE]" else json.loads(p[6:]) for p in parts]


async def test_a_greedy_question_whole_and_streamed_comes_back_from_the_cache(served):
    sim, gw = served
    first, again = await post(gw, GREEDY), await post(gw, GREEDY)
    assert [first.headers["x-gateway-cache"], again.headers["x-gateway-cache"]] == ["miss", "hit"]
    assert first.content == again.content and sim.engine.counters.requests == 1
    answer = first.json()
    assert answer["meta_info"]["completion_tokens"] == 6
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    streamed = {**GREEDY, "stream": True}
    one, two = await post(gw, streamed), await post(gw, streamed)
    assert [one.headers["x-gateway-cache"], two.headers["x-gateway-cache"]] == ["miss", "hit"]
    assert one.content == two.content and sim.engine.counters.requests == 2  # its own key
    told = events(two)
    assert told[-1] == "[DONE]" and told[-2]["text"] == answer["text"]
    assert told[-2]["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
    assert all(event["meta_info"]["finish_reason"] is None for event in told[:-2])
    bob = await post(gw, GREEDY, key="bob")  # another tenant: its own entry
    assert bob.headers["x-gateway-cache"] == "miss" and sim.engine.counters.requests == 3


@pytest.mark.parametrize(
    "body",
    [
        {"text": QUESTION},  # SGLang samples at temperature 1.0 unless told
        {"text": QUESTION, "sampling_params": {"temperature": 0.7}},
        {"text": QUESTION, "sampling_params": {"temperature": 0}, "session_params": {"id": "s"}},
        {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.1}, "stream": True},
    ],
    ids=["default", "warm", "session", "ids-sampled"],
)
async def test_a_sampled_question_reaches_the_model_each_time(served, body):
    sim, gw = served
    for _ in range(2):
        assert (await post(gw, body)).headers["x-gateway-cache"] == "bypass"
    assert sim.engine.counters.requests == 2


async def test_token_ids_greedy_are_cached_too(served):
    sim, gw = served
    body = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0}}
    assert (await post(gw, body)).status_code == 200
    assert (await post(gw, body)).headers["x-gateway-cache"] == "hit"
    assert sim.engine.counters.requests == 1


async def test_tgis_body_at_the_same_path_is_still_tgis(served):
    sim, gw = served
    body = {"inputs": QUESTION, "parameters": {"max_new_tokens": 4}}
    first, again = await post(gw, body), await post(gw, body)
    assert "generated_text" in first.json() and again.headers["x-gateway-cache"] == "hit"
    assert sim.engine.counters.requests == 1


async def test_the_routes_bound_clamps_max_new_tokens(served):
    _, gw = served
    body = {"text": QUESTION, "sampling_params": {"temperature": 0, "max_new_tokens": 5000}}
    answer = await post(gw, body)
    assert answer.headers[BOUND_HEADER] == "64"
    assert answer.json()["meta_info"]["completion_tokens"] <= 64


async def test_the_shipped_sglang_policy_caches_and_bounds_sglangs_api(start_gateway, tmp_path):
    """``policies/sglang.yaml`` against the sim: keyed by what the server says it serves
    (``model_version: auto``), a greedy question streamed twice is generated once; a call
    naming no ``max_new_tokens`` is given the policy's 512, one asking 5000 is clamped to
    2048, as the sim's counts show; a batch past 64 answers is refused."""
    async with shipped_behind_sim(
        start_gateway, tmp_path, "sglang", "http://127.0.0.1:30000", "sglang"
    ) as (sim, gw):
        streamed = {"text": QUESTION, "sampling_params": {"temperature": 0}, "stream": True}
        first, again = await post(gw, streamed), await post(gw, streamed)
        assert first.content == again.content and sim.engine.counters.requests == 1
        assert events(first)[-2]["meta_info"]["completion_tokens"] == 512
        long = {"text": QUESTION, "sampling_params": {"max_new_tokens": 5000}}
        assert (await post(gw, long)).json()["meta_info"]["completion_tokens"] == 2048
        batch = {"text": [QUESTION] * 65, "sampling_params": {"temperature": 0}}
        assert (await post(gw, batch)).status_code == 400
