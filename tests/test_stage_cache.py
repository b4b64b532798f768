"""The cache stage's contract, through a running gateway in front of the simulated GPU,
run against both stores: memory and a real Redis (one redis-server, and a three-master
Redis Cluster).

Time is injected (``FakeClock``); Redis expiry is brought forward by shortening the keys'
TTLs, never by sleeping.  The sim gives every answer a fresh id, so a cached answer is told
apart from a fresh one by its id, and its counters say what reached the "GPU".
"""

from __future__ import annotations

import asyncio
import gc
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway.openai.sse import parse_sse
from gateway.policy.model import Redis
from gateway.sim import SimConfig, SimServer, start_sim
from gateway.testing import FakeClock
from tests.redis_cluster import admin_client, policy_section, settings_for
from tests.redis_server import RedisServer, redis_server, redis_url  # noqa: F401

CHAT = "/v1/chat/completions"
EMBEDDINGS = "/v1/embeddings"
ALICE, BOB = "Bearer sk-alice", "Bearer sk-bob"
TOKEN = "purge-secret"
TTL_S = 60
PREFIX = "gw:"

POLICY = """
backends:
  gpu: {{url: "{sim}", model_version: "{version}"}}
  spare: {{url: "{sim}", model_version: "spare@1"}}
  odd: {{url: "{odd}"}}
admin: {{token: {token}}}
cache: {cache}
redis: {redis}
routes:
  - name: chat-spare
    match: {{path: {chat}, model: spare-model}}
    backend: spare
    cache: {{ttl_s: {ttl}, semantic: {{method: simhash}}}}
  - name: chat-odd
    match: {{path: {chat}, model: "odd-*"}}
    backend: odd
    cache: {{ttl_s: {ttl}}}
  - name: chat
    match: {{path: {chat}}}
    backend: gpu
    cache: {{ttl_s: {ttl}, semantic: {{method: simhash}}}}
  - name: embeddings
    match: {{path: {embeddings}}}
    backend: gpu
    cache: {{ttl_s: {ttl}}}
  - name: other
    match: {{path: "/*"}}
    backend: gpu
"""


@dataclass
class Answer:
    """One response as the client saw it."""

    status: int
    headers: Any
    body: bytes

    @property
    def cache(self) -> str | None:
        return self.headers.get("X-Gateway-Cache")

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def id(self) -> str:
        if self.body.startswith(b"data:"):
            return str(json.loads(parse_sse(self.body)[0])["id"])
        return str(self.json["id"])

    @property
    def text(self) -> str:
        """The answer's text, from a JSON answer or an SSE stream."""
        if not self.body.startswith(b"data:"):
            return str(self.json["choices"][0]["message"]["content"])
        pieces = []
        for event in parse_sse(self.body):
            if event == "[DONE]":
                continue
            for choice in json.loads(event).get("choices") or ():
                pieces.append(choice.get("delta", {}).get("content") or "")
        return "".join(pieces)


