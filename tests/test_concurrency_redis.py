"""Concurrency caps shared through a real Redis (``tenants.concurrency_store: redis``,
``gateway/resilience/concurrency_redis.py``): one count per tenant (and per address) for
every gateway; leases that lapse unless renewed; and a Redis that is down or failing makes
each process hold its local share, never fail a request.  The script runs against one
``redis-server`` and a three-master Redis Cluster (``redis_target``).

The leases' times are pinned with explicit times (``now_us``); the tests through gateways
use Redis's own clock and assert counts only."""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError, StoreError
from gateway.metrics import Metrics
from gateway.policy import parse_policy_text
from gateway.policy.model import Redis
from gateway.redis import RedisLink
from gateway.resilience.concurrency import IN_FLIGHT, ConcurrencyLimited, InFlight
from gateway.resilience.concurrency_redis import (
    LEASE_S,
    RENEWING_AT_ONCE,
    SHARED_IN_FLIGHT,
    TENANT,
    RedisSlots,
    SharedInFlight,
)
from gateway.testing import FakeClock
from gateway.testing.harness import Answer, Pipeline
from tests.backends import Model, post, started
from tests.helpers import chat, policy, until, write_policy
from tests.redis_cluster import admin_client, policy_section
from tests.redis_server import RedisServer, redis_server, redis_url  # noqa: F401
from tests.test_stage_resilience import CHAT, URL

pytestmark = pytest.mark.redis
T0 = 1_000_000_000_000_000  # microseconds: any time will do when the caller gives it
SECOND = 1_000_000
REFUSED_WITHIN_S = 5.0


@pytest.fixture
async def slots(redis_target: Redis) -> AsyncIterator[RedisSlots]:
    link = RedisLink.patient(redis_target, 1.0)
    made = RedisSlots(link, budget_s=1.0, prefix=f"gw:cc:test-{uuid.uuid4()}:", owns_link=True)
    yield made
    await made.aclose()


# -- the script --------------------------------------------------------------------------


async def test_places_are_taken_under_the_cap_refused_past_it_and_given_back(slots: RedisSlots):
    key = slots.key(TENANT, "acme")
    assert [await slots.take(key, 2, call, T0) for call in "abc"] == [
        (True, 1),
        (True, 2),
        (False, 2),
    ]
    await slots.give_back(key, "a")
    assert await slots.take(key, 2, "c", T0) == (True, 2)
    assert await slots.take(slots.key(TENANT, "globex"), 2, "a", T0) == (True, 1)


