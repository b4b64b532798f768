"""Ollama's official Python client (``ollama``) pointed at the gateway, in front of the sim's
Ollama API (``gateway/sim/ollama_api.py``): chat, generate and embed, streamed (when asked)
and whole, pass as they came; a greedy question asked again is
answered from the cache (``cache.own_apis``), the client reading the replayed stream as it
read the first; a sampled one reaches the model each time; another tenant's key never
shares an entry."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama  # the test extra's
import pytest

from gateway.sim.ollama_api import VERSION
from tests.helpers import caching_sim, shipped_behind_sim

GREEDY = {"temperature": 0, "num_predict": 8}
QUESTION = [{"role": "user", "content": "Which jacket keeps the rain out?"}]


@pytest.fixture
async def served(start_gateway: Any, tmp_path: Any) -> AsyncIterator[tuple[Any, Any]]:
    """The sim (its Ollama API) and a gateway whose route caches in front of it."""
    async with caching_sim(start_gateway, tmp_path, "ollama", "/api/*") as both:
        yield both


async def _streamed(client: Any, **asked: Any) -> tuple[str, dict[str, Any]]:
    text, last = "", {}
    async for part in await client.chat(stream=True, **asked):
        text += part.message.content or ""
        last = part.model_dump()
    return text, last


async def test_ollamas_client_streams_and_a_greedy_stream_comes_back_from_the_cache(served):
    sim, gw = served
    client = ollama.AsyncClient(host=gw.url, headers={"Authorization": "Bearer alice"})
    asked: dict[str, Any] = {"model": "gemma3", "messages": QUESTION, "options": GREEDY}
    first, done = await _streamed(client, **asked)
    again, done_again = await _streamed(client, **asked)
    assert first and again == first
    assert done["done"] is True and done["done_reason"] == "length"
    assert done_again == done and done["eval_count"] == 8
    assert sim.engine.counters.requests == 1  # the second from the cache
    whole = await client.chat(stream=False, **asked)  # a key of its own: the model again
    assert whole.message.content == first and sim.engine.counters.requests == 2
    assert (await client.chat(stream=False, **asked)).message.content == first
    assert sim.engine.counters.requests == 2
    bob = ollama.AsyncClient(host=gw.url, headers={"Authorization": "Bearer bob"})
    assert (await _streamed(bob, **asked))[0] == first
    assert sim.engine.counters.requests == 3  # another tenant: its own entry
    hits = gw.gateway.metrics.cache_lookups.labels("ollama", "hit", "exact")._value.get()
    assert hits == 2


async def test_a_sampled_question_and_generate_reach_the_model_each_time(served):
    sim, gw = served
    client = ollama.AsyncClient(host=gw.url)
    for _ in range(2):  # Ollama's default temperature samples
        await _streamed(client, model="gemma3", messages=QUESTION)
    assert sim.engine.counters.requests == 2
    texts = []
    for _ in range(2):
        parts = await client.generate(model="gemma3", prompt="Rain?", options=GREEDY, stream=True)
        texts.append("".join([part.response or "" async for part in parts]))
    assert texts[0] and texts[0] == texts[1] and sim.engine.counters.requests == 3
    assert (await client.list()).models[0].model == sim.engine.config.model_names[0]
    async with httpx.AsyncClient(base_url=gw.url) as http:  # the client has no call for it
        assert (await http.get("/api/version")).json() == {"version": VERSION}


async def test_a_bad_request_gets_ollamas_own_error(served):
    _, gw = served
    client = ollama.AsyncClient(host=gw.url)
    with pytest.raises(ollama.ResponseError) as refused:
        await client.chat(model="gemma3", messages=[], stream=False)
    assert refused.value.status_code == 400 and "messages" in refused.value.error


async def test_ollamas_embed_is_answered_from_the_cache(served):
    """``/api/embed`` is one of the servers' own deterministic calls: the same inputs asked
    again get the same vectors from the cache; another input reaches the model."""
    sim, gw = served
    client = ollama.AsyncClient(host=gw.url)
    first = await client.embed(model="nomic-embed-text", input=["rain jacket", "boots"])
    again = await client.embed(model="nomic-embed-text", input=["rain jacket", "boots"])
    assert len(first.embeddings) == 2 and again.embeddings == first.embeddings
    assert sim.engine.counters.requests == 1
    other = await client.embed(model="nomic-embed-text", input="umbrella")
    assert len(other.embeddings) == 1 and sim.engine.counters.requests == 2


async def test_the_shipped_ollama_policy_caches_bounds_and_serves_ollamas_client(
    start_gateway, tmp_path
):
    """``policies/ollama.yaml`` against the sim: keyed by the digests the server gives
    (``model_version: auto``), a greedy chat streamed twice is generated once; a call naming no ``num_predict`` is given the policy's 512, one asking -1 (until
    the end) is clamped to 2048, as the sim's counts show."""
    async with shipped_behind_sim(
        start_gateway, tmp_path, "ollama", "http://127.0.0.1:11434", "ollama"
    ) as (sim, gw):
        client = ollama.AsyncClient(host=gw.url)
        asked: dict[str, Any] = {"model": "gemma3", "messages": QUESTION}
        _, first = await _streamed(client, **asked, options={"temperature": 0})
        _, again = await _streamed(client, **asked, options={"temperature": 0})
        assert first == again and first["eval_count"] == 512
        assert sim.engine.counters.requests == 1
        endless = await client.chat(**asked, options={"num_predict": -1}, stream=False)
        assert endless.eval_count == 2048 and endless.done_reason == "length"


async def test_a_paraphrase_to_ollamas_chat_is_answered_by_the_embedding_tier(
    start_gateway, tmp_path
):
    """Ollama's chat on a route with ``semantic: {method: embedding}``: a paraphrase of a
    greedy question asked through Ollama's client is answered from the cache, verified as
    chat's paraphrases are; another tenant's is not."""
    cache = {"ttl_s": 60, "semantic": {"method": "embedding"}}
    async with caching_sim(start_gateway, tmp_path, "ollama", "/api/*", cache=cache) as (sim, gw):

        def ask(question: str) -> dict[str, Any]:
            messages = [{"role": "user", "content": question}]
            return {"model": "gemma3", "messages": messages, "options": GREEDY, "stream": False}

        alice = ollama.AsyncClient(host=gw.url, headers={"Authorization": "Bearer alice"})
        first = await alice.chat(**ask("What is the best way to learn Python?"))
        para = await alice.chat(**ask("How can I learn Python?"))
        assert para.message.content == first.message.content
        assert sim.engine.counters.requests == 1
        bob = ollama.AsyncClient(host=gw.url, headers={"Authorization": "Bearer bob"})
        await bob.chat(**ask("How should I learn Python?"))
        assert sim.engine.counters.requests == 2
        hits = gw.gateway.metrics.cache_lookups.labels("ollama", "hit", "embedding")._value.get()
        assert hits == 1
