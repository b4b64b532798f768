"""Per-tenant rate limits: requests per second and model tokens per minute."""

from __future__ import annotations

import pytest

from gateway.errors import RateLimited
from gateway.policy.model import RateLimit
from gateway.resilience.rate_limit import RateLimiter
from gateway.testing import FakeClock


def test_requests_beyond_the_rate_are_refused_with_retry_after_until_refilled() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(requests_per_s=2), clock=clock)
    limiter.check("acme")
    limiter.check("acme")
    with pytest.raises(RateLimited) as caught:
        limiter.check("acme")
    assert caught.value.status == 429
    assert caught.value.retry_after_s == 1.0
    clock.advance(0.5)
    limiter.check("acme")
    with pytest.raises(RateLimited):
        limiter.check("acme")


def test_each_tenant_has_its_own_buckets() -> None:
    limiter = RateLimiter(RateLimit(requests_per_s=1), clock=FakeClock())
    limiter.check("acme")
    limiter.check("globex")
    with pytest.raises(RateLimited):
        limiter.check("acme")


def test_a_request_over_the_token_rate_waits_for_enough_tokens() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(tokens_per_min=600), clock=clock)  # 10 tokens/s
    limiter.check("acme", tokens=500)
    with pytest.raises(RateLimited) as caught:
        limiter.check("acme", tokens=200)
    assert caught.value.retry_after_s == 10.0  # 100 left, 100 more at 10/s
    clock.advance(10)
    limiter.check("acme", tokens=200)


def test_charging_real_usage_puts_the_tenant_in_debt() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(tokens_per_min=600), clock=clock)
    limiter.check("acme", tokens=100)
    limiter.charge("acme", 1000)  # the answer was far longer than estimated
    with pytest.raises(RateLimited) as caught:
        limiter.check("acme", tokens=1)
    assert caught.value.retry_after_s == 51.0  # from -500 back to 1 token at 10/s
    limiter.charge("acme", -10_000)  # refunds never lift a bucket above its capacity
    limiter.check("acme", tokens=600)


def test_a_request_larger_than_the_bucket_is_admitted_when_the_bucket_is_full() -> None:
    limiter = RateLimiter(RateLimit(tokens_per_min=100), clock=FakeClock())
    limiter.check("acme", tokens=5000)
    with pytest.raises(RateLimited):
        limiter.check("acme", tokens=1)


def test_both_limits_must_allow_a_request_and_a_refusal_takes_nothing() -> None:
    limiter = RateLimiter(RateLimit(requests_per_s=5, tokens_per_min=60), clock=FakeClock())
    limiter.check("acme", tokens=60)
    for _ in range(3):
        with pytest.raises(RateLimited):
            limiter.check("acme", tokens=10)
    limiter.check("acme")  # requests were not spent by the refusals
    assert repr(limiter) == "<RateLimiter tenants=1 rejected=3>"


def test_idle_tenants_are_forgotten_first_when_there_are_too_many() -> None:
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(requests_per_s=1), clock=clock, max_tenants=2)
    limiter.check("idle")
    clock.advance(5)
    limiter.check("busy")
    limiter.check("new")
    with pytest.raises(RateLimited):
        limiter.check("busy")  # still remembered: its bucket is empty