async def test_a_lease_lapses_unless_renewed(slots: RedisSlots):
    key = slots.key(TENANT, "acme")
    lease = round(LEASE_S * SECOND)
    await slots.take(key, 2, "renewed", T0)
    await slots.take(key, 2, "forgotten", T0)  # its process died: never renewed, never given back
    assert await slots.renew(key, ["renewed"], T0 + lease // 2) == 2
    assert await slots.take(key, 2, "third", T0 + lease + 1) == (True, 2)  # forgotten lapsed
    assert await slots.take(key, 2, "fourth", T0 + lease + 2) == (False, 2)
    later = T0 + lease // 2 + lease + 1  # the renewed lease has lapsed too
    assert await slots.take(key, 2, "fourth", later) == (True, 2)


async def test_a_renewal_puts_back_a_call_in_flight_whose_lease_lapsed(slots: RedisSlots):
    """A process cut off from Redis for a whole lease still has its calls in flight: they
    count again once it reaches Redis."""
    key = slots.key(TENANT, "acme")
    await slots.take(key, 1, "long", T0)
    late = T0 + 2 * round(LEASE_S * SECOND)
    assert await slots.renew(key, ["long"], late) == 1
    assert await slots.take(key, 1, "newcomer", late + 1) == (False, 1)


async def test_one_key_per_tenant_and_address_expiring_with_its_last_lease(
    slots: RedisSlots, redis_admin: Any
):
    braced = slots.key(TENANT, "ac}me{")
    assert braced == slots.prefix + "{tenant:ac%7Dme%7B}"
    assert slots.key("client", "10.0.0.1") == slots.prefix + "{client:10.0.0.1}"
    await slots.take(braced, 1, "a")  # Redis's own clock
    assert 0 < await redis_admin.pttl(braced) <= LEASE_S * 1000
    assert await redis_admin.zcard(braced) == 1
    await slots.give_back(braced, "a")
    assert await redis_admin.zcard(braced) == 0


async def test_an_answer_not_shaped_like_the_scripts_is_a_store_error(slots: RedisSlots):
    for answer in ([1], [1, 2, 3], ["yes", 1], None, 7):

        async def script(answer: Any = answer, **_: Any) -> Any:
            return answer

        slots._script = script
        with pytest.raises(StoreError, match="unexpected answer"):
            await slots.take("k", 1, "a")


# -- one process's counts over the shared sets -------------------------------------------


def shared(slots: RedisSlots, clock: FakeClock, replicas: int = 2) -> SharedInFlight:
    """One process's counts of tenants over ``slots``."""
    metrics = Metrics()
    return SharedInFlight(
        InFlight(metrics), slots, TENANT, replicas=replicas, metrics=metrics, clock=clock
    )


async def test_a_process_renews_its_calls_leases_until_they_end(
    slots: RedisSlots, redis_admin: Any
):
    clock = FakeClock()
    counts = shared(slots, clock)
    key = slots.key(TENANT, "acme")
    try:
        held = await counts.take("acme", 3)
        await until(lambda: clock.sleepers == 1)  # the renewals have begun
        await redis_admin.delete(key)  # as if its lease had lapsed
        clock.advance(LEASE_S / 3)
        await until_async(lambda: redis_admin.zcard(key), 1)  # renewed: put back
        assert repr(counts) == "<SharedInFlight tenant replicas=2 held_in_redis=1>"
        held.release()
        await until_async(lambda: redis_admin.zcard(key), 0)
        clock.advance(LEASE_S / 3)
        assert repr(counts) == "<SharedInFlight tenant replicas=2 held_in_redis=0>"
        await until(lambda: clock.sleepers == 0)  # nothing left to renew: the renewals stop
    finally:
        await counts.aclose()


async def test_every_key_is_renewed_each_time_past_those_renewed_together(
    slots: RedisSlots, redis_admin: Any
):
    clock = FakeClock()
    counts = shared(slots, clock)
    names = [f"tenant-{n}" for n in range(RENEWING_AT_ONCE * 2 + 3)]
    held = [await counts.take(name, 1) for name in names]
    try:
        await until(lambda: clock.sleepers == 1)
        keys = [slots.key(TENANT, name) for name in names]
        for key in keys:  # one at a time: a Cluster spreads them over its nodes
            await redis_admin.delete(key)
        clock.advance(LEASE_S / 3)
        for key in keys:
            await until_async(lambda key=key: redis_admin.zcard(key), 1)
    finally:
        for slot in held:
            slot.release()
        await counts.aclose()


async def test_a_caller_leaving_while_its_place_is_taken_gives_it_back(
    slots: RedisSlots, redis_admin: Any
):
    """The script ran (the place is in Redis) but its answer had not come back when the
    caller's client left: the place is given back, not left to lapse."""
    script, answered = slots._script, asyncio.Event()

    async def late(**kw: Any) -> Any:
        answer = await script(**kw)
        answered.set()
        await asyncio.sleep(0.2)  # a slow way back
        return answer

    slots._script = late
    counts = shared(slots, FakeClock())
    key = slots.key(TENANT, "acme")
    try:
        taking = asyncio.ensure_future(counts.take("acme", 1))
        await answered.wait()
        assert await redis_admin.zcard(key) == 1
        taking.cancel()
        with pytest.raises(asyncio.CancelledError):
            await taking
        await until_async(lambda: redis_admin.zcard(key), 0)
        assert counts.held("acme") == 0
    finally:
        await counts.aclose()


async def until_async(read: Any, expected: Any) -> None:
    for _ in range(200):
        if await read() == expected:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never {expected!r}: {await read()!r}")


async def test_while_redis_is_down_each_process_holds_its_local_share(
    redis_server: RedisServer,  # noqa: F811
):
    clock = FakeClock()
    link = RedisLink.patient(Redis(url=redis_server.url), 1.0, clock=clock, retry_s=1.0)
    slots = RedisSlots(link, budget_s=1.0, owns_link=True)
    counts = shared(slots, clock, replicas=2)
    try:
        redis_server.stop()
        held = [await counts.take("acme", 5) for _ in range(2)]  # 5 // 2
        with pytest.raises(ConcurrencyLimited, match="already has 2 requests in flight"):
            await counts.take("acme", 5)
        held.pop().release()
        held.append(await counts.take("acme", 5))
        assert counts.held("acme") == 2
        one = await counts.take("globex", 1)  # never below one
        for slot in [*held, one]:
            slot.release()
        assert counts.held("acme") == 0
    finally:
        await counts.aclose()
        await slots.aclose()


# -- through gateways ----------------------------------------------------------------------


def names() -> tuple[str, str]:
    """A tenant name and its key, fresh for each test: the sets live on in the shared Redis."""
    return f"acme-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex


def shared_policy(
    redis: str | Redis, tenant: tuple[str, str], cap: int | None = 2, **tenants: Any
) -> dict[str, Any]:
    name, secret = tenant
    key: dict[str, Any] = {"name": name, "sha256": hashlib.sha256(secret.encode()).hexdigest()}
    if cap is not None:
        key["max_concurrency"] = cap
    section = {"keys": [key], "concurrency_store": "redis", **tenants}
    if isinstance(redis, str):
        return policy({"main": {"url": URL}}, tenants=section, cache={"redis_url": redis})
    return policy({"main": {"url": URL}}, tenants=section, redis=policy_section(redis))


def patient(gw: Pipeline) -> Pipeline:
    """A gateway whose Redis gets a second to answer, not 25 ms: the machine running the
    suite may stall that long, which would (rightly) make a decision local."""
    for _, counts in gw.gateway.registry.items(SHARED_IN_FLIGHT):
        counts.slots.budget_s = 1.0
    return gw


async def refused(answer: Any) -> Answer:
    return await asyncio.wait_for(answer, REFUSED_WITHIN_S)


async def test_two_gateways_share_one_count_per_tenant(pipeline: Any, redis_target: Redis):
    tenant = names()
    main_a, main_b = Model("main"), Model("main")
    main_a.hold()
    main_b.hold()
    a = patient(await pipeline(shared_policy(redis_target, tenant), main_a))
    b = patient(await pipeline(shared_policy(redis_target, tenant), main_b))
    auth = {"Authorization": f"Bearer {tenant[1]}"}
    held = [started(a, "a-1", headers=auth), started(b, "b-1", headers=auth)]
    try:
        await until(lambda: main_a.active == 1 and main_b.active == 1)
        for gw in (a, b):
            over = await refused(post(gw, "over", headers=auth))
            assert over.status_code == 429
            error = over.json()["error"]
            assert error["code"] == "concurrency_limit_exceeded"
            assert "2 requests in flight across the gateway's processes" in error["message"]
        held.append(started(b, "anonymous"))  # no cap: not held back
        await until(lambda: main_b.active == 2)
        main_a.let()
        assert (await held[0]).status_code == 200
        redis_admin = admin_client(redis_target)
        key = f"gw:cc:{{tenant:{tenant[0]}}}"
        try:
            await until_async(lambda: redis_admin.zcard(key), 1)  # a-1 gave its place back
        finally:
            await redis_admin.aclose()
        held.append(started(b, "b-2", headers=auth))
        await until(lambda: main_b.active == 3)
    finally:
        main_a.let(5)
        main_b.let(5)
    assert [(await h).status_code for h in held] == [200] * 4
    assert a.metric("gateway_concurrency_decisions_total", store="redis") == 2
    assert b.metric("gateway_concurrency_decisions_total", store="redis") == 3
    assert b.metric("gateway_concurrency_decisions_total", store="local") in (None, 0)
    assert a.metric("gateway_tenant_concurrency_limited_total", tenant=tenant[0]) == 1


async def test_an_address_is_one_count_across_gateways(pipeline: Any, redis_url: str):  # noqa: F811
    tenant = names()
    peer = f"10.{uuid.uuid4().int % 250}.0.1"  # fresh for this test
    main_a, main_b = Model("main"), Model("main")
    main_a.hold()
    text = shared_policy(redis_url, tenant, None, max_concurrency=1)
    a = patient(await pipeline(text, main_a))
    b = patient(await pipeline(text, main_b))
    first = a.send("POST", CHAT, json=chat("first"), peer=peer)
    try:
        await until(lambda: main_a.active == 1)
        over = await refused(b.send("POST", CHAT, json=chat("second"), peer=peer).done())
        assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
        other = await b.send("POST", CHAT, json=chat("other"), peer="192.0.2.7").done()
        assert other.status_code == 200
    finally:
        main_a.let()
    assert (await first.done()).status_code == 200
    assert b.metric("gateway_client_concurrency_limited_total") == 1


async def test_redis_killed_under_a_gateway_leaves_the_local_share_and_no_failed_request(
    pipeline: Any,
    redis_server: RedisServer,  # noqa: F811
):
    tenant = names()
    auth = {"Authorization": f"Bearer {tenant[1]}"}
    main = Model("main")
    main.hold()
    gw = patient(
        await pipeline(shared_policy(redis_server.url, tenant, 4, concurrency_replicas=2), main)
    )
    held = [started(gw, "before", headers=auth)]
    try:
        await until(lambda: main.active == 1)
        redis_server.stop()
        held.append(started(gw, "after", headers=auth))  # the local share: 4 // 2
        await until(lambda: main.active == 2)
        over = await refused(post(gw, "over", headers=auth))
        assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
        message = over.json()["error"]["message"]
        assert "2 requests in flight in this gateway process, its share while Redis" in message
        assert "its max_concurrency is 4" in message
    finally:
        main.let(3)
    assert [(await h).status_code for h in held] == [200, 200]
    assert gw.metric("gateway_concurrency_decisions_total", store="local") == 2
    assert gw.metric("gateway_tenant_in_flight", tenant=tenant[0]) == 0


async def test_a_reload_changing_the_replicas_keeps_the_places_held(
    pipeline: Any,
    redis_url: str,  # noqa: F811
    tmp_path: Any,
):
    tenant = names()
    file = write_policy(tmp_path, shared_policy(redis_url, tenant, concurrency_replicas=2))
    gw = await pipeline(file, Model("main"))
    before = gw.gateway.registry.peek(SHARED_IN_FLIGHT, TENANT)
    write_policy(tmp_path, shared_policy(redis_url, tenant, concurrency_replicas=4))
    assert gw.gateway.reload()
    after = gw.gateway.registry.peek(SHARED_IN_FLIGHT, TENANT)
    assert after is before and after is not None and after.replicas == 4
    assert gw.gateway.registry.peek(IN_FLIGHT) is after.local


def test_the_store_and_its_replicas_are_checked():
    text = yaml.safe_dump(shared_policy("redis://127.0.0.1:6379", names(), concurrency_replicas=0))
    with pytest.raises(PolicyError, match="concurrency_replicas: must be at least 1"):
        parse_policy_text(text)
    wrong = yaml.safe_load(text)
    wrong["tenants"]["concurrency_store"] = "etcd"
    wrong["tenants"]["concurrency_replicas"] = 1
    with pytest.raises(PolicyError, match="concurrency_store"):
        parse_policy_text(yaml.safe_dump(wrong))


async def test_a_reload_moving_to_another_redis_takes_the_places_held_along(
    pipeline: Any,
    redis_url: str,  # noqa: F811
    tmp_path: Any,
):
    """A changed ``redis:`` (another server, a rotated password) makes a new link: the calls
    in flight keep their places on it (renewed there at once), and give them back there."""
    tenant = names()
    auth = {"Authorization": f"Bearer {tenant[1]}"}
    key = f"gw:cc:{{tenant:{tenant[0]}}}"
    main = Model("main")
    main.hold()
    file = write_policy(tmp_path, shared_policy(redis_url, tenant, 1))
    gw = patient(await pipeline(file, main))
    held = started(gw, "long", headers=auth)
    try:
        await until(lambda: main.active == 1)
        with RedisServer() as other:
            write_policy(tmp_path, shared_policy(other.url, tenant, 1))
            assert gw.gateway.reload()
            patient(gw)
            moved = admin_client(Redis(url=other.url))
            try:
                await until_async(lambda: moved.zcard(key), 1)  # renewed there at once
                over = await refused(post(gw, "over", headers=auth))
                assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
                main.let()
                assert (await held).status_code == 200
                await until_async(lambda: moved.zcard(key), 0)  # given back there
            finally:
                await moved.aclose()
    finally:
        main.let(3)
    counts = gw.gateway.registry.peek(SHARED_IN_FLIGHT, TENANT)
    assert "held_in_redis=0" in repr(counts)