@dataclass
class Odd:
    """An upstream whose streams end badly: cut off, or with an error event."""

    calls: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CHAT, self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": f"chatcmpl-odd{self.calls}",
            "object": "chat.completion.chunk",
            "model": body["model"],
            "choices": [{"index": 0, "delta": {"content": "partial"}, "finish_reason": None}],
        }
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if body["model"] == "odd-cut":
            assert request.transport is not None
            request.transport.close()  # the backend dies mid-stream
            return response
        await response.write(b'data: {"error": {"message": "model crashed"}}\n\n')
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass
class Env:
    """A gateway with caching over one store, the sim behind it, and ways to drive them."""

    store: str
    gateway: Any
    url: str
    admin_url: str
    sim: SimServer
    odd: Odd
    clock: FakeClock
    policy_path: Path
    policy_args: dict[str, Any]
    session: aiohttp.ClientSession
    redis: Any = None
    extra: list[Any] = field(default_factory=list)

    async def post(
        self, path: str, body: dict[str, Any], tenant: str | None = ALICE, **headers: str
    ) -> Answer:
        sent = {k.replace("_", "-"): v for k, v in headers.items()}
        if tenant is not None:
            sent["Authorization"] = tenant
        async with self.session.post(self.url + path, json=body, headers=sent) as response:
            return Answer(response.status, response.headers, await response.read())

    async def chat(self, text: str, tenant: str | None = ALICE, **extra: Any) -> Answer:
        headers = extra.pop("headers", {})
        return await self.post(CHAT, chat_body(text, **extra), tenant, **headers)

    @property
    def upstream_calls(self) -> int:
        return int(self.sim.state()["calls"])

    @property
    def upstream_items(self) -> int:
        return int(self.sim.state()["items"])

    async def advance(self, seconds: float) -> None:
        """Let time pass for the gateway's clock and for Redis's expiry."""
        self.clock.advance(seconds)
        if self.redis is None:
            return
        async for name in self.redis.scan_iter(match=PREFIX + "*"):
            left = await self.redis.pttl(name)
            if left < 0:
                continue
            if left <= seconds * 1000:
                await self.redis.delete(name)
            else:
                await self.redis.pexpire(name, int(left - seconds * 1000))

    async def purge(self, token: str | None = TOKEN, **filters: Any) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.post(
            self.admin_url + "/cache/purge", json=filters, headers=headers
        ) as response:
            return response.status, await response.json()

    async def metric(self, line_start: str) -> float:
        async with self.session.get(self.admin_url + "/metrics") as response:
            text = await response.text()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(line_start):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def rewrite_policy(self, **changes: Any) -> None:
        self.policy_args.update(changes)
        self.policy_path.write_text(POLICY.format(**self.policy_args))
        self.gateway.reload(force=True)


def chat_body(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "temperature": 0,
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": text},
        ],
        **extra,
    }


async def clear_redis(redis: Redis) -> Any:
    client = admin_client(redis)
    async for name in client.scan_iter(match=PREFIX + "*"):
        await client.delete(name)
    return client


async def make_env(
    store: str, redis: Redis | None, start_gateway: Any, serve_app: Any, tmp_path: Path
) -> Env:
    sim = await start_sim(SimConfig(port=0, base_ms=1.0, per_item_ms=0.0, token_ms=0.0))
    odd = Odd()
    odd_url = await serve_app(odd.app())
    args = {
        "sim": sim.url,
        "odd": odd_url,
        "version": "gpu@1",
        "token": TOKEN,
        "cache": "{store: memory}" if redis is None else "{store: redis}",
        "redis": json.dumps(policy_section(redis) if redis is not None else {}),
        "ttl": TTL_S,
        "chat": CHAT,
        "embeddings": EMBEDDINGS,
    }
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(**args))
    clock = FakeClock()
    running = await start_gateway(policy=path, clock=clock, warmup=False, watch_interval_s=60)
    admin = await clear_redis(redis) if redis is not None else None
    session = aiohttp.ClientSession()
    return Env(
        store,
        running.gateway,
        running.url,
        running.admin_url,
        sim,
        odd,
        clock,
        path,
        args,
        session,
        admin,
    )


async def close_env(env: Env) -> None:
    await env.session.close()
    await env.sim.close()
    if env.redis is not None:
        async for name in env.redis.scan_iter(match=PREFIX + "*"):
            await env.redis.delete(name)
        await env.redis.aclose()


@pytest.fixture(params=["memory", "standalone", "cluster"])
async def env(
    request: pytest.FixtureRequest, start_gateway: Any, serve_app: Any, tmp_path: Path
) -> AsyncIterator[Env]:
    redis = None if request.param == "memory" else settings_for(request, request.param)
    store = "memory" if redis is None else "redis"
    environment = await make_env(store, redis, start_gateway, serve_app, tmp_path)
    yield environment
    await close_env(environment)


# -- hits, misses and their headers --------------------------------------------------------


async def test_a_repeat_is_answered_from_cache_with_its_headers(env: Env) -> None:
    first = await env.chat("What is a sidecar container?")
    assert first.status == 200 and first.cache == "miss"
    assert "X-Gateway-Cache-Match" not in first.headers and "Age" not in first.headers
    await env.advance(7)
    second = await env.chat("What is a sidecar container?")
    assert second.status == 200 and second.cache == "hit"
    assert second.headers["X-Gateway-Cache-Match"] == "exact"
    assert second.headers["X-Gateway-Cache-Similarity"] == "1.000"
    assert second.headers["Age"] == "7"
    assert second.headers["X-Gateway-Backend"] == "gpu"
    assert second.headers["Content-Type"].startswith("application/json")
    assert second.body == first.body and env.upstream_calls == 1


