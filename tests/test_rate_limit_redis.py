"""Rate limits shared through a real Redis (``gateway/resilience/rate_redis.py`` and
``rate_shared.py``): the GCRA script keeps the memory limiter's limit, burst and debt, one key
per tenant, route and limit kind, on Redis's own clock; two gateways share one count; and a
Redis that is down, slow or failing makes each process enforce its local share, never fail a
request, and is probed again in the background.  The script and the sharing run against one
``redis-server`` and a three-master Redis Cluster (``redis_target``).

The script's decisions are pinned with explicit times (``now_us``); the tests that use
Redis's own clock assert counts only."""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis

from gateway.errors import RateLimited, StoreError
from gateway.policy.model import RateLimit, Redis
from gateway.redis import REDIS_LINK
from gateway.redis.health import DOWN_AFTER
from gateway.resilience.quota import Standing
from gateway.resilience.rate_limit import RateLimiter
from gateway.resilience.rate_redis import REQUESTS, TOKENS, Bucket, RedisRates, bucket_key
from gateway.resilience.rate_shared import RATE_LIMIT_REDIS, SharedRateLimiter, local_share
from gateway.testing import FakeClock
from gateway.testing.harness import Pipeline
from tests.backends import Model, post
from tests.helpers import policy, until
from tests.redis_cluster import policy_section
from tests.redis_server import RedisServer, redis_server, redis_url  # noqa: F401

pytestmark = pytest.mark.redis
T0 = 1_000_000_000_000_000  # microseconds: any time will do when the caller gives it
SECOND = 1_000_000
URL = "http://main.test"


@pytest.fixture
async def rates(redis_target: Redis) -> AsyncIterator[RedisRates]:
    prefix = f"gw:rl:test-{uuid.uuid4().hex}:"
    made = RedisRates.connect(redis_target, budget_s=1.0, prefix=prefix)
    yield made
    await made.aclose()


def patient(gw: Pipeline) -> Pipeline:
    """A gateway whose rate-limit Redis gets a second to answer, not 25 ms: the machine
    running the suite may stall that long, which would (rightly) make a decision local."""
    rates = gw.gateway.registry.peek(RATE_LIMIT_REDIS)
    assert rates is not None
    rates.budget_s = 1.0
    return gw


def key(rates: RedisRates, kind: str = REQUESTS, tenant: str = "acme") -> str:
    return bucket_key(rates.prefix, "chat", tenant, kind)


# -- the script --------------------------------------------------------------------------


