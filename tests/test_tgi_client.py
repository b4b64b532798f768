"""Hugging Face's own client of Text Generation Inference (``huggingface_hub``'s
``AsyncInferenceClient.text_generation``, which posts to TGI's ``/``) pointed at the
gateway, in front of the sim's TGI API (``gateway/sim/tgi_api.py``; no TGI server installs
from PyPI): whole and streamed, with and without details, answers pass as they came; a greedy
question asked again is answered from the cache (``cache.own_apis``), the client reading the
replayed stream as it read the first; a sampled one reaches the model each time; another
tenant's key never shares an entry."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from huggingface_hub import AsyncInferenceClient

from tests.helpers import caching_sim, shipped_behind_sim

QUESTION = "Which jacket keeps the rain out?"


@pytest.fixture
async def served(start_gateway: Any, tmp_path: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The sim (its TGI API) and a gateway whose route caches in front of it."""
    async with caching_sim(start_gateway, tmp_path, "tgi") as both:
        yield both


def _hits(gw: Any) -> float:
    return gw.gateway.metrics.cache_lookups.labels("tgi", "hit", "exact")._value.get()


async def _streamed(client: AsyncInferenceClient, **asked: Any) -> tuple[str, Any]:
    text, last = "", None
    async for part in await client.text_generation(QUESTION, stream=True, details=True, **asked):
        text += part.token.text
        last = part
    return text, last


async def test_tgis_client_whole_and_streamed_and_a_greedy_question_comes_back_from_the_cache(
    served,
):
    sim, gw = served
    client = AsyncInferenceClient(base_url=gw.url, api_key="alice")
    first = await client.text_generation(QUESTION, max_new_tokens=6, details=True)
    again = await client.text_generation(QUESTION, max_new_tokens=6, details=True)
    assert first == again and first.details is not None
    assert first.details.generated_tokens == 6 and first.details.finish_reason == "length"
    assert sim.engine.counters.requests == 1 and _hits(gw) == 1
    text, last = await _streamed(client, max_new_tokens=6)
    assert text == first.generated_text == last.generated_text
    assert sim.engine.counters.requests == 2  # a stream: a key of its own
    assert await _streamed(client, max_new_tokens=6) == (text, last)
    assert sim.engine.counters.requests == 2 and _hits(gw) == 2
    plain = await client.text_generation(QUESTION, max_new_tokens=6)
    assert plain == text and sim.engine.counters.requests == 3  # without details: its own
    bob = AsyncInferenceClient(base_url=gw.url, api_key="bob")
    assert (await bob.text_generation(QUESTION, max_new_tokens=6, details=True)) == first
    assert sim.engine.counters.requests == 4  # another tenant: its own entry


async def test_a_sampled_question_reaches_the_model_each_time(served):
    sim, gw = served
    client = AsyncInferenceClient(base_url=gw.url, api_key="alice")
    for asked in (
        {"do_sample": True},
        {"temperature": 0.7},
        {"top_k": 5},
        {"seed": 1, "top_p": 0.9},
    ):
        for _ in range(2):
            await client.text_generation(QUESTION, max_new_tokens=4, **asked)
    assert sim.engine.counters.requests == 8 and _hits(gw) == 0


@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
async def test_tgis_own_paths_are_cached_as_asked(served, path):
    """``/generate`` answers one JSON object and ``/generate_stream`` its SSE stream; each,
    asked greedy, is answered from the cache the second time, byte for byte."""
    sim, gw = served
    body = {"inputs": QUESTION, "parameters": {"max_new_tokens": 5, "details": True}}
    async with httpx.AsyncClient(base_url=gw.url) as http:
        first = await http.post(path, json=body)
        again = await http.post(path, json=body)
    assert first.status_code == again.status_code == 200
    assert [first.headers["X-Gateway-Cache"], again.headers["X-Gateway-Cache"]] == ["miss", "hit"]
    assert first.content == again.content and sim.engine.counters.requests == 1
    if path == "/generate_stream":
        assert again.headers["Content-Type"].startswith("text/event-stream")
        assert first.content.count(b"data:") == 5 and b'"generated_text": null' in first.content


async def test_a_refused_question_is_tgis_own_answer_and_not_stored(served):
    _, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as http:
        for _ in range(2):
            answer = await http.post("/generate", json={"inputs": "", "parameters": {}})
            assert answer.status_code == 422 and answer.json()["error_type"] == "validation"
            assert answer.headers["X-Gateway-Cache"] == "miss"
    assert _hits(gw) == 0


async def test_the_shipped_tgi_policy_caches_bounds_and_serves_tgis_client(start_gateway, tmp_path):
    """``policies/tgi.yaml`` against the sim: keyed by what the server says it serves
    (``model_version: auto``), a greedy question streamed twice is generated once; a call
    naming no ``max_new_tokens`` (the client sends ``null``) is given the policy's 512, one
    asking 5000 is clamped to 2048, as the sim's counts show."""
    async with shipped_behind_sim(
        start_gateway, tmp_path, "tgi", "http://127.0.0.1:3000", "tgi"
    ) as (sim, gw):
        client = AsyncInferenceClient(base_url=gw.url)
        _, first = await _streamed(client)
        _, again = await _streamed(client)
        assert first == again and first.details.generated_tokens == 512
        assert sim.engine.counters.requests == 1
        long = await client.text_generation(QUESTION, max_new_tokens=5000, details=True)
        assert long.details is not None and long.details.generated_tokens == 2048
