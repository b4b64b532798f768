"""The fleet's rate history in a real Redis (``gateway/pool/shared.py``): replicas sum their
counts into one hash per route and forecast from the sum; Redis down costs nothing but the
fleet's view (counts owed are sent later, the forecast falls back to the replica's own);
garbage in the hash is ignored and the history stays bounded.  Against one ``redis-server``
and a three-master Redis Cluster (``redis_target``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.policy.model import Redis
from gateway.pool.forecast import DAY_MIN, WEEK_MIN, RateHistory, RouteRate
from gateway.pool.shared import TIMEOUT_S, SharedHistory
from gateway.pool.stage import HISTORIES, SHARED_HISTORIES
from gateway.redis import RedisLink
from gateway.testing import FakeClock
from tests.backends import Model, post
from tests.helpers import policy
from tests.redis_cluster import admin_client, policy_section
from tests.redis_server import RedisServer, redis_server  # noqa: F401
from tests.test_forecast import MONDAY, series

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture
async def client(redis_target: Redis) -> AsyncIterator[Any]:
    """A client of the test's own, to look at and seed the hashes."""
    made = admin_client(redis_target)
    for name in ("gw:rate:chat", "gw:rate:r"):
        await made.delete(name)
    yield made
    for name in ("gw:rate:chat", "gw:rate:r"):
        await made.delete(name)
    await made.aclose()


@pytest.fixture
async def link(redis_target: Redis) -> AsyncIterator[RedisLink]:
    """The replicas' link to Redis (each gateway has one; sharing it changes nothing here)."""
    made = RedisLink.patient(redis_target, TIMEOUT_S)
    yield made
    await made.aclose()


def replica(link: RedisLink, clock: FakeClock, route: str = "r") -> SharedHistory:
    return SharedHistory(route, RouteRate(RateHistory(clock)), link, clock=clock)


async def test_two_replicas_forecast_from_the_sum_of_their_counts(
    client: Any, link: RedisLink
) -> None:
    clock = FakeClock(wall_start=MONDAY * 60.0)
    a, b = replica(link, clock), replica(link, clock)
    a.rate.history.record(30)
    b.rate.history.record(90)
    clock.advance(60)
    assert await a.sync() and await b.sync() and await a.sync()
    assert await client.hget("gw:rate:r", str(MONDAY)) == b"120"
    for shared in (a, b):
        assert shared.rate.counts() == ([120], MONDAY)
        assert shared.rate.forecast(600).requests_per_s == pytest.approx(2.0)  # 120/min
        assert shared.rate.best_rps() == pytest.approx(2.0)
    assert await a.sync()  # a second sync sends nothing twice
    assert await client.hget("gw:rate:r", str(MONDAY)) == b"120"


async def test_syncs_at_once_run_one_after_the_other(client: Any, link: RedisLink) -> None:
    """The background sync and one asked for (a test's, an operator's) may overlap: each
    minute owed is still sent once, and the counts applied last are the newest."""
    clock = FakeClock(wall_start=MONDAY * 60.0)
    shared = replica(link, clock)
    shared.rate.history.record(7)
    clock.advance(60)
    assert all(await asyncio.gather(shared.sync(), shared.sync(), shared.sync()))
    assert await client.hget("gw:rate:r", str(MONDAY)) == b"7"
    assert shared.rate.counts() == ([7], MONDAY)


async def test_a_seeded_week_reaches_a_new_replicas_seasonal_forecast(
    client: Any, link: RedisLink
) -> None:
    """What the other replicas recorded is the new one's history at once: a replica that
    just started forecasts the morning climb it never saw (Holt-Winters, not the naive
    last-hour mean)."""
    counts = series(3 + 10 / 24)
    now = MONDAY + len(counts)
    await client.hset("gw:rate:r", mapping={str(MONDAY + i): int(n) for i, n in enumerate(counts)})
    clock = FakeClock(wall_start=now * 60.0)
    fresh = replica(link, clock)
    assert await fresh.sync()
    predicted = fresh.rate.forecast(3600)
    assert predicted.method == "holt-winters"
    assert predicted.requests_per_s > sum(counts[-60:]) / 3600