async def test_a_full_bucket_admits_its_burst_then_refuses_with_the_wait(rates: RedisRates):
    bucket = Bucket(REQUESTS, rate_per_s=2, capacity=3)
    one = [(key(rates), bucket, 1.0)]
    assert [await rates.admit(one, T0) for _ in range(4)] == [0.0, 0.0, 0.0, 0.5]
    assert await rates.admit(one, T0 + SECOND // 4) == 0.25  # a refusal took nothing
    assert await rates.admit(one, T0 + SECOND // 2) == 0.0
    assert await rates.admit(one, T0 + SECOND // 2) == 0.5


async def test_the_bucket_refills_at_its_rate_and_never_above_its_capacity(rates: RedisRates):
    bucket = Bucket(REQUESTS, rate_per_s=10, capacity=2)
    one = [(key(rates), bucket, 1.0)]
    later = T0 + 60 * SECOND  # a minute idle refills two, not six hundred
    admitted = [await rates.admit(one, later) == 0.0 for _ in range(4)]
    assert admitted == [True, True, False, False]
    assert await rates.admit(one, later + SECOND // 10) == 0.0


async def test_both_buckets_must_pay_and_a_refusal_takes_from_neither(rates: RedisRates):
    requests = (key(rates, REQUESTS), Bucket(REQUESTS, 5, 5), 1.0)
    tokens = (key(rates, TOKENS), Bucket(TOKENS, 1, 60), 60.0)  # 60 tokens/min
    assert await rates.admit([requests, tokens], T0) == 0.0
    for _ in range(3):
        assert await rates.admit([requests, (tokens[0], tokens[1], 10.0)], T0) == 10.0
    assert [await rates.admit([requests], T0) for _ in range(5)] == [0.0] * 4 + [0.2]


async def test_real_usage_puts_the_tenant_in_debt_and_refunds_stop_at_full(rates: RedisRates):
    """What ``RateLimiter.charge`` does, through Redis: a bucket of 600 tokens/min."""
    bucket = Bucket(TOKENS, 10, 600)
    tokens = key(rates, TOKENS)
    assert await rates.admit([(tokens, bucket, 100.0)], T0) == 0.0
    await rates.charge(tokens, bucket, 1000, T0)  # far longer than estimated
    assert await rates.admit([(tokens, bucket, 1.0)], T0) == pytest.approx(50.1)
    await rates.charge(tokens, bucket, -10_000, T0)
    assert await rates.admit([(tokens, bucket, 600.0)], T0) == 0.0
    assert await rates.admit([(tokens, bucket, 1.0)], T0) > 0


async def test_a_request_larger_than_the_bucket_is_admitted_when_it_is_full(rates: RedisRates):
    bucket = Bucket(TOKENS, 100 / 60, 100)
    tokens = key(rates, TOKENS)
    assert await rates.admit([(tokens, bucket, 5000.0)], T0) == 0.0
    assert await rates.admit([(tokens, bucket, 1.0)], T0) > 0


async def test_the_script_decides_as_the_memory_limiter_does(rates: RedisRates):
    """The same requests at the same times get the same answers from both stores (times
    and rates whose arithmetic is exact in binary, so neither store's rounding shows)."""
    limit = RateLimit(requests_per_s=4, tokens_per_min=600, burst=5)
    clock = FakeClock(start=0.0)
    memory = RateLimiter(limit, clock=clock)
    requests, tokens = Bucket(REQUESTS, 4, 5), Bucket(TOKENS, 10, 600)
    dice = random.Random(17)
    for _ in range(300):
        clock.advance(dice.choice((0.0, 0.125, 0.25, 0.5, 2.0)))
        now, estimate = T0 + round(clock.now() * SECOND), dice.choice((0, 20, 90))
        try:
            standing = memory.check("acme", estimate)
            expected, told = 0.0, standing.headers()  # admitted
        except RateLimited as exc:
            assert exc.retry_after_s is not None
            expected, told = exc.retry_after_s, list(exc.extra_headers)
        asked = [(key(rates, REQUESTS), requests, 1.0)]
        if estimate:
            asked.append((key(rates, TOKENS), tokens, float(estimate)))
        wait, quotas = await rates.decide(asked, now)
        assert (max(1, math.ceil(wait)) if wait else 0.0) == expected
        in_redis = Standing(quotas[0], quotas[1] if estimate else None).headers()
        assert in_redis == told[: len(in_redis)]  # the same standing told (x-ratelimit-*)
        if not expected and estimate:
            used = dice.choice((0, 40, 200))
            memory.charge("acme", used - estimate)
            await rates.charge(key(rates, TOKENS), tokens, used - estimate, now)


async def test_one_key_per_tenant_route_and_kind_that_expires_once_full(
    rates: RedisRates, redis_admin: Any
):
    # slow refills, so that no key expires while a busy machine scans three masters
    requests, tokens = Bucket(REQUESTS, 0.1, 2), Bucket(TOKENS, 1, 60)
    await rates.admit([(key(rates), requests, 1.0), (key(rates, TOKENS), tokens, 6.0)])
    found = [k.decode() async for k in redis_admin.scan_iter(match=rates.prefix + "*")]
    assert sorted(found) == [rates.prefix + "{chat:acme}:rq", rates.prefix + "{chat:acme}:tk"]
    assert 0 < await redis_admin.pttl(key(rates)) <= 10_000  # one request is ten seconds
    assert 0 < await redis_admin.pttl(key(rates, TOKENS)) <= 6000
    assert bucket_key("p:", "a:b}{", "c}d", "rq") == "p:{a%3Ab%7D%7B:c%7Dd}:rq"


async def test_redis_time_refills_the_bucket(rates: RedisRates):
    """On Redis's own clock: a refused request is admitted again once time has passed (the
    counts are asserted, never how long it took)."""
    bucket = Bucket(REQUESTS, rate_per_s=20, capacity=1)
    one = [(key(rates), bucket, 1.0)]
    assert await rates.admit(one) == 0.0
    assert 0 < await rates.admit(one) <= 0.05
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5
    while await rates.admit(one) > 0:
        assert loop.time() < deadline, "Redis's clock never moved"
        await asyncio.sleep(0.01)


async def test_a_flushed_script_is_loaded_again(rates: RedisRates, redis_admin: Any):
    """After a Redis restart its scripts are gone: EVALSHA fails with NOSCRIPT, and the
    script is loaded and run again within the same decision."""
    one = [(key(rates), Bucket(REQUESTS, 1, 5), 1.0)]
    assert await rates.admit(one, T0) == 0.0
    await redis_admin.script_flush()
    assert await rates.admit(one, T0) == 0.0
    assert rates.up and rates.link.errors == 0


# -- Redis down, slow or failing ---------------------------------------------------------


async def test_redis_down_is_left_alone_for_retry_s_then_probed_in_the_background(
    redis_server: RedisServer,  # noqa: F811
):
    """Down by evidence (``DOWN_AFTER`` commands in a row that could not reach it), as the
    cache store's Redis: one health machine, the Redis layer's."""
    clock = FakeClock()
    rates = RedisRates.connect(Redis(url=redis_server.url), clock=clock, budget_s=1.0, retry_s=1.0)
    one = [(bucket_key(rates.prefix, "chat", "acme", REQUESTS), Bucket(REQUESTS, 1, 5), 1.0)]
    try:
        assert await rates.admit(one) == 0.0
        redis_server.stop()
        for _ in range(DOWN_AFTER):
            with pytest.raises(StoreError):
                await rates.admit(one)
        assert not rates.up and not rates.usable()
        assert "down retry_in=1.0s errors=3 " in repr(rates)
        redis_server.start()
        assert not rates.usable()  # not before retry_s: no probe yet
        clock.advance(1.0)
        assert not rates.usable()  # the probe runs in the background; this call goes on
        await until(lambda: rates.up)
        assert await rates.admit(one) == 0.0
    finally:
        await rates.aclose()


async def test_decisions_past_their_budget_are_made_locally(redis_url: str):  # noqa: F811
    """A paused Redis (``CLIENT PAUSE``) answers late: past the budget each caller goes on
    without it; the commands left to run on time out on their own (0.2 s), the PING sent
    to confirm them times out too (0.2 s later, Redis still paused), and Redis is taken for
    down."""
    clock = FakeClock()
    rates = RedisRates.connect(Redis(url=redis_url), clock=clock, budget_s=0.025)
    redis_admin = aioredis.Redis.from_url(redis_url)
    one = [
        (bucket_key(rates.prefix, "slow", uuid.uuid4().hex, REQUESTS), Bucket(REQUESTS, 1, 5), 1)
    ]
    try:
        rates.budget_s = 1.0  # the first decision loads the script: a busy machine may take 25 ms
        assert await rates.admit(one) == 0.0
        rates.budget_s = 0.025
        await redis_admin.client_pause(1000, all=True)
        for _ in range(DOWN_AFTER):
            with pytest.raises(StoreError, match="budget"):
                await rates.admit(one)
        assert rates.up and rates.usable()  # late is not down
        await until(lambda: not rates.up)
        assert rates.link.forgiven == 0
        assert not rates.usable()
    finally:
        await redis_admin.client_unpause()
        await redis_admin.aclose()
        await rates.aclose()


async def test_an_error_redis_answers_with_makes_the_decision_local(
    redis_target: Redis, redis_admin: Any
):
    """A key of the wrong type (WRONGTYPE) fails that decision (made by the local share),
    but Redis answered: it is up, and the next tenant is decided in Redis."""
    rates = RedisRates.connect(redis_target, clock=FakeClock(), budget_s=1.0)
    tenant = uuid.uuid4().hex
    limiter = SharedRateLimiter("chat", RateLimit(requests_per_s=1, burst=1), rates)
    wrong = bucket_key(rates.prefix, "chat", tenant, REQUESTS)
    try:
        await redis_admin.hset(wrong, "x", 1)
        await limiter.check(tenant)
        assert limiter.decided == {"redis": 0, "local": 1} and limiter.up
        await limiter.check(uuid.uuid4().hex)
        assert limiter.decided == {"redis": 1, "local": 1}
    finally:
        await redis_admin.delete(wrong)
        await rates.aclose()


@pytest.mark.parametrize(
    "answer",
    [[1, 0], [1, 0, 1000, 2000], [1, 0, "lots"], None, b"OK"],
    ids=["no level", "a level too many", "not a number", "nothing", "not a list"],
)
async def test_an_answer_not_shaped_like_the_scripts_is_a_store_error(
    rates: RedisRates, answer: Any
):
    """Whatever answers for Redis (a proxy, an older script): an answer without exactly one
    level per bucket asked is no decision, so the limiter decides locally."""

    async def script(**_: Any) -> Any:
        return answer

    rates._script = script  # redis-py's script object: the third-party edge
    bucket = (key(rates), Bucket(REQUESTS, 1, 1), 1.0)
    with pytest.raises(StoreError, match="unexpected answer"):
        await rates.decide([bucket], T0)


def test_the_local_share_divides_rates_and_burst_by_the_replicas():
    limit = RateLimit(requests_per_s=10, tokens_per_min=6000, store="redis", replicas=4)
    assert local_share(limit) == RateLimit(requests_per_s=2.5, tokens_per_min=1500, burst=2.5)
    with_burst = RateLimit(requests_per_s=10, burst=20, store="redis", replicas=4)
    assert local_share(with_burst).burst == 5
    assert local_share(RateLimit(tokens_per_min=600, replicas=2)).burst is None


async def test_while_redis_is_down_the_local_share_applies_and_nothing_fails(
    redis_server: RedisServer,  # noqa: F811
):
    clock = FakeClock()
    rates = RedisRates.connect(Redis(url=redis_server.url), clock=clock, budget_s=1.0, retry_s=1.0)
    limit = RateLimit(requests_per_s=4, burst=4, store="redis", replicas=2)
    limiter = SharedRateLimiter("chat", limit, rates, clock=clock)
    try:
        redis_server.stop()
        admitted = 0
        for _ in range(6):
            try:
                await limiter.check("acme")
                admitted += 1
            except RateLimited as exc:
                assert exc.retry_after_s == 1.0
        assert admitted == 2  # the burst over 2 replicas
        assert limiter.decided == {"redis": 0, "local": 6}
        assert repr(limiter) == "<SharedRateLimiter chat local redis=0 local=6 rejected=4>"
        clock.advance(0.5)  # the local share refills at 4 / 2 per second
        await limiter.check("acme")
    finally:
        await rates.aclose()


# -- through the gateway -----------------------------------------------------------------


def shared_policy(redis: str | Redis, limit: dict[str, Any]) -> dict[str, Any]:
    route = {"rate_limit": {"store": "redis", **limit}}
    if isinstance(redis, str):
        return policy({"main": {"url": URL}}, route, cache={"redis_url": redis})
    return policy({"main": {"url": URL}}, route, redis=policy_section(redis))


async def test_two_gateways_share_one_count_per_tenant(pipeline: Any, redis_target: Redis):
    shared = shared_policy(redis_target, {"requests_per_s": 0.01, "burst": 3})
    a = patient(await pipeline(shared, Model("main")))
    b = patient(await pipeline(shared, Model("main")))
    alice = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
    bob = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
    statuses = [(await post(gw, headers=alice)).status_code for gw in (a, b, a, b)]
    assert statuses == [200, 200, 200, 429]
    over = await post(a, headers=alice)
    assert over.status_code == 429 and int(over.headers["Retry-After"]) > 1
    assert over.headers["x-ratelimit-remaining-requests"] == "0"  # told from Redis
    assert over.headers["x-ratelimit-limit-requests"] == "3"
    assert (await post(b, headers=bob)).status_code == 200
    assert a.metric("gateway_rate_limit_decisions_total", route="chat", store="redis") == 3
    assert b.metric("gateway_rate_limit_decisions_total", route="chat", store="local") == 0
    assert b.metric("gateway_rate_limit_store_up", route="chat") == 1
    assert a.metric("gateway_rate_limited_total", route="chat") == 1


async def test_tokens_per_minute_settle_on_the_answers_usage_through_redis(
    pipeline: Any, redis_target: Redis
):
    limit = {"tokens_per_min": 300}
    gw = patient(await pipeline(shared_policy(redis_target, limit), Model("main")))
    tenant = {"Authorization": f"Bearer {uuid.uuid4().hex}"}
    # Each call is estimated at body/4 + max_tokens = about 120 tokens; usage says 14.
    answers = [await post(gw, max_tokens=100, headers=tenant) for _ in range(6)]
    assert [a.status_code for a in answers] == [200] * 6  # unsettled, the third is refused
    left = int(answers[-1].headers["x-ratelimit-remaining-tokens"])
    assert 300 - 6 * 14 <= left < 300  # settled on usage (14 each), refilling on Redis's clock
    rates = gw.gateway.registry.peek(RATE_LIMIT_REDIS)
    assert rates is not None and rates.up and rates.link.errors == 0


async def test_redis_killed_under_a_gateway_leaves_the_local_share_and_no_failed_request(
    pipeline: Any,
    redis_server: RedisServer,  # noqa: F811
):
    clock = FakeClock()
    limit = {"requests_per_s": 0.01, "burst": 4, "replicas": 2}
    gw = patient(await pipeline(shared_policy(redis_server.url, limit), Model("main"), clock=clock))
    statuses = [(await post(gw)).status_code for _ in range(3)]
    redis_server.stop()
    statuses += [(await post(gw)).status_code for _ in range(5)]
    assert statuses == [200] * 3 + [200, 200, 429, 429, 429]  # then the local 4 / 2
    assert gw.metric("gateway_rate_limit_store_up", route="chat") == 0
    assert gw.metric("gateway_rate_limit_decisions_total", route="chat", store="local") == 5
    redis_server.start()
    clock.advance(1.0)
    await post(gw)  # starts the probe; decided locally
    rates = gw.gateway.registry.peek(RATE_LIMIT_REDIS)
    assert rates is not None
    await until(lambda: rates.up)
    assert (await post(gw)).status_code == 200  # a fresh Redis: a full bucket
    assert gw.metric("gateway_rate_limit_store_up", route="chat") == 1


async def test_a_memory_route_never_talks_to_redis(pipeline: Any):
    """``store: memory`` (the default) is the process's own limiter, whatever the cache."""
    closed = "redis://127.0.0.1:1/0"
    memory = policy(
        {"main": {"url": URL}}, {"rate_limit": {"requests_per_s": 1}}, cache={"redis_url": closed}
    )
    gw = await pipeline(memory, Model("main"))
    assert [(await post(gw)).status_code for _ in range(2)] == [200, 429]
    assert gw.gateway.registry.peek(RATE_LIMIT_REDIS) is None
    assert gw.gateway.registry.peek(REDIS_LINK) is None
    assert gw.metric("gateway_rate_limit_store_up", route="chat") is None
    assert gw.metric("gateway_redis_up", mode="standalone") is None


async def test_a_tokens_standing_is_told_from_redis_for_a_call_estimated_at_none(
    rates: RedisRates,
):
    """As the memory limiter tells it: a ``GET`` under a tokens limit learns its standing."""
    limit = RateLimit(tokens_per_min=600, store="redis")
    shared = SharedRateLimiter("chat", limit, rates)
    local = RateLimiter(RateLimit(tokens_per_min=600))
    tenant = uuid.uuid4().hex
    told = await shared.check(tenant, 0)
    assert told == local.check(tenant, 0)
    assert told.tokens is not None and told.tokens.remaining == 600
    await shared.check(tenant, 100)
    after = await shared.check(tenant, 0)  # asks none: takes none
    assert after.tokens is not None and 500 <= after.tokens.remaining < 501
    assert shared.decided == {"redis": 3, "local": 0}


async def test_the_admin_reads_many_tenants_standings_from_redis_in_their_order(
    pipeline: Any,
    redis_url: str,  # noqa: F811
):
    """``GET /tenants`` reads each tenant's standing in each limit from Redis,
    ``standings.MAX_READS`` at a time, and tells them in the policy's order."""
    import hashlib

    from gateway.resilience.standings import MAX_READS, tenant_standings

    count = 3 * MAX_READS
    names = [f"t{i:02d}" for i in range(count)]
    keys = [{"name": n, "sha256": hashlib.sha256(n.encode()).hexdigest()} for n in names]
    doc = shared_policy(redis_url, {"requests_per_s": 0.001, "burst": 10})
    doc["tenants"] = {"keys": keys}
    doc["tenants"]["keys"][5]["rate_limit"] = {
        "requests_per_s": 0.001,
        "burst": 4,
        "store": "redis",
    }
    gw = await pipeline(doc, Model("main"), clock=FakeClock())
    for i, name in enumerate(names[:8]):
        for _ in range(i % 4):
            assert (await post(gw, headers={"Authorization": f"Bearer {name}"})).status_code == 200
    told = await tenant_standings(gw.gateway.snapshot.policy, gw.gateway.registry)
    assert [t["name"] for t in told] == names
    left = [round(t["routes"]["chat"]["requests"]["remaining"]) for t in told]
    assert left == [10 - i % 4 for i in range(8)] + [10] * (count - 8)
    assert round(told[5]["own"]["requests"]["remaining"]) == 3  # its own limit: one call
    assert all(t["own"] is None for t in told if t["name"] != "t05")