async def test_a_near_duplicate_hits_through_simhash_but_not_with_another_number(
    env: Env,
) -> None:
    stored = await env.chat("How many GPUs does the cluster have in rack 12?")
    near = await env.chat("how many gpus does the cluster have in rack 12")
    assert near.cache == "hit" and near.headers["X-Gateway-Cache-Match"] == "simhash"
    assert near.id == stored.id
    assert 0 < float(near.headers["X-Gateway-Cache-Similarity"]) <= 1
    other = await env.chat("How many GPUs does the cluster have in rack 13?")
    assert other.cache == "miss" and other.id != stored.id
    negated = await env.chat("How many GPUs does the cluster not have in rack 12?")
    assert negated.cache == "miss"


async def test_the_context_and_parameters_must_match_exactly(env: Env) -> None:
    await env.chat("Name a prime number.")
    assert (await env.chat("Name a prime number.", max_tokens=4)).cache == "miss"
    other_system = chat_body("name a prime number")
    other_system["messages"][0]["content"] = "You are verbose."
    assert (await env.post(CHAT, other_system)).cache == "miss"
    assert (await env.chat("Name a prime number.", user="someone-else")).cache == "hit"


async def test_tenants_never_see_each_others_entries(env: Env) -> None:
    prompts = [f"What does service number {i} do?" for i in range(8)]
    for text in prompts:
        assert (await env.chat(text, tenant=ALICE)).cache == "miss"
        assert (await env.chat(text, tenant=ALICE)).cache == "hit"
    for tenant in (BOB, None, ALICE.upper()):
        for text in prompts:
            exact = await env.chat(text, tenant=tenant)
            near = await env.chat(text.lower().rstrip("?"), tenant=tenant)
            assert exact.cache == "miss", (tenant, text)
            assert near.cache in ("miss", "hit") and near.id in (exact.id,), (tenant, text)
    lookups = await env.metric('gateway_cache_lookups_total{match="exact",result="hit"')
    assert lookups == len(prompts)


async def test_entries_expire_after_their_ttl(env: Env) -> None:
    first = await env.chat("Explain KV cache eviction.")
    await env.advance(TTL_S - 5)
    kept = await env.chat("Explain KV cache eviction.")
    assert kept.cache == "hit" and kept.headers["Age"] == str(TTL_S - 5)
    await env.advance(10)
    expired = await env.chat("Explain KV cache eviction.")
    assert expired.cache == "miss" and expired.id != first.id
    assert (await env.chat("Explain KV cache eviction.")).id == expired.id


async def test_bumping_model_version_misses_at_once(env: Env) -> None:
    old = await env.chat("Summarise the release notes.")
    env.rewrite_policy(version="gpu@2")
    new = await env.chat("Summarise the release notes.")
    assert new.cache == "miss" and new.id != old.id
    assert (await env.chat("Summarise the release notes.")).id == new.id
    env.rewrite_policy(version="gpu@1")  # the old version's entries were never mixed in
    assert (await env.chat("Summarise the release notes.")).id == old.id


async def test_a_hit_needs_no_backend(env: Env) -> None:
    stored = await env.chat("Is the GPU needed for a hit?")
    await env.sim.close()
    again = await env.chat("Is the GPU needed for a hit?")
    assert again.status == 200 and again.cache == "hit" and again.id == stored.id


# -- what is cacheable ----------------------------------------------------------------------


async def test_sampled_and_multi_choice_requests_bypass_the_cache(env: Env) -> None:
    sampled = chat_body("Write a haiku.")
    del sampled["temperature"]  # the API default is 1
    for body in (sampled, chat_body("Write a haiku.", temperature=0.7)):
        first, second = await env.post(CHAT, body), await env.post(CHAT, body)
        assert first.cache == second.cache == "bypass"
        assert first.id != second.id
    assert env.upstream_calls == 4
    several = [await env.post(CHAT, chat_body("Write a haiku.", n=2)) for _ in range(2)]
    assert [a.cache for a in several] == ["bypass", "bypass"]
    assert [a.status for a in several] == [400, 400]  # the sim's own answer, passed on
    assert await env.metric('gateway_cache_lookups_total{match="none",result="bypass"') == 6


