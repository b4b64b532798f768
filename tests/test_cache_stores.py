"""The cache store contract, run against the memory store and a real Redis: one
``redis-server``, and a three-master Redis Cluster."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.crc import key_slot

from gateway.cache import CachedResponse, ResponseCache, request_key, scope_hash
from gateway.cache.entry import dumps
from gateway.cache.evaluate import read_pairs
from gateway.cache.items import CachedItem, plan_items
from gateway.cache.keys import RequestKey
from gateway.cache.simhash import fingerprint
from gateway.cache.stores import MemoryStore, RedisStore
from gateway.cache.stores.memory import ENTRY_OVERHEAD_BYTES as MEMORY_OVERHEAD
from gateway.cache.stores.redis_counts import ENTRY_OVERHEAD_BYTES as REDIS_OVERHEAD
from gateway.cache.stores.redis_counts import SWEEP_BATCH
from gateway.errors import StoreError
from gateway.policy.redis import Redis
from gateway.redis.health import DOWN_AFTER
from gateway.testing import FakeClock, FlakyStore
from tests.helpers import until
from tests.redis_cluster import admin_client, settings_for
from tests.redis_server import RedisServer, redis_server, redis_url  # noqa: F401

PAIRS = Path(__file__).parent.parent / "gateway" / "data" / "adversarial_pairs.tsv"
CHAT = "/v1/chat/completions"

CLUSTER_WARM_S = 5.0
"""The store budget of tests that are not about budgets: a Cluster's first command (its
slots read from the seeds, its nodes connected) took over 500 ms on a busy machine."""


@dataclass
class Harness:
    """A store under test and a way to move its time forward."""

    store: Any
    cache: ResponseCache
    clock: FakeClock
    redis: Any = None
    prefix: str = ""

    async def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the store: the fake clock for memory; for Redis every key
        under the prefix has its remaining TTL shortened (or is expired) to match."""
        self.clock.advance(seconds)
        if self.redis is None:
            return
        async for name in self.redis.scan_iter(match=self.prefix + "*"):
            left = await self.redis.pttl(name)
            if left < 0:
                continue
            if left <= seconds * 1000:
                await self.redis.pexpireat(name, 1)
            else:
                await self.redis.pexpire(name, int(left - seconds * 1000))

    async def counts(self) -> tuple[int | None, int | None]:
        """The store's entry and byte counts, brought up to date (expired entries dropped)."""
        if self.redis is None:
            self.store.sweep()
            stats = self.store.stats()
        else:
            stats = await self.store.refresh_counts()
        return stats.entries, stats.bytes

    def footprint(self, *entries: CachedResponse) -> int:
        """The bytes the store counts for ``entries``: serialised size plus overhead."""
        overhead = REDIS_OVERHEAD if self.redis is not None else MEMORY_OVERHEAD
        return sum(len(dumps(entry)) + overhead for entry in entries)