async def test_garbage_in_the_hash_is_ignored_and_old_minutes_are_deleted(
    client: Any, link: RedisLink
) -> None:
    clock = FakeClock(wall_start=(MONDAY + 8 * DAY_MIN) * 60.0)
    now = MONDAY + 8 * DAY_MIN
    await client.hset(
        "gw:rate:r",
        mapping={
            "not-a-minute": 5,
            str(now - 2): "lots",
            str(now - 1): -4,
            str(now + 10): 7,  # ahead of now
            str(now - 3): 6,
            str(MONDAY): 9,  # more than a week old
        },
    )
    shared = replica(link, clock)
    clock.advance(1)
    assert await shared.sync()
    assert shared.rate.counts() == ([6, 0, 0], now - 3)
    assert await shared.sync()
    assert await client.hexists("gw:rate:r", str(MONDAY)) == 0


async def test_redis_down_costs_only_the_fleets_view(redis_server: RedisServer) -> None:  # noqa: F811
    """Counts of minutes finished while Redis was down are sent when it is back; meanwhile,
    once the fleet's counts are stale, the replica forecasts from its own."""
    link = RedisLink.connect(Redis(url=redis_server.url))
    client = link.client
    clock = FakeClock(wall_start=MONDAY * 60.0)
    shared = replica(link, clock)
    try:
        shared.rate.history.record(60)
        clock.advance(60)
        assert await shared.sync()
        redis_server.stop()
        shared.rate.history.record(120)
        clock.advance(60)
        assert not await shared.sync()
        assert shared.errors == 1
        assert shared.rate.counts() == ([60], MONDAY)  # the fleet's, still fresh
        clock.advance(4 * 60)
        assert not await shared.sync()
        assert shared.rate.counts()[0][:2] == [60, 120]  # stale: this replica's own
        redis_server.start()
        assert await shared.sync()
        assert await client.hget("gw:rate:r", str(MONDAY + 1)) == b"120"
    finally:
        await link.aclose()


async def test_a_redis_cache_store_makes_a_prewarm_routes_history_the_fleets(
    pipeline: Any, client: Any, redis_target: Redis
) -> None:
    clock = FakeClock(wall_start=MONDAY * 60.0)
    data = policy(
        {"main": {"endpoints": ["http://a", "http://b"]}},
        {"prewarm": {"horizon_s": 600, "endpoint_rps": 1.0}},
    )
    data["cache"] = {"store": "redis"}
    data["redis"] = policy_section(redis_target)
    gw = await pipeline(data, {"main": Model("main")}, clock=clock)
    await client.hset("gw:rate:chat", str(MONDAY - 1), 600)  # another replica's minute
    for i in range(3):
        assert (await post(gw, f"q{i}")).status_code == 200
    clock.advance(60)
    shared = gw.gateway.registry.peek(SHARED_HISTORIES, "chat")
    assert shared is not None and await shared.sync()
    assert await client.hget("gw:rate:chat", str(MONDAY)) == b"3"
    rate = gw.gateway.registry.peek(HISTORIES, "chat")
    assert rate is not None and rate.counts() == ([600, 3], MONDAY - 1)
    assert (
        gw.metric("gateway_desired_endpoints", backend="main") == 7
    )  # ceil((600 + 3) / 2 / 60 * 1.2 / 1.0)


async def test_a_flooded_hash_is_not_read_and_the_replica_forecasts_from_its_own(
    client: Any, link: RedisLink
) -> None:
    """A hash holding more fields than a week of minutes is not this gateway's writing: it is
    not read whole every minute; the replica says so and uses its own history."""
    clock = FakeClock(wall_start=MONDAY * 60.0)
    await client.hset("gw:rate:r", mapping={f"junk{i}": 1 for i in range(WEEK_MIN + 2000)})
    shared = replica(link, clock)
    shared.rate.history.record(42)
    clock.advance(60)
    assert not await shared.sync()
    assert shared.errors == 1
    assert shared.rate.counts() == ([42], MONDAY)
    assert await client.hget("gw:rate:r", str(MONDAY)) == b"42"  # its minute still went