async def test_cache_control_no_cache_skips_lookup_and_no_store_skips_write(env: Env) -> None:
    unstored = await env.chat("Tell me a fact.", headers={"Cache-Control": "no-store"})
    assert unstored.cache == "miss"
    assert (await env.chat("Tell me a fact.")).id != unstored.id  # it was not stored
    stored = await env.chat("Tell me a fact.")
    assert stored.cache == "hit"
    fresh = await env.chat("Tell me a fact.", headers={"Cache-Control": "no-cache"})
    assert fresh.cache == "bypass" and fresh.id != stored.id
    assert (await env.chat("Tell me a fact.")).id == fresh.id  # the fresh answer replaced it


async def test_error_answers_are_not_stored(env: Env) -> None:
    env.sim.configure(error_rate=1.0, fail_status=500)
    failed = await env.chat("Will this fail?")
    assert failed.status == 500 and failed.cache == "miss"
    env.sim.configure(error_rate=0.0)
    ok = await env.chat("Will this fail?")
    assert ok.status == 200 and ok.cache == "miss"


# -- streams ------------------------------------------------------------------------------


async def test_a_streamed_miss_is_relayed_then_replayed_as_json_and_as_a_stream(env: Env) -> None:
    """A stream stored with its usage chunk answers a non-streaming client too (one stored
    without usage cannot: tests/test_cache_sse_replay.py)."""
    usage = {"include_usage": True}
    streamed = await env.chat("Stream me an answer.", stream=True, stream_options=usage)
    assert streamed.cache == "miss" and streamed.headers["Content-Type"].startswith(
        "text/event-stream"
    )
    as_json = await env.chat("Stream me an answer.")  # visible as soon as the stream ended
    assert as_json.cache == "hit" and as_json.headers["Content-Type"] == "application/json"
    assert as_json.text == streamed.text and as_json.id == streamed.id
    assert as_json.json["object"] == "chat.completion"
    assert as_json.json["choices"][0]["finish_reason"] in ("stop", "length")
    replayed = await env.chat("Stream me an answer.", stream=True, stream_options=usage)
    assert replayed.cache == "hit" and replayed.headers["Content-Type"] == "text/event-stream"
    assert parse_sse(replayed.body) == parse_sse(streamed.body)
    assert env.upstream_calls == 1


