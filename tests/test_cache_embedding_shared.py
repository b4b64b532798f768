"""The embedding index shared through Redis: what one replica's tier indexes, another's finds
on its next lookup (still verified, never across tenants); a replica skips its own entries
and other embedders' vectors; the stream is bounded; a purge that deletes it, Redis's clock
going back, or Redis going down and coming back (empty) do not stop the sharing, and never
raise.  Two "replicas" are two tiers over two ``RedisStore`` clients of one real Redis (a
``redis-server``, and a three-master Redis Cluster); the embedder is the deterministic
stand-in of ``test_cache_embedding``."""

from __future__ import annotations

import asyncio
import re
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from gateway.cache import CachedResponse, ResponseCache, vector_stream
from gateway.cache.embedding import EMBEDDING, EmbeddingTier, SharedIndex
from gateway.cache.embedding.shared import READ_COUNT, RECHECK_S
from gateway.cache.keys import RequestKey
from gateway.cache.stores import RedisStore
from gateway.errors import StoreError
from gateway.policy.model import Redis
from gateway.sim import SimConfig, start_sim
from gateway.testing import FakeClock
from tests.redis_server import RedisServer, redis_server, redis_url  # noqa: F401

from .test_cache_embedding import THRESHOLD, WordsEmbedder, key_for
from .test_cache_embedding_backend import EmbeddingsServer

ROUTE = "chat"


class Replica:
    """One gateway replica's cache for a route: its own Redis client, store, tiers."""

    def __init__(
        self, redis: Redis, prefix: str, *, embedder: str = "words", dims: int = 256, **kw: Any
    ) -> None:
        self.clock = FakeClock()
        self.prefix = prefix
        # A generous budget, as in the store's own tests: a full GC of this test process,
        # or a Cluster's first command on a busy machine (over 500 ms, beside the model
        # tests' threads), must not time a command out, nor cut a sync short, mid-test.
        self.store = RedisStore.connect(redis, prefix=prefix, clock=self.clock, budget_s=5.0)
        self.cache = ResponseCache(self.store, clock=self.clock)
        self.embed = WordsEmbedder(dims)
        kw.setdefault("threshold", THRESHOLD)
        self.tier = EmbeddingTier(self.store, self.embed, **kw)
        self.shared = self.tier.share(self.store, ROUTE, embedder, self.clock)

    async def cached(self, text: str, **where: str) -> RequestKey:
        key, stored = await self.put(text, **where)
        assert stored
        return key

    async def put(self, text: str, **where: str) -> tuple[RequestKey, bool]:
        """Store an answer for ``text`` and index it, as the cache stage does."""
        key = key_for(text, **where)
        entry = CachedResponse(
            200, (), b'{"answer": 1}', None, 0.0, "main", "v1", "chat", key.scope
        )
        if not await self.cache.put(key, entry, 60):
            return key, False
        assert key.prompt is not None
        await self.tier.add(key, key.prompt, key.exact)
        return key, True

    async def ask(self, text: str, **where: str) -> Any:
        key = key_for(text, **where)
        assert key.prompt is not None
        return await self.tier.lookup(key, key.prompt)

    async def close(self) -> None:
        await self.tier.aclose()
        await self.store.close()


@pytest.fixture
async def replicas(redis_target: Redis, redis_admin: Any) -> AsyncIterator[Any]:
    """``await replicas(**options)`` makes a replica; all share one fresh key prefix."""
    prefix = f"gwt-{secrets.token_hex(4)}:"
    made: list[Replica] = []

    async def make(**options: Any) -> Replica:
        made.append(Replica(redis_target, prefix, **options))
        return made[-1]

    yield make
    for replica in made:
        await replica.close()
    async for name in redis_admin.scan_iter(match=prefix + "*"):
        await redis_admin.delete(name)


async def test_an_entry_one_replica_indexed_is_found_by_anothers_next_lookup(
    replicas: Any,
) -> None:
    a, b = await replicas(), await replicas()
    stored = await a.cached("How do I learn Python?")
    hit = await b.ask("How can I learn Python?")  # B never saw this context before
    assert hit is not None and hit.match == EMBEDDING and hit.key == stored.exact
    assert hit.entry.prompt == "How do I learn Python?" and hit.similarity >= THRESHOLD
    assert b.shared.counts["indexed"] == 1 and len(b.tier) == 1
    assert a.shared.counts["published"] == 1


