"""Failover is a fault like any other (issue 27): under load through a gateway whose cache
store and ``store: redis`` rate limit share a real distributed Redis, the master is killed
(SIGKILL) and a replica takes over: a Redis Cluster's master with one replica each, or the
master of a Sentinel setup (one replica, three sentinels).

No client request fails (the cache answers misses, the limit falls back to the local
share), the Redis layer finds the new master by itself, the cache hit rate recovers (the
replica had the entries), and the limit admits no more than its documented slack: the
shared bucket, a fresh local bucket while Redis is down, and one more burst for writes the
promoted replica may not have had (``docs/caching.md``).  Bounds are counts over the window
measured, never speeds.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio.cluster import RedisCluster

from gateway.redis import REDIS_LINK, RedisLink
from gateway.testing.harness import Pipeline
from tests.backends import Model
from tests.redis_cluster import Cluster, Sentinels, policy_section
from tests.redis_server import REDIS_BINARY

pytestmark = pytest.mark.redis
RATE, BURST = 20.0, 5.0
PROMPTS = 12
WORKERS = 4
DEADLINE_S = 40.0
"""Longest the recovery may take: detection, election and the layer's next probe."""


@pytest.fixture(params=["cluster", "sentinel"])
def topology(request: pytest.FixtureRequest) -> Iterator[Cluster | Sentinels]:
    if REDIS_BINARY is None:
        pytest.skip("needs a redis-server binary")
    made: Cluster | Sentinels = Cluster(replicas=1) if request.param == "cluster" else Sentinels()
    try:
        made.start()
        yield made
    finally:
        made.close()


def failover_policy(topology: Cluster | Sentinels) -> dict[str, Any]:
    limit = {"requests_per_s": RATE, "burst": BURST, "store": "redis"}
    return {
        "backends": {"main": {"url": "http://main.test"}},
        "cache": {"store": "redis"},
        "redis": policy_section(topology.settings),
        "routes": [
            {
                "name": "limited",
                "match": {"path": "/v1/chat/completions", "model": "limited"},
                "backend": "main",
                "rate_limit": limit,
            },
            {
                "name": "chat",
                "match": {"path": "/v1/chat/completions"},
                "backend": "main",
                "cache": {"ttl_s": 600},
            },
        ],
    }


class Load:
    """Closed-loop clients: each sends a cached question (one of ``PROMPTS``) and a request
    on the limited route, over and over; every answer and exception is tallied."""

    def __init__(self, gw: Pipeline) -> None:
        self.gw = gw
        self.tenant = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
        self.cached: list[tuple[float, str | None]] = []
        self.limited: Counter[int] = Counter()
        self.failures: list[str] = []
        self.running = True

    async def client(self, n: int) -> None:
        i = n
        while self.running:
            i += WORKERS
            body = {
                "model": "m",
                "temperature": 0,
                "messages": [{"role": "user", "content": f"question {i % PROMPTS}"}],
            }
            limited = {"model": "limited", "messages": [{"role": "user", "content": "hi"}]}
            try:
                answer = await self.gw.post("/v1/chat/completions", body, headers=self.tenant)
                if answer.status_code != 200:
                    self.failures.append(f"cached: {answer.status_code}")
                self.cached.append((time.monotonic(), answer.headers.get("X-Gateway-Cache")))
                answer = await self.gw.post("/v1/chat/completions", limited, headers=self.tenant)
                self.limited[answer.status_code] += 1
                if answer.status_code not in (200, 429):
                    self.failures.append(f"limited: {answer.status_code}")
            except Exception as exc:  # a failed request, whatever failed
                self.failures.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.002)

    def hit_rate(self, since: float) -> tuple[float, int]:
        recent = [result for at, result in self.cached if at >= since]
        return (sum(r == "hit" for r in recent) / len(recent) if recent else 0.0), len(recent)


def recovered(load: Load, window_s: float) -> bool:
    """Nine in ten of the last ``window_s``'s cached questions (ten at least) were hits."""
    rate, seen = load.hit_rate(time.monotonic() - window_s)
    return rate >= 0.9 and seen >= 10


def killed_master(topology: Cluster | Sentinels) -> int:
    """Kill the master holding the limit's buckets (a Cluster's) or the one master; its port."""
    if isinstance(topology, Sentinels):
        victim = topology.master
    else:
        found = topology.keys_by_master("gw:rl:*")
        port = next(port for port, keys in found.items() if keys)
        victim = next(s for s in topology.masters if s.port == port)
    victim.stop()
    return victim.port


async def new_master(topology: Cluster | Sentinels, link: RedisLink) -> set[int]:
    """The masters the gateway's client routes to now."""
    if isinstance(topology, Sentinels):
        _, port = await link.client.connection_pool.get_master_address()
        return {int(port)}
    client: RedisCluster = link.client
    return {int(node.port) for node in client.get_primaries()}


async def test_a_failover_fails_no_request_and_the_cache_and_limit_recover(
    pipeline: Any, topology: Cluster | Sentinels
) -> None:
    gw = await pipeline(failover_policy(topology), Model("main"))
    link = gw.gateway.registry.peek(REDIS_LINK)
    assert link is not None
    load = Load(gw)
    workers = [asyncio.create_task(load.client(n)) for n in range(WORKERS)]
    try:
        started = time.monotonic()
        while not recovered(load, 0.5):  # warm: every question cached
            assert time.monotonic() - started < DEADLINE_S, "the cache never warmed up"
            await asyncio.sleep(0.1)
        killed = killed_master(topology)
        failed_at = time.monotonic()
        # Until the failover itself is done: with the cache's keys on another master, the
        # cache never stops hitting, and the link is up while the other masters answer.
        while not (
            link.errors > 0
            and link.up
            and recovered(load, 1.0)
            and killed not in await new_master(topology, link)
        ):
            assert time.monotonic() - failed_at < DEADLINE_S, (repr(link), load.hit_rate(0))
            await asyncio.sleep(0.25)
    finally:
        load.running = False
        await asyncio.gather(*workers)
    elapsed = time.monotonic() - started
    assert load.failures == []
    assert killed not in await new_master(topology, link)
    assert set(load.limited) <= {200, 429} and load.limited[429] > 0
    # the shared bucket, a fresh local one while Redis was down, one burst lost in failover
    assert load.limited[200] <= RATE * elapsed + 3 * BURST + 1, (load.limited, elapsed)
    assert gw.metric("gateway_redis_up", mode=link.mode) == 1