@pytest.fixture(params=["memory", "standalone", "cluster"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    clock = FakeClock()
    store: MemoryStore | RedisStore
    if request.param == "memory":
        store = MemoryStore(clock=clock)
        yield Harness(store, ResponseCache(store, clock=clock), clock)
        await store.close()
        return
    settings = settings_for(request, request.param)
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    store = RedisStore.connect(settings, prefix=prefix, clock=clock, budget_s=CLUSTER_WARM_S)
    admin = admin_client(settings)
    try:
        yield Harness(store, ResponseCache(store, clock=clock), clock, admin, prefix)
    finally:
        await store.close()
        await admin.aclose()


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": text}],
        **extra,
    }


def key_for(
    body: dict[str, Any],
    tenant: str = "Bearer a",
    *,
    route: str = "r",
    backend: str = "main",
    model_version: str = "v1",
    path: str = CHAT,
) -> RequestKey:
    scope = scope_hash([("Authorization", tenant)], ["authorization"])
    return request_key(
        body, scope=scope, route=route, backend=backend, model_version=model_version, path=path
    )


def answer(text: str, backend: str = "main", model_version: str = "v1") -> CachedResponse:
    body = f'{{"object":"chat.completion","choices":[{{"message":{{"content":"{text}"}}}}]}}'
    return CachedResponse(
        200,
        (("content-type", "application/json"),),
        body.encode(),
        None,
        1_700_000_000.0,
        backend,
        model_version,
        "r",
        "",
    )


async def test_exact_hit_returns_stored_answer(harness: Harness) -> None:
    key = key_for(chat("What is the capital of France?"))
    assert await harness.cache.lookup(key) is None
    assert await harness.cache.put(key, answer("Paris"), ttl_s=60)
    hit = await harness.cache.lookup(key)
    assert hit is not None and hit.match == "exact" and hit.similarity == 1.0
    assert hit.entry.body == answer("Paris").body
    assert hit.entry.headers == (("content-type", "application/json"),)


async def test_near_duplicate_hit_for_case_and_punctuation_edits(harness: Harness) -> None:
    await harness.cache.put(key_for(chat("What is the capital of France?")), answer("Paris"), 60)
    hit = await harness.cache.lookup(key_for(chat("what is the capital of france")))
    assert hit is not None and hit.match == "simhash"
    assert await harness.cache.lookup(key_for(chat("What is the capital of Spain?"))) is None


async def test_near_duplicate_with_a_typo_passes_the_full_guard(harness: Harness) -> None:
    """A query whose normalised form differs from the stored one is guarded in full."""
    stored = "Explain kubernetes deployment strategies"
    await harness.cache.put(key_for(chat(stored)), answer("x"), 60)
    hit = await harness.cache.lookup(key_for(chat("explain kubernetes deploymnet strategies")))
    assert hit is not None and hit.match == "simhash" and hit.entry.prompt == stored
    assert await harness.cache.lookup(key_for(chat("Explain kubernetes deployment"))) is None


async def test_entries_stored_without_a_prompt_form_are_guarded_on_their_prompt(
    harness: Harness,
) -> None:
    """Entries written before ``prompt_form`` existed still hit, through the full guard."""
    key = key_for(chat("What is the capital of France?"))
    assert key.prompt is not None
    legacy = replace(
        answer("Paris"),
        scope=key.scope,
        prompt=key.prompt,
        context=key.context,
        fingerprint=fingerprint(key.prompt),
    )
    await harness.store.set(key.exact, legacy, 60)
    hit = await harness.cache.lookup(key_for(chat("what is the capital of france")))
    assert hit is not None and hit.match == "simhash" and hit.entry.prompt_form is None
    assert await harness.cache.lookup(key_for(chat("What is the capital of France now?"))) is None


async def test_near_duplicate_requires_identical_context(harness: Harness) -> None:
    await harness.cache.put(key_for(chat("Who wrote Hamlet?")), answer("Shakespeare"), 60)
    other_system = chat("who wrote hamlet")
    other_system["messages"][0]["content"] = "answer in French"
    assert await harness.cache.lookup(key_for(other_system)) is None
    assert await harness.cache.lookup(key_for(chat("who wrote hamlet", max_tokens=5))) is None
    assert await harness.cache.lookup(key_for(chat("who wrote hamlet"))) is not None


async def test_no_cross_tenant_hits_exact_or_near(harness: Harness) -> None:
    body = chat("What is the capital of France?")
    await harness.cache.put(key_for(body, tenant="Bearer a"), answer("Paris"), 60)
    assert await harness.cache.lookup(key_for(body, tenant="Bearer b")) is None
    assert (
        await harness.cache.lookup(key_for(chat("what is the capital of france"), "Bearer b"))
        is None
    )
    assert await harness.cache.lookup(key_for(body, tenant="Bearer a")) is not None


async def test_no_cross_tenant_hits_over_adversarial_positives(harness: Harness) -> None:
    positives = [p for p in read_pairs(PAIRS) if p.label == 1]
    for n, pair in enumerate(positives):
        await harness.cache.put(key_for(chat(pair.first), f"Bearer a{n}"), answer("x"), 60)
    for n, pair in enumerate(positives):
        for text in (pair.first, pair.second):
            assert await harness.cache.lookup(key_for(chat(text), f"Bearer b{n}")) is None


async def test_guard_gives_zero_false_hits_on_adversarial_negatives(harness: Harness) -> None:
    pairs = read_pairs(PAIRS)
    hits = {0: 0, 1: 0}
    for n, pair in enumerate(pairs):
        tenant = f"Bearer pair-{n}"
        await harness.cache.put(key_for(chat(pair.first), tenant), answer("x"), 60)
        if await harness.cache.lookup(key_for(chat(pair.second), tenant)) is not None:
            hits[pair.label] += 1
    assert hits[0] == 0
    assert hits[1] >= 0.9 * sum(1 for p in pairs if p.label == 1)


async def test_entries_expire_after_ttl(harness: Harness) -> None:
    key = key_for(chat("Why is the sky blue?"))
    await harness.cache.put(key, answer("Rayleigh"), ttl_s=30)
    await harness.advance(29)
    assert await harness.cache.lookup(key) is not None
    await harness.advance(2)
    assert await harness.cache.lookup(key) is None
    assert await harness.cache.lookup(key_for(chat("why is the sky blue"))) is None


async def test_model_version_change_is_a_miss(harness: Harness) -> None:
    body = chat("Explain pointers in C")
    await harness.cache.put(key_for(body, model_version="v1"), answer("..."), 60)
    assert await harness.cache.lookup(key_for(body, model_version="v2")) is None
    assert (
        await harness.cache.lookup(key_for(chat("explain pointers in c"), model_version="v2"))
        is None
    )
    assert await harness.cache.lookup(key_for(body, model_version="v1")) is not None


async def test_purge_by_backend_model_version_tenant_and_all(harness: Harness) -> None:
    async def put(text: str, tenant: str, backend: str, mv: str) -> Any:
        key = key_for(chat(text), tenant, backend=backend, model_version=mv)
        await harness.cache.put(key, answer(text, backend, mv), 60)
        return key

    k1 = await put("one", "Bearer a", "main", "v1")
    k2 = await put("two", "Bearer a", "main", "v2")
    k3 = await put("three", "Bearer b", "small", "v1")
    k4 = await put("four", "Bearer b", "main", "v1")

    async def alive() -> list[bool]:
        return [await harness.cache.lookup(k) is not None for k in (k1, k2, k3, k4)]

    assert await alive() == [True, True, True, True]
    assert await harness.cache.purge(backend="small") == 1
    assert await alive() == [True, True, False, True]
    assert await harness.cache.purge(backend="main", model_version="v2") == 1
    assert await alive() == [True, False, False, True]
    assert await harness.cache.purge(scope=k4.scope) == 1
    assert await alive() == [True, False, False, False]
    assert await harness.cache.purge() == 1
    assert await alive() == [False, False, False, False]
    assert await harness.cache.lookup(key_for(chat("ONE"), "Bearer a")) is None


async def test_stream_entries_round_trip(harness: Harness) -> None:
    events = ('{"choices":[{"index":0,"delta":{"content":"hi"}}]}', '{"choices":[]}')
    entry = CachedResponse(200, (), None, events, 1.0, "main", "v1", "r", "")
    key = key_for(chat("Say hi", stream=True))
    await harness.cache.put(key, entry, 60)
    hit = await harness.cache.lookup(key_for(chat("Say hi")))
    assert hit is not None and hit.entry.events == events and hit.entry.body is None


async def test_per_item_embeddings_cached_individually(harness: Harness) -> None:
    where = {"scope": "s", "route": "r", "backend": "main", "model_version": "v1"}
    body = {"model": "e", "input": ["a", "b", "c"]}
    plan = plan_items(body, path="/v1/embeddings", **where)
    assert plan is not None
    assert await harness.cache.get_items(plan) == [None, None, None]
    fresh = {0: CachedItem([0.1], 1, "e"), 2: CachedItem([0.3], 2, "e")}
    assert await harness.cache.put_items(plan, fresh, 60, **where)
    assert await harness.cache.get_items(plan) == [fresh[0], None, fresh[2]]


async def test_deleted_entry_is_a_miss(harness: Harness) -> None:
    key = key_for(chat("Delete me"))
    await harness.cache.put(key, answer("x"), 60)
    await harness.store.delete(key.exact)
    assert await harness.store.get(key.exact) is None
    assert await harness.cache.lookup(key_for(chat("delete me"))) is None


async def test_counts_follow_writes_and_a_rewrite_is_counted_once(harness: Harness) -> None:
    assert await harness.counts() == (0, 0)
    small, large = answer("x"), answer("x" * 500)
    await harness.store.set_many([("a", small), ("b", small), ("c", small)], 60)
    assert await harness.counts() == (3, harness.footprint(small, small, small))
    await harness.store.set("a", small, 60)
    await harness.store.set_many([("b", large), ("b", large)], 60)
    assert await harness.counts() == (3, harness.footprint(small, large, small))
    await harness.store.delete("c")
    await harness.store.delete("c")
    assert await harness.counts() == (2, harness.footprint(small, large))


async def test_counts_drop_entries_as_they_expire(harness: Harness) -> None:
    entry = answer("x")
    await harness.store.set("short", entry, 30)
    await harness.store.set("long", entry, 100)
    await harness.advance(29)
    assert await harness.counts() == (2, harness.footprint(entry, entry))
    await harness.advance(2)
    assert await harness.counts() == (1, harness.footprint(entry))
    await harness.store.set("short", entry, 30)  # stored again after its expiry
    assert await harness.counts() == (2, harness.footprint(entry, entry))
    await harness.advance(100)
    assert await harness.counts() == (0, 0)


async def test_counts_follow_filtered_purges_and_purge_all(harness: Harness) -> None:
    main, small = answer("m", "main"), answer("s" * 50, "small")
    await harness.store.set_many([("m1", main), ("m2", main), ("s1", small)], 60)
    assert await harness.counts() == (3, harness.footprint(main, main, small))
    assert await harness.store.purge(backend="small") == 1
    assert await harness.counts() == (2, harness.footprint(main, main))
    assert await harness.store.purge(backend="main", model_version="v1") == 2
    assert await harness.counts() == (0, 0)
    await harness.store.set_many([("m1", main), ("s1", small)], 60)
    assert await harness.store.purge() == 2
    assert await harness.counts() == (0, 0)
    await harness.store.set("m1", main, 60)
    assert await harness.counts() == (1, harness.footprint(main))


# Memory store only


async def test_memory_store_evicts_least_recently_used_within_byte_bound() -> None:
    clock = FakeClock()
    probe = MemoryStore(clock=clock)
    await probe.set("k", answer("x"), 60)
    size = probe.stats().bytes
    assert size is not None
    store = MemoryStore(max_bytes=3 * size, clock=clock)
    for name in ("a", "b", "c"):
        await store.set(name, answer("x"), 60)
    await store.get("a")
    await store.set("d", answer("x"), 60)
    assert [await store.get(n) is not None for n in "abcd"] == [True, False, True, True]
    stats = store.stats()
    assert stats.entries == 3 and stats.bytes is not None and stats.bytes <= 3 * size
    assert stats.evictions == 1
    assert repr(store).startswith("<MemoryStore entries=3 ")


async def test_memory_store_skips_entries_larger_than_the_bound() -> None:
    store = MemoryStore(max_bytes=100)
    await store.set("big", answer("x" * 1000), 60)
    assert await store.get("big") is None and store.stats().entries == 0


async def test_memory_store_sweep_drops_expired_entries() -> None:
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    await store.set("a", answer("x"), 10)
    await store.set("b", answer("x"), 100)
    clock.advance(50)
    assert store.sweep() == 1 and store.stats().entries == 1


async def test_store_errors_are_misses_and_counted() -> None:
    flaky = FlakyStore(MemoryStore())
    seen: list[StoreError] = []
    cache = ResponseCache(flaky, on_store_error=seen.append)
    key = key_for(chat("Hello there, what is new?"))
    assert await cache.put(key, answer("x"), 60)
    flaky.failing = True
    assert await cache.lookup(key) is None
    assert not await cache.put(key, answer("y"), 60)
    assert cache.store_errors == 2 and len(seen) == 2
    flaky.failing = False
    assert await cache.lookup(key) is not None
    assert "store_errors=2" in repr(cache)


# Redis store only


async def test_redis_killed_mid_test_fails_fast_then_recovers(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    clock = FakeClock()
    store = RedisStore.from_url(redis_server.url, clock=clock, retry_s=2.0, budget_s=0.5)
    cache = ResponseCache(store, clock=clock)
    key = key_for(chat("What is the capital of France?"))
    try:
        await cache.put(key, answer("Paris"), 60)
        assert await cache.lookup(key) is not None

        redis_server.stop()
        started = time.monotonic()
        assert await cache.lookup(key) is None  # a miss, and the first evidence
        for _ in range(DOWN_AFTER - 1):  # failures in a row: the evidence of an outage
            with pytest.raises(StoreError):
                await store.get(key.exact)
        assert time.monotonic() - started < 0.5
        assert not store.available and "down" in repr(store)
        assert cache.store_errors == 1
        assert store.health.transitions == 1

        redis_server.start()
        with pytest.raises(StoreError):  # still inside retry_s: fails fast, no probe yet
            await store.get(key.exact)
        clock.advance(2.0)
        with pytest.raises(StoreError):  # due: this call starts the background probe
            await store.get(key.exact)
        for _ in range(100):
            if store.available:
                break
            await asyncio.sleep(0.01)
        assert store.available and "up" in repr(store)
        await cache.put(key, answer("Paris"), 60)  # the restarted server is empty
        assert await cache.lookup(key) is not None
    finally:
        await store.close()


async def test_a_redis_restart_between_requests_costs_no_miss(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """Every pooled connection dies with the server; the next commands, single and
    pipelined, reconnect at once instead of failing and marking Redis down."""
    store = RedisStore.from_url(redis_server.url, budget_s=0.5)
    cache = ResponseCache(store)
    keys = [key_for(chat(f"Question {i}?")) for i in range(4)]
    try:
        await asyncio.gather(*(cache.put(k, answer(f"A{i}"), 60) for i, k in enumerate(keys)))
        redis_server.stop()
        redis_server.start()  # empty: a restart keeps nothing here
        assert await cache.lookup(keys[0]) is None  # a plain miss, not a store error
        assert await store.get_many([k.exact for k in keys]) == [None] * 4
        assert await cache.put(keys[1], answer("again"), 60)
        assert await cache.lookup(keys[1]) is not None
        assert store.available and store.errors == 0 and cache.store_errors == 0
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def silent_redis() -> AsyncIterator[tuple[str, list[int]]]:
    """A server that accepts connections and never answers: its URL, and a list holding how
    many connections it accepted."""
    connections = [0]

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections[0] += 1
        await reader.read(-1)
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0", connections
    finally:
        server.close()
        await server.wait_closed()


async def test_a_redis_command_that_timed_out_is_not_sent_again() -> None:
    """It may have run: a second run of the counts' ZREM or DECRBY would skew them.  Only a
    failed connection is retried (a purge runs without the budget, so it meets the socket
    timeout first)."""
    async with silent_redis() as (url, connections):
        store = RedisStore.from_url(url, budget_s=0.05)
        try:
            with pytest.raises(StoreError, match="Timeout"):
                await store.purge(scope="tenant")
            assert connections == [1]
        finally:
            await store.close()


async def test_redis_slow_beyond_budget_is_a_fast_store_error() -> None:
    """A server that accepts connections but never answers: each call costs no more than
    its budget (a miss), the commands' own timeouts are the evidence, and once they are in
    Redis is down and calls fail at once.

    On a loaded machine the event loop can stall past the socket timeout (0.2 s), and then
    the command's own timeout lands in the same turn as the budget: either is the fast error
    this is about, and the bound on the wait is kept loose for the same reason."""
    async with silent_redis() as (url, _):
        store = RedisStore.from_url(url, budget_s=0.05)
        try:
            for _ in range(DOWN_AFTER):
                started = time.monotonic()
                with pytest.raises(StoreError, match=r"budget|Timeout"):
                    await store.get("k")
                assert time.monotonic() - started < 1.0
            for _ in range(200):  # the commands time out on their own (socket timeout)
                if not store.available:
                    break
                await asyncio.sleep(0.01)
            refused = store.link.failures["down"]
            with pytest.raises(StoreError, match="unavailable"):
                await store.get("k")
            assert store.link.failures["down"] == refused + 1  # refused unsent, not timed out
        finally:
            await store.close()


@contextlib.asynccontextmanager
async def late_redis(url: str, delay_s: float) -> AsyncIterator[str]:
    """A proxy in front of a real Redis that holds each reply back ``delay_s``: every
    answer comes, late (as when the event loop is late on a busy machine)."""
    host, port = url.removeprefix("redis://").split("/")[0].split(":")

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(host, int(port))

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, delay: float):
            while data := await src.read(65536):
                await asyncio.sleep(delay)
                dst.write(data)
            dst.close()

        await asyncio.gather(
            pump(reader, up_writer, 0.0), pump(up_reader, writer, delay_s), return_exceptions=True
        )

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    finally:
        server.close()


async def test_late_replies_never_mark_redis_down(redis_url: str) -> None:  # noqa: F811
    """Every reply past the budget: each call is a miss, but Redis answered every command,
    so Redis stays up.  The replies come 100 ms late: well past the 10 ms budget and well
    short of the 200 ms socket timeout, so a stalled event loop on a loaded machine does not
    turn a late reply into an early one or into a timeout.  Connecting is not what this is
    about: a loop stalled past the 0.2 s connect timeout (CI once saw it) fails the connect
    before the budget is judged, so the connects get seconds; the replies' timeout stays."""
    async with late_redis(redis_url, 0.1) as url:
        store = RedisStore.from_url(url, budget_s=0.01)
        store.link.client.connection_pool.connection_kwargs["socket_connect_timeout"] = 2.0
        try:
            for _ in range(10):
                with pytest.raises(StoreError, match="budget"):
                    await store.get("k")
            await until(lambda: store.health.reached == 10)  # the commands' own answers came
            assert store.available and store.health.transitions == 0
        finally:
            await store.close()


def _reading(pool: Any) -> int:
    """redis-py's connections waiting for a reply now: each sent its command and armed its
    read timeout (its stream reader has a waiter)."""
    return sum(
        1
        for conn in list(pool._in_use_connections)
        if conn._reader is not None and conn._reader._waiter is not None
    )


async def test_an_event_loop_stall_past_the_socket_timeout_does_not_take_redis_down(
    redis_url: str,  # noqa: F811
) -> None:
    """The loop stalls 0.35 s (a long callback, a CPU-throttled container) while twenty
    commands wait for their replies: every one of them times out in the same turn (the
    socket timeout is 0.2 s), though Redis answered them all.  That is evidence enough to
    condemn Redis, so a PING is sent first, after the stall; it is answered, and Redis stays
    up, with the forgiveness counted."""
    store = RedisStore.from_url(redis_url, budget_s=0.05)
    admin = aioredis.Redis.from_url(redis_url)
    try:
        # Opening twenty sockets at once may outlast 50 ms, and on a busy machine the 0.2 s
        # connect timeout too: the warm-up gets seconds (redis-py's pool makes each new
        # connection from its ``connection_kwargs``); the replies' timeout stays 0.2 s.
        store.budget_s = CLUSTER_WARM_S
        store.link.client.connection_pool.connection_kwargs["socket_connect_timeout"] = 2.0
        await asyncio.gather(*(store.get(f"stall-{i}") for i in range(20)))  # twenty sockets
        store.budget_s = 0.05
        await admin.client_pause(150, all=True)  # the replies wait a little, as under load
        reads = [asyncio.ensure_future(store.get(f"stall-{i}")) for i in range(20)]
        await until(lambda: _reading(store.link.client.connection_pool) == 20)
        asyncio.get_running_loop().call_soon(time.sleep, 0.35)  # a callback holds the loop
        outcomes = await asyncio.gather(*reads, return_exceptions=True)
        assert all(isinstance(outcome, StoreError) for outcome in outcomes)
        # the commands timed out: each judged when its own outcome came, which may be a turn
        # after its caller's budget had already answered it
        await until(lambda: store.link.failures["unreached"] >= DOWN_AFTER)
        await until(lambda: store.link.forgiven == 1)
        assert store.available and store.health.transitions == 0
        assert await store.get("stall-0") is None  # and it is asked at once
    finally:
        await admin.aclose()
        await store.close()


async def test_redis_ttl_and_index_keys_use_plain_commands(redis_target: Redis) -> None:
    """The layout of ``stores/redis.py``, the same in every mode; a context's band buckets
    share one hash tag, so a near-duplicate lookup reads one Cluster master."""
    store = RedisStore.connect(redis_target, prefix="plain:", budget_s=CLUSTER_WARM_S)
    admin = admin_client(redis_target)
    cache = ResponseCache(store)
    try:
        key = key_for(chat("Why is the sky blue?"))
        await cache.put(key, answer("x"), 30)
        names = sorted([n.decode() async for n in admin.scan_iter(match="plain:*")])
        kinds = sorted({n.split(":")[1] for n in names})
        assert kinds == ["b", "bytes", "e", "i", "n", "sz"] and len(names) == 1 + 4 + 3 + 3
        buckets = [n for n in names if n.startswith("plain:b:")]
        assert all(n.startswith(f"plain:b:{{{key.context}}}:") for n in buckets)
        assert len({key_slot(n.encode()) for n in buckets}) == 1
        for name in names:
            if name in ("plain:n", "plain:sz", "plain:bytes"):
                assert await admin.pttl(name) == -1  # counts: never a volatile-* eviction
            else:
                assert 0 < await admin.pttl(name) <= 30_000
    finally:
        await cache.purge()
        await store.close()
        await admin.aclose()


async def test_redis_purge_of_everything_keeps_to_its_own_prefix_even_with_glob_characters(
    redis_target: Redis,
) -> None:
    tag = uuid.uuid4().hex[:8]
    globbed = RedisStore.connect(redis_target, prefix=f"g*{tag}:", budget_s=CLUSTER_WARM_S)
    neighbour = RedisStore.connect(redis_target, prefix=f"gX{tag}:", budget_s=CLUSTER_WARM_S)
    key = key_for(chat("Why is the sky blue?"))
    try:
        await ResponseCache(globbed).put(key, answer("x"), 30)
        await ResponseCache(neighbour).put(key, answer("y"), 30)
        assert await globbed.purge() >= 1
        assert await globbed.get(key.exact) is None
        assert await neighbour.get(key.exact) is not None
    finally:
        await neighbour.purge()
        await globbed.close()
        await neighbour.close()


async def test_redis_purge_of_everything_leaves_the_rate_limits_and_history_under_the_prefix(
    redis_target: Redis,
) -> None:
    """The shared rate limits (``rl:``) and the rate history (``rate:``) live under the
    same prefix as the cache: a purge of the cache must not reset them."""
    prefix = f"p{uuid.uuid4().hex[:8]}:"
    store = RedisStore.connect(redis_target, prefix=prefix, budget_s=0.5)
    admin = admin_client(redis_target)
    others = [f"{prefix}rl:{{chat:tenant}}:rq", f"{prefix}rate:chat"]
    try:
        await ResponseCache(store).put(key_for(chat("Why is the sky blue?")), answer("x"), 30)
        for name in others:
            await admin.set(name, "kept")
        assert await store.purge() == 1
        assert [await admin.get(name) for name in others] == [b"kept", b"kept"]
        assert not [n async for n in admin.scan_iter(match=f"{prefix}e:*")]
    finally:
        for name in others:
            await admin.delete(name)
        await store.close()
        await admin.aclose()


@pytest.fixture
async def replicas(
    redis_target: Redis,
) -> AsyncIterator[tuple[RedisStore, RedisStore, FakeClock]]:
    """Two gateways' stores on one Redis prefix, sharing a clock."""
    clock = FakeClock()
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    first = RedisStore.connect(redis_target, prefix=prefix, clock=clock, budget_s=0.5)
    second = RedisStore.connect(redis_target, prefix=prefix, clock=clock, budget_s=0.5)
    try:
        yield first, second, clock
    finally:
        await first.purge()
        await first.close()
        await second.close()


async def test_redis_counts_are_shared_by_replicas(
    replicas: tuple[RedisStore, RedisStore, FakeClock],
) -> None:
    first, second, _ = replicas
    entry = answer("x")
    await first.set_many([(f"a{i}", entry) for i in range(20)], 60)
    await second.set_many([(f"b{i}", entry) for i in range(10)], 60)
    await second.set_many([(f"a{i}", entry) for i in range(5)], 60)  # rewrites of first's
    size = len(dumps(entry)) + REDIS_OVERHEAD
    assert (await first.refresh_counts()).entries == 30
    assert (await second.refresh_counts()).bytes == 30 * size
    assert (await first.refresh_counts()).bytes == 30 * size
    assert "entries=30" in repr(first)


async def test_redis_replicas_sweeping_at_once_subtract_each_expiry_once(
    replicas: tuple[RedisStore, RedisStore, FakeClock],
) -> None:
    first, second, clock = replicas
    entry = answer("x")
    expiring = [(f"a{i}", entry) for i in range(SWEEP_BATCH + 20)]  # two sweep batches
    await first.set_many(expiring, 10)
    await second.set_many([(f"b{i}", entry) for i in range(10)], 100)
    clock.advance(20)
    # Each read may still include what the other has swept but not yet subtracted; what
    # they subtracted between them is exact once both have settled.
    await asyncio.gather(first.refresh_counts(), second.refresh_counts())
    size = len(dumps(entry)) + REDIS_OVERHEAD
    for store in (first, second):
        stats = await store.refresh_counts()
        assert (stats.entries, stats.bytes) == (10, 10 * size)
    assert first.errors == second.errors == 0


async def test_redis_a_purge_racing_a_sweep_subtracts_each_entry_once(
    replicas: tuple[RedisStore, RedisStore, FakeClock],
) -> None:
    """Whoever takes a key out of the expiry set (the sweep's ``ZPOPMIN``, the purge's
    ``ZREM``) subtracts its size; the other leaves it alone."""
    first, second, clock = replicas
    small, large = answer("s", "small"), answer("m" * 100, "main")
    await first.set_many([(f"s{i}", small) for i in range(300)], 10)
    await first.set_many([(f"m{i}", large) for i in range(5)], 100)
    clock.advance(20)  # the small ones are due for the sweep, still in Redis for the purge
    purged, _ = await asyncio.gather(second.purge(backend="small"), first.refresh_counts())
    assert purged == 300
    for store in (first, second):
        stats = await store.refresh_counts()
        assert (stats.entries, stats.bytes) == (5, 5 * (len(dumps(large)) + REDIS_OVERHEAD))


async def test_redis_a_purge_leaves_a_key_another_sweep_has_taken_to_that_sweep(
    redis_target: Redis,
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    store = RedisStore.connect(redis_target, prefix=prefix, clock=FakeClock(), budget_s=0.5)
    other = admin_client(redis_target)  # another replica, halfway through a sweep
    try:
        await store.set_many([("a", answer("x")), ("b", answer("x" * 50))], 60)
        assert [key for key, _ in await other.zpopmin(prefix + "n", 1)] == [b"a"]
        assert await store.purge(backend="main") == 2
        size = await other.hget(prefix + "sz", "a")  # the sweep settles what it took
        assert size is not None
        await other.hdel(prefix + "sz", "a")
        await other.decrby(prefix + "bytes", int(size))
        assert (await store.refresh_counts()).entries == 0
        assert await other.get(prefix + "bytes") == b"0"
    finally:
        await store.purge()
        await store.close()
        await other.aclose()


async def test_redis_stats_answer_at_once_and_refresh_in_the_background(
    redis_target: Redis,
) -> None:
    """``stats()`` never waits on Redis: it starts a refresh when the counts are stale."""
    clock = FakeClock()
    store = RedisStore.connect(
        redis_target,
        prefix=f"t{uuid.uuid4().hex[:8]}:",
        clock=clock,
        count_refresh_s=10,
        budget_s=CLUSTER_WARM_S,  # not the request path's 50 ms
    )
    try:
        await store.set_many([("a", answer("x")), ("b", answer("x"))], 60)
        assert store.stats().entries is None  # nothing read yet; a refresh is started
        await until(lambda: store.stats().entries == 2)
        await store.set("c", answer("x"), 60)
        clock.advance(9)
        await asyncio.sleep(0.01)
        assert store.stats().entries == 2  # fresh enough: no refresh
        clock.advance(1)
        await until(lambda: store.stats().entries == 3)
        clock.advance(10)
        assert (await asyncio.to_thread(store.stats)).entries == 3  # no loop there: no refresh
    finally:
        await store.purge()
        await store.close()


async def test_redis_counts_survive_an_outage_and_read_zero_after_a_flush(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    clock = FakeClock()
    store = RedisStore.from_url(redis_server.url, clock=clock, budget_s=0.5)
    admin = admin_client(Redis(url=redis_server.url))
    try:
        await store.set_many([("a", answer("x")), ("b", answer("x"))], 60)
        assert (await store.refresh_counts()).entries == 2
        redis_server.stop()
        for _ in range(DOWN_AFTER):
            with pytest.raises(StoreError):
                await store.refresh_counts()
        clock.advance(10)
        store.stats()  # a background refresh, failing quietly
        await asyncio.sleep(0.01)
        stats = store.stats()
        assert stats.entries == 2 and not stats.available and store.errors >= 1
        redis_server.start()
        assert await store.ping()
        await store.set("c", answer("x"), 60)  # the restarted server is empty
        # the refresh that failed is tried again at the next look, not count_refresh_s later
        await until(lambda: store.stats().entries == 1)
        assert (await store.refresh_counts()).entries == 1
        await admin.flushall()
        assert (await store.refresh_counts()).entries == 0 and store.stats().bytes == 0
    finally:
        await store.close()
        await admin.aclose()


async def test_the_memory_stores_entries_add_nothing_to_pythons_cyclic_gc() -> None:
    """Every full collection scans each object the GC tracks and pauses the event loop
    meanwhile: 100k entries kept as tracked objects (as a ``NamedTuple`` of metadata was)
    put 100k objects, 46 ms of pause here, into each one.  An entry is bytes, and an exact
    tuple of atomic metadata that the GC stops tracking; its SimHash buckets are strings
    and ints.  So storing thousands of entries, near-tier ones too, tracks nothing new."""
    import gc

    store = MemoryStore(max_bytes=1 << 40)
    entry = CachedResponse(200, (), b'{"ok":1}', None, 0.0, "main", "v1", "r", "s")
    await store.set("first", entry, 3600)  # the store's own first-use objects
    prints = [fingerprint(f"question {i}") for i in range(5_000)]  # (and the memo's)
    gc.collect()
    before = len(gc.get_objects())
    for i, print_ in enumerate(prints):
        near = replace(entry, context=f"c{i % 7}", fingerprint=print_) if i % 2 else entry
        await store.set(f"k{i}", near, 3600)
    del near
    gc.collect()
    assert len(gc.get_objects()) - before < 50  # a few per context, none per entry