async def test_a_shared_entry_never_answers_another_tenant_or_an_unverified_question(
    replicas: Any,
) -> None:
    a, b = await replicas(threshold=0.3), await replicas(threshold=0.3)
    await a.cached("How do I learn Python?", scope="tenant-a")
    assert await b.ask("How can I learn Python?", scope="tenant-b") is None
    assert await b.ask("How do I learn Python?", scope="tenant-b") is None
    assert await b.ask("How do I learn Java?", scope="tenant-a") is None
    assert b.tier.rejections["content"] == 1
    assert b.tier.results[EMBEDDING] == 0
    forged = RequestKey("tenant-b", "other", key_for("How do I learn Python?").context, "x")
    assert await b.tier.lookup(forged, "How can I learn Python?") is None
    assert b.tier.rejections["scope"] == 1


async def test_a_replica_skips_its_own_entries(replicas: Any) -> None:
    a = await replicas()
    await a.cached("How do I learn Python?")
    await a.cached("How do I bake bread?")
    assert await a.ask("How can I learn Python?") is not None
    assert a.shared.counts["own"] == 2 and "indexed" not in a.shared.counts
    assert len(a.tier) == 2


async def test_a_restarted_replica_starts_warm_from_the_stream(replicas: Any) -> None:
    a = await replicas()
    for i in range(5):
        await a.cached(f"How do I bake bread number {i}?")
    stored = await a.cached("How do I learn Python?")
    restarted = await replicas()  # a new origin: its predecessor's entries are news
    hit = await restarted.ask("How can I learn Python?")
    assert hit is not None and hit.key == stored.exact and len(restarted.tier) == 6


async def test_vectors_of_another_embedder_or_other_dimensions_are_ignored(
    replicas: Any,
) -> None:
    b = await replicas()
    other_model = await replicas(embedder="other-model")
    await other_model.cached("How do I learn Python?")
    assert await b.ask("How can I learn Python?") is None
    assert b.shared.counts["other_embedder"] == 1 and len(b.tier) == 0
    a = await replicas()
    await a.cached("How do I bake bread?")
    assert await b.ask("How can I bake bread?") is not None  # B now knows its dimensions
    narrow = await replicas(dims=128)  # same identity, other dimensions: misconfigured
    await narrow.cached("How do I bake bread?")
    await narrow.cached("How do I learn Python?")
    assert await b.ask("How can I learn Python?") is None
    assert b.shared.counts["refused"] == 2 and len(b.tier) == 1
    assert b.tier.add_vector("ctx", "k", np.ones(128, dtype=np.float32)) is False


async def test_malformed_stream_entries_are_skipped(replicas: Any, redis_admin: Any) -> None:
    b = await replicas()
    client = redis_admin
    name = b.prefix + b.shared.stream
    head = b"elsewhere\x1fwords\x1fctx\x1fk\x00"
    for data in (
        head + b"\x00",  # odd length
        head + np.zeros(4, dtype="<f2").tobytes(),
        head + np.full(4, np.inf, dtype="<f2").tobytes(),
        head,  # no vector
        b"elsewhere\x1fwords\x1fctx\x00" + np.ones(4, dtype="<f2").tobytes(),  # no key
        b"elsewhere\x1fwords\x1f\xff\x1fk\x00" + np.ones(4, dtype="<f2").tobytes(),
    ):
        await client.xadd(name, {"i": data})
    await client.xadd(name, {"other": b"field"})
    await b.shared.sync()
    assert b.shared.counts["malformed"] == 7 and len(b.tier) == 0


async def test_the_stream_is_trimmed_to_about_max_entries(replicas: Any, redis_admin: Any) -> None:
    a = await replicas(max_entries=50)
    for i in range(400):
        await a.tier.add(key_for(f"question {i}"), f"question {i}", f"k{i}")
    client = redis_admin
    length = await client.xlen(a.prefix + a.shared.stream)
    assert 50 <= length <= 150  # MAXLEN ~ trims whole nodes (100 entries by default)
    b = await replicas(max_entries=50)
    await b.shared.sync()
    assert len(b.tier) == 50  # its index is bounded too, the newest kept
    assert b.tier.forget("k399") and not b.tier.forget("k0")