async def test_a_json_miss_is_replayed_as_openai_chunks_to_a_streaming_client(env: Env) -> None:
    whole = await env.chat("Answer once, replay as a stream.")
    replayed = await env.chat(
        "Answer once, replay as a stream.", stream=True, stream_options={"include_usage": True}
    )
    assert replayed.cache == "hit" and replayed.headers["Content-Type"] == "text/event-stream"
    events = parse_sse(replayed.body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == whole.id for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert len([c for c in chunks if c["choices"]]) > 2  # several deltas, not one lump
    assert chunks[-1]["usage"] == whole.json["usage"]
    assert replayed.text == whole.text


async def test_a_stream_cut_off_upstream_is_not_stored(env: Env) -> None:
    body = chat_body("cut me", model="odd-cut", stream=True)
    for _ in range(2):
        async with env.session.post(
            env.url + CHAT, json=body, headers={"Authorization": ALICE}
        ) as r:
            assert r.status == 200 and r.headers["X-Gateway-Cache"] == "miss"
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.read()
    assert env.odd.calls == 2


async def test_a_stream_ending_in_an_error_event_is_not_stored(env: Env) -> None:
    body = chat_body("fail me", model="odd-error", stream=True)
    first = await env.post(CHAT, body)
    assert first.status == 200 and b"model crashed" in first.body
    assert (await env.post(CHAT, body)).cache == "miss"
    assert env.odd.calls == 2


async def test_a_stream_the_client_abandons_is_not_stored(env: Env) -> None:
    env.sim.configure(token_ms=20.0)
    body = chat_body("A long story, please.", stream=True)
    async with env.session.post(env.url + CHAT, json=body, headers={"Authorization": ALICE}) as r:
        assert r.headers["X-Gateway-Cache"] == "miss"
        await r.content.readline()
        r.close()  # the client leaves mid-stream
    env.sim.configure(token_ms=0.0)
    assert (await env.chat("A long story, please.", stream=True)).cache == "miss"


async def test_the_openai_sdk_reads_a_replayed_stream_as_a_normal_stream(env: Env) -> None:
    messages = chat_body("What is an SDK?")["messages"]
    async with openai.AsyncOpenAI(
        base_url=env.url + "/v1", api_key="sk-alice", max_retries=0
    ) as client:
        whole = await client.chat.completions.create(
            model="sim-model", messages=messages, temperature=0
        )
        raw = await client.chat.completions.with_raw_response.create(
            model="sim-model", messages=messages, temperature=0, stream=True
        )
        assert raw.headers["X-Gateway-Cache"] == "hit"
        stream = raw.parse()
        chunks = [chunk async for chunk in stream]
    assert all(c.id == whole.id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert env.upstream_calls == 1


# -- embeddings, per item -------------------------------------------------------------------


async def test_embeddings_are_cached_per_item(env: Env) -> None:
    texts = [f"product description number {i}" for i in range(100)]
    cached = [t for i, t in enumerate(texts) if i % 10 != 3]  # 90 of the 100
    first = await env.post(EMBEDDINGS, {"model": "sim-model", "input": cached})
    assert first.status == 200 and first.headers["X-Gateway-Cache-Items"] == "0/90"
    calls, items = env.upstream_calls, env.upstream_items
    # Each read of 100 entries below must not meet a full collection of the suite's heap:
    # one held the loop past Redis's 0.2 s socket timeout once (a miss, as designed).
    gc.collect()
    answer = await env.post(EMBEDDINGS, {"model": "sim-model", "input": texts})
    assert answer.status == 200 and answer.headers["X-Gateway-Cache-Items"] == "90/100"
    assert env.upstream_calls == calls + 1 and env.upstream_items == items + 10
    async with env.session.post(
        env.sim.url + EMBEDDINGS, json={"model": "sim-model", "input": texts}
    ) as r:
        direct = await r.json()
    data = answer.json["data"]
    assert [d["index"] for d in data] == list(range(100))
    assert [d["embedding"] for d in data] == [d["embedding"] for d in direct["data"]]
    assert answer.json["usage"] == direct["usage"]
    calls = env.upstream_calls
    gc.collect()
    again = await env.post(EMBEDDINGS, {"model": "sim-model", "input": texts})
    assert again.cache == "hit" and again.headers["X-Gateway-Cache-Items"] == "100/100"
    assert again.json["data"] == data and env.upstream_calls == calls
    other = await env.post(EMBEDDINGS, {"model": "sim-model", "input": texts}, tenant=BOB)
    assert other.headers["X-Gateway-Cache-Items"] == "0/100"


# -- purge ---------------------------------------------------------------------------------


async def fill(env: Env) -> dict[str, Answer]:
    return {
        "alice": await env.chat("Purge test question?", tenant=ALICE),
        "bob": await env.chat("Purge test question?", tenant=BOB),
        "spare": await env.chat("Purge test question?", model="spare-model"),
    }


async def hits(env: Env) -> dict[str, bool]:
    return {
        "alice": (await env.chat("Purge test question?", tenant=ALICE)).cache == "hit",
        "bob": (await env.chat("Purge test question?", tenant=BOB)).cache == "hit",
        "spare": (await env.chat("Purge test question?", model="spare-model")).cache == "hit",
    }


async def test_purge_needs_the_admin_token(env: Env) -> None:
    await fill(env)
    status, _ = await env.purge(token=None)
    assert status == 401
    status, _ = await env.purge(token="wrong")
    assert status == 401
    assert await hits(env) == {"alice": True, "bob": True, "spare": True}


async def test_purge_everything(env: Env) -> None:
    await fill(env)
    status, body = await env.purge()
    assert status == 200 and body["purged"] >= 3 and body["store"] == env.store
    assert await hits(env) == {"alice": False, "bob": False, "spare": False}


async def test_purge_by_backend(env: Env) -> None:
    await fill(env)
    status, body = await env.purge(backend="spare")
    assert status == 200 and body["purged"] == 1
    assert await hits(env) == {"alice": True, "bob": True, "spare": False}


async def test_purge_by_model_version(env: Env) -> None:
    await fill(env)
    status, body = await env.purge(model_version="gpu@1")
    assert status == 200 and body["purged"] == 2
    assert await hits(env) == {"alice": False, "bob": False, "spare": True}


async def test_purge_by_tenant_given_raw_or_as_scope(env: Env) -> None:
    await fill(env)
    status, body = await env.purge(tenant=BOB)
    assert status == 200 and body["purged"] == 1
    assert BOB not in json.dumps(body)  # the credential is never echoed
    assert await hits(env) == {"alice": True, "bob": False, "spare": True}
    status, body = await env.purge(scope=body["filters"]["scope"])
    assert status == 200 and body["purged"] == 1  # bob's fresh entry from hits()
    status, body = await env.purge(tenant=BOB, scope="x")
    assert status == 400
    status, body = await env.purge(colour="red")
    assert status == 400 and "unknown" in body["error"]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    for broken in (b"[" * 5000, b"\xff\xfe{}", b"{not json"):  # nested, not UTF-8, not JSON
        async with env.session.post(
            env.admin_url + "/cache/purge", data=broken, headers=headers
        ) as response:
            assert response.status == 400, broken[:10]


# -- store failures ------------------------------------------------------------------------


async def test_metrics_count_lookups_entries_and_bytes(env: Env) -> None:
    await env.chat("Count me.")
    await env.chat("Count me.")
    assert await env.metric('gateway_cache_lookups_total{match="none",result="miss",route="chat"}')
    assert await env.metric('gateway_cache_lookups_total{match="exact",result="hit",route="chat"}')
    assert await env.metric('gateway_cache_lookup_seconds_count{route="chat"}') == 2
    # Redis's counts are read in the background: the first scrape starts a refresh.
    for _ in range(500):
        if await env.metric("gateway_cache_entries ") == 1:
            break
        await asyncio.sleep(0.002)
    assert await env.metric("gateway_cache_entries ") == 1
    assert await env.metric("gateway_cache_bytes ") > 0
    assert await env.metric("gateway_cache_store_errors_total") == 0


async def test_redis_killed_mid_test_answers_every_request_then_recovers(
    redis_server: RedisServer,  # noqa: F811
    start_gateway: Any,
    serve_app: Any,
    tmp_path: Path,
) -> None:
    env = await make_env("redis", Redis(url=redis_server.url), start_gateway, serve_app, tmp_path)
    try:
        stored = await env.chat("Survive a Redis outage?")
        assert (await env.chat("Survive a Redis outage?")).cache == "hit"
        await env.redis.aclose()
        redis_server.stop()
        for i in range(5):
            answer = await env.chat("Survive a Redis outage?")
            assert answer.status == 200 and answer.cache == "miss" and answer.id != stored.id
            streamed = await env.chat(f"stream during the outage {i}", stream=True)
            assert streamed.status == 200 and streamed.text
        assert await env.metric("gateway_cache_store_errors_total") >= 1
        assert await env.metric("gateway_cache_store_up ") == 0
        assert await env.metric('gateway_cache_store_transitions_total{to="down"}') == 1
        purge_status, _ = await env.purge()
        assert purge_status == 503
        redis_server.start()  # back, empty (a flush): misses until filled again
        env.redis = admin_client(Redis(url=redis_server.url))
        env.clock.advance(60)  # past the store's retry interval
        for _ in range(200):
            first = await env.chat("After the outage?")
            if (await env.chat("After the outage?")).cache == "hit":
                break
            await asyncio.sleep(0.01)  # the background probe reconnecting
        else:
            pytest.fail("the cache did not come back with Redis")
        assert first.status == 200
        assert await env.metric("gateway_cache_store_up ") == 1
        assert await env.metric('gateway_cache_store_transitions_total{to="up"}') == 1
    finally:
        await close_env(env)


async def test_a_flushed_redis_is_a_miss(
    redis_url: str,  # noqa: F811
    start_gateway: Any,
    serve_app: Any,
    tmp_path: Path,
) -> None:
    env = await make_env("redis", Redis(url=redis_url), start_gateway, serve_app, tmp_path)
    try:
        stored = await env.chat("Flush me?")
        async for name in env.redis.scan_iter(match=PREFIX + "*"):
            await env.redis.delete(name)
        again = await env.chat("Flush me?")
        assert again.status == 200 and again.cache == "miss" and again.id != stored.id
        assert (await env.chat("flush me")).cache == "hit"  # the index was rebuilt too
    finally:
        await close_env(env)
