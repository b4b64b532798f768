"""A day's requests and tokens (``rate_limit.requests_per_day``, ``tokens_per_day``:
OpenAI's RPD and TPD): a bucket holding a day's worth beside the per-second and per-minute
ones, in memory and in a real Redis, its standing told when it is the tighter."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.policy import parse_policy_text
from gateway.policy.model import RateLimit, Redis
from gateway.resilience.credentials import newcomer_limit
from gateway.resilience.quota import OverRate
from gateway.resilience.rate_limit import DAY_S, RateLimiter
from gateway.resilience.rate_redis import RedisRates
from gateway.resilience.rate_shared import SharedRateLimiter, local_share
from gateway.testing import FakeClock
from tests.backends import Model, post
from tests.helpers import policy
from tests.redis_cluster import admin_client
from tests.test_rate_headers import ALICE, URL, told

HOUR_S = 3600.0


def test_a_days_requests_run_out_before_the_per_second_bucket_and_refill_over_the_day():
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(requests_per_s=100, requests_per_day=3), clock=clock)
    standings = [limiter.check("acme") for _ in range(3)]
    assert [s.requests.remaining for s in standings if s.requests] == [2, 1, 0]  # the day's
    with pytest.raises(OverRate) as refused:
        limiter.check("acme")
    assert refused.value.retry_after_s == DAY_S / 3  # one request back every 8 hours
    assert dict(refused.value.extra_headers)["x-ratelimit-reset-requests"] == "24h0m0s"
    assert limiter.check("globex").requests is not None  # its own day
    clock.advance(DAY_S / 3)
    limiter.check("acme")
    with pytest.raises(OverRate):
        limiter.check("acme")


def test_a_tenant_that_spent_its_day_is_kept_through_a_flood_of_new_credentials():
    """Forgetting a tenant refills its buckets: with too many to keep, the fullest go first,
    so churning through new credentials cannot win a client back its day."""
    clock = FakeClock()
    limit = RateLimit(requests_per_s=100, requests_per_day=3)
    limiter = RateLimiter(limit, clock=clock, max_tenants=100)
    for _ in range(3):
        limiter.check("spender")
    for n in range(1000):
        limiter.check(f"invented-{n}")
    assert limiter.standing("spender") is not None  # still kept; an early newcomer is not
    assert limiter.standing("invented-0") is None
    with pytest.raises(OverRate):
        limiter.check("spender")


def test_a_days_tokens_are_settled_on_usage_with_the_minutes():
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(tokens_per_min=1000, tokens_per_day=1200), clock=clock)
    limiter.check("acme", tokens=100)
    after = limiter.charge("acme", 400)  # used 500: both buckets settled
    assert after is not None and after.tokens is not None
    assert (after.tokens.limit, after.tokens.remaining) == (1000, 500)  # the minute's: tighter
    clock.advance(60)  # the minute's bucket is full again; the day's has 700 and a little
    standing = limiter.check("acme", tokens=600)
    assert standing.tokens is not None and standing.tokens.limit == 1200  # now the day's
    assert standing.tokens.remaining == pytest.approx(1200 - 500 - 600 + 60 * 1200 / DAY_S)
    with pytest.raises(OverRate) as refused:  # the minute would pay in 6 s; the day cannot
        limiter.check("acme", tokens=500)
    assert (refused.value.retry_after_s or 0) > 7 * HOUR_S


def test_the_local_share_and_a_newcomers_budget_scale_a_days_amounts():
    limit = RateLimit(requests_per_day=1000, tokens_per_day=10**6, store="redis", replicas=4)
    share = local_share(limit)
    assert (share.requests_per_day, share.tokens_per_day) == (250, 250_000)
    assert share.burst is None and share.store == "memory"
    doubled = newcomer_limit(RateLimit(requests_per_day=10, tokens_per_min=600))
    assert (doubled.requests_per_day, doubled.tokens_per_min) == (20, 1200)


def test_a_days_amount_must_be_positive_and_alone_is_a_limit():
    def route(limit: dict[str, Any]) -> str:
        return yaml.safe_dump(policy({"main": {"url": URL}}, {"rate_limit": limit}))

    parsed = parse_policy_text(route({"tokens_per_day": 50_000, "store": "redis"}))
    assert parsed.routes[0].rate_limit == RateLimit(tokens_per_day=50_000, store="redis")
    with pytest.raises(PolicyError, match="requests_per_day: must be greater than 0"):
        parse_policy_text(route({"requests_per_day": 0}))


async def test_a_429_for_the_day_tells_its_reset_through_the_gateway(pipeline):
    clock = FakeClock()
    route = {"rate_limit": {"requests_per_s": 10, "requests_per_day": 2}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), Model("main"), clock=clock)
    answers = [await post(gw, headers=ALICE) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert answers[2].headers["Retry-After"] == str(int(DAY_S / 2))
    assert told(answers[2]) == {
        "x-ratelimit-limit-requests": "2",
        "x-ratelimit-remaining-requests": "0",
        "x-ratelimit-reset-requests": "24h0m0s",
    }
    clock.advance(DAY_S / 2)
    assert (await post(gw, headers=ALICE)).status_code == 200


# -- in Redis ----------------------------------------------------------------------------


@pytest.fixture
async def rates(redis_target: Redis) -> AsyncIterator[RedisRates]:
    made = RedisRates.connect(redis_target, budget_s=1.0, prefix=f"gw:rl:test-{uuid.uuid4()}:")
    yield made
    await made.aclose()


@pytest.mark.redis
async def test_a_day_is_one_more_key_in_redis_decided_in_the_same_script_call(
    rates: RedisRates, redis_target: Redis
):
    limit = RateLimit(requests_per_s=100, requests_per_day=2, tokens_per_day=1000, store="redis")
    limiter = SharedRateLimiter("chat", limit, rates)
    await limiter.check("acme", tokens=100)
    settled = await limiter.charge("acme", 200)
    assert settled is not None and settled.tokens is not None
    assert settled.tokens.limit == 1000 and 699 <= settled.tokens.remaining <= 701
    standing = await limiter.check("acme", tokens=100)
    assert standing.requests is not None and standing.requests.remaining < 0.01  # the day's
    with pytest.raises(OverRate) as refused:
        await limiter.check("acme", tokens=100)
    assert (refused.value.retry_after_s or 0) >= DAY_S / 2 - 1
    assert limiter.decided == {"redis": 3, "local": 0}
    admin = admin_client(redis_target)
    try:
        tag = "{chat:acme}"
        for kind in ("rd", "td"):  # a day's TAT ahead: 2 of 2 requests, 400 of 1000 tokens
            ttl = await admin.pttl(f"{rates.prefix}{tag}:{kind}")
            assert 0 < ttl <= DAY_S * 1000, kind
    finally:
        await admin.aclose()