async def test_a_cold_replica_reads_a_backlog_in_rounds_and_lookups_do_not_wait_for_it(
    replicas: Any,
) -> None:
    a = await replicas()
    vector = a.embed.vector("How do I bake bread?")
    total = 2 * READ_COUNT + 10
    for i in range(total):
        await a.shared.publish(f"ctx{i % 7}", f"k{i}", vector)
    b = await replicas()
    b.shared.max_rounds = 1  # so that one pass leaves a backlog
    await b.shared.sync()  # waits for the first pass: one full read
    assert b.shared.counts["indexed"] == READ_COUNT and "backlog" in repr(b.shared)
    await b.shared.sync()  # a backlog: starts the next pass, does not wait for it
    assert b.shared.counts["indexed"] == READ_COUNT
    while b.shared.counts["indexed"] < total:
        await asyncio.sleep(0)  # the reader task, not time, is what this waits for
        await b.shared.sync()
    assert len(b.tier) == total and "backlog" not in repr(b.shared)


async def test_after_a_purge_of_everything_new_entries_are_still_shared(
    replicas: Any,
) -> None:
    a, b = await replicas(), await replicas()
    await a.cached("How do I learn Python?")
    assert await b.ask("How can I learn Python?") is not None
    assert await a.store.purge() >= 1  # deletes the entries and the stream
    assert await b.ask("How can I learn Python?") is None  # a stale pointer, dropped
    assert b.tier.results["stale"] == 1
    stored = await a.cached("How do I bake bread?")
    hit = await b.ask("How can I bake bread?")
    assert hit is not None and hit.key == stored.exact


async def test_a_tenant_purge_deletes_that_tenants_vectors_from_the_stream(
    replicas: Any, redis_admin: Any
) -> None:
    """A filtered purge leaves no record of a purged entry in Redis: a cold replica indexes
    only the other tenant's, and a warm one reads on without taking it for a restart."""
    a, b = await replicas(), await replicas()
    await a.cached("How do I learn Python?", scope="tenant-b")
    await b.shared.sync()
    await a.cached("How do I learn Python?", scope="tenant-a")
    await a.cached("How do I bake bread?", scope="tenant-a")  # the stream's newest record
    await b.shared.sync()
    client = redis_admin
    name = a.prefix + a.shared.stream
    assert await client.xlen(name) == 3
    assert await a.store.purge(scope="tenant-a") == 2
    records = await client.xrange(name)
    assert [vector_stream.entry_key(f) for _, f in records] == [
        key_for("How do I learn Python?", scope="tenant-b").exact.encode()
    ]
    cold = await replicas()
    await cold.shared.sync()  # waits at most the store's budget: on a busy machine a cold
    async with asyncio.timeout(10):  # replica's first pass (its cluster's slots) takes longer
        while cold.shared.reading:
            await asyncio.sleep(0.01)
    assert len(cold.tier) == 1 and cold.shared.counts["indexed"] == 1
    b.clock.advance(RECHECK_S)
    await b.shared.sync()
    while b.shared.reading:  # let its recheck of the stream's last id run
        await asyncio.sleep(0)
    assert "restarts" not in b.shared.counts
    assert await b.ask("How can I bake bread?", scope="tenant-a") is None  # gone: stale
    assert await b.ask("How can I learn Python?", scope="tenant-b") is not None


async def test_a_purge_that_failed_pruning_vectors_is_finished_by_its_retry(
    replicas: Any, redis_admin: Any
) -> None:
    """The vectors go first and the purge-index members last, so the sets still name what
    a failed purge left to do."""
    a = await replicas()
    await a.cached("How do I learn Python?", scope="tenant-a")
    await a.cached("How do I bake bread?", scope="tenant-a")
    client = redis_admin
    broken = a.prefix + "v:broken"
    await client.set(broken, b"not a stream")  # XRANGE on it fails: WRONGTYPE
    await client.sadd(a.prefix + vector_stream.STREAMS, broken)
    with pytest.raises(StoreError):
        await a.store.purge(scope="tenant-a")
    await client.delete(broken)
    assert await a.store.purge(scope="tenant-a") >= 1
    assert await client.xlen(a.prefix + a.shared.stream) == 0
    for text in ("How do I learn Python?", "How do I bake bread?"):
        assert await a.store.get(key_for(text, scope="tenant-a").exact) is None


async def test_a_stream_restarted_below_the_last_id_read_is_read_from_the_start(
    replicas: Any, redis_admin: Any
) -> None:
    """Redis's clock behind (a failover, a restored server): the new stream's ids are below
    the last one read.  A reader finds out within ``RECHECK_S``; a publisher at once."""
    a, b = await replicas(), await replicas()
    await a.cached("How do I learn Python?")
    await b.shared.sync()
    await a.store.purge()
    stored = await a.cached("How do I bake bread?")  # indexed by A, published, then moved
    client = redis_admin
    name = a.prefix + a.shared.stream
    ((_, fields),) = await client.xrange(name)
    await client.delete(name)
    await client.xadd(name, fields, id="1-1")
    assert await b.ask("How can I bake bread?") is None  # not yet seen
    b.clock.advance(RECHECK_S)
    for _ in range(100):
        await b.shared.sync()
        if b.shared.counts["restarts"]:
            break
        await asyncio.sleep(0)  # the recheck runs after the read the lookup waited for
    hit = await b.ask("How can I bake bread?")
    assert hit is not None and hit.key == stored.exact
    # A publisher that had read a later id learns it from its own XADD's id.
    data = b"elsewhere" + fields[b"i"][len(a.shared.origin) :]
    await client.xadd(name, {"i": data}, id="99999999999999-0")
    await a.shared.sync()
    while a.shared.reading:  # its first pass also checks the stream's last id: let it
        await asyncio.sleep(0)
    await client.delete(name)
    await a.cached("How do I tie a tie?")
    assert a.shared.counts["restarts"] == 1 and a.shared.last_id == "0-0"


async def test_a_publish_past_its_budget_is_counted_as_late_and_lands(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    """A publish that Redis answers past its budget (a ``CLIENT PAUSE``, as a loaded
    machine or a failover does) leaves the request to go on: counted as
    ``publish_timeout``, not as an error, since the command runs on and lands."""
    prefix = f"gwt-{secrets.token_hex(4)}:"
    a = Replica(Redis(url=redis_server.url), prefix)
    b = Replica(Redis(url=redis_server.url), prefix)
    redis_admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await a.cached("How do I learn Python?")  # connected, and published once
        key = key_for("How do I bake bread?")
        entry = CachedResponse(200, (), b"{}", None, 0.0, "main", "v1", "chat", key.scope)
        assert await a.cache.put(key, entry, 60) and key.prompt is not None  # its answer
        a.store.budget_s = 0.05  # the default, for this one publish
        await redis_admin.client_pause(
            300, all=False
        )  # writes wait; the redis_admin's own reply too
        await a.tier.add(key, key.prompt, key.exact)
        assert a.shared.counts["publish_timeout"] == 1 and a.shared.counts["publish_error"] == 0
        for _ in range(100):  # after the pause the XADD lands, and the other replica reads it
            if await b.ask("How can I bake bread?") is not None:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the late publish never reached the other replica")
    finally:
        await redis_admin.aclose()
        await a.close()
        await b.close()


async def test_redis_down_leaves_the_local_index_working_and_sharing_resumes(
    redis_server: RedisServer,  # noqa: F811
) -> None:
    prefix = "gwt-down:"
    a = Replica(Redis(url=redis_server.url), prefix)
    b = Replica(Redis(url=redis_server.url), prefix)
    try:
        await a.cached("How do I learn Python?")
        assert await b.ask("How can I learn Python?") is not None
        redis_server.stop()
        key = key_for("How do I bake bread?")
        assert key.prompt is not None
        await a.tier.add(key, key.prompt, key.exact)  # indexed here, not published
        assert len(a.tier) == 2 and a.shared.counts["publish_error"] == 1
        assert await b.ask("How can I learn Python?") is None  # the store is down: a miss
        assert await a.ask("How can I bake bread?") is None
        assert b.shared.counts["read_error"] >= 1 and b.store.errors >= 1
        redis_server.start()  # back, empty
        for _ in range(100):
            for replica in (a, b):
                replica.clock.advance(60)  # past the store's retry interval
                await replica.store.ping()
            # The cache comes back within a few tries, as in test_stage_cache's outage
            # test.
            stored, ok = await a.put("How do I tie a tie?")
            hit = await b.ask("How can I tie a tie?") if ok else None
            if hit is not None:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail(f"sharing did not resume: {a.shared!r} {b.shared!r}")
        assert hit.key == stored.exact
    finally:
        await a.close()
        await b.close()


async def test_repr_shows_the_shared_state(replicas: Any) -> None:
    a = await replicas(max_entries=10)
    assert isinstance(a.shared, SharedIndex)
    assert repr(a.shared) == f"<SharedIndex v:{ROUTE} idle last=0-0>"
    await a.cached("How do I learn Python?")
    await a.ask("How can I learn Python?")
    # idle, or reading if its background reader is under way just then
    shown = r"<SharedIndex v:chat (idle|reading) last=\S+ own=1 published=1>"
    assert re.fullmatch(shown, repr(a.shared)), repr(a.shared)
    assert repr(a.tier).startswith(
        "<EmbeddingTier embedder=words threshold=0.60 verifier=rules entries=1/10"
    )
    assert f" shared={a.shared.last_id}>" in repr(a.tier)


# -- two gateways, one Redis ------------------------------------------------------------------

POLICY = """
backends:
  gpu: {{url: "{sim}"}}
  emb: {{url: "{emb}"}}
cache: {{store: redis, redis_url: "{redis}"}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    backend: gpu
    cache: {{ttl_s: 60, semantic: {{method: embedding, embedder: emb, threshold: 0.6}}}}
"""


async def test_two_gateways_on_one_redis_answer_each_others_paraphrases(
    redis_url: str,  # noqa: F811
    start_gateway: Any,
    serve_app: Any,
    tmp_path: Path,
) -> None:
    client = aioredis.Redis.from_url(redis_url)
    async for name in client.scan_iter(match="gw:*"):
        await client.delete(name)
    sim = await start_sim(SimConfig(port=0, base_ms=1.0, token_ms=0.0))
    emb_url = await serve_app(EmbeddingsServer().app())
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY.format(sim=sim.url, emb=emb_url, redis=redis_url))
    try:
        first = await start_gateway(policy=policy, warmup=False)
        second = await start_gateway(policy=policy, warmup=False)
        path = "/v1/chat/completions"

        def ask(text: str) -> dict[str, Any]:
            return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}

        alice, bob = {"Authorization": "Bearer alice"}, {"Authorization": "Bearer bob"}
        async with httpx.AsyncClient() as http:
            stored = await http.post(
                first.url + path, json=ask("How do I learn Python?"), headers=alice
            )
            assert stored.headers["X-Gateway-Cache"] == "miss"
            para = await http.post(
                second.url + path, json=ask("How can I learn Python?"), headers=alice
            )
            assert para.headers["X-Gateway-Cache"] == "hit"
            assert para.headers["X-Gateway-Cache-Match"] == "embedding"
            assert para.json()["id"] == stored.json()["id"]
            other = await http.post(
                second.url + path, json=ask("How can I learn Python?"), headers=bob
            )
            assert other.headers["X-Gateway-Cache"] == "miss"
            assert other.json()["id"] != stored.json()["id"]
            published = (await http.get(first.admin_url + "/metrics")).text
            seen = (await http.get(second.admin_url + "/metrics")).text
        # a loaded machine can keep the XADD past its 50 ms budget: counted as publish_timeout
        # while the command runs on, and published all the same (the other replica indexed it)
        assert any(
            f'gateway_cache_embedding_shared_total{{event="{event}",route="chat"}} 1.0' in published
            for event in ("published", "publish_timeout")
        )
        assert 'gateway_cache_embedding_shared_total{event="indexed",route="chat"} 1.0' in seen
        assert 'gateway_cache_embedding_entries{route="chat"} 2.0' in seen  # alice's and bob's
    finally:
        await sim.close()
        async for name in client.scan_iter(match="gw:*"):
            await client.delete(name)
        await client.aclose()
