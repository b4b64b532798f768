"""Per-tenant rate limits: token buckets for requests per second and model tokens per minute.

A route's optional ``rate_limit: {requests_per_s, tokens_per_min}`` gives each tenant its own
pair of buckets.  ``check`` admits a request only when both buckets can pay for it, else
raises ``RateLimited`` (429) with the seconds until they could.  Model tokens are known only
after the answer, so ``check`` takes an estimate and ``charge`` settles the difference; the
token bucket may go into debt, which later requests wait out.  Both tell the tenant's
standing after them (``quota.py``: the ``x-ratelimit-*`` headers), a refusal too.
"""

from __future__ import annotations

import math

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.policy.route import RateLimit
from gateway.resilience.quota import OverRate, Quota, Standing

DEFAULT_MAX_TENANTS = 10_000
"""Buckets kept at most; idle (full) buckets are dropped first when there are more."""


def request_burst(limit: RateLimit) -> float:
    """The requests bucket's size: ``burst``, else one second of rate (at least 1)."""
    if limit.burst is not None:
        return limit.burst
    return max(1.0, limit.requests_per_s or 0.0)


class TokenBucket:
    """Holds up to ``capacity``, refilled at ``rate_per_s``; ``level`` may go below zero."""

    __slots__ = ("capacity", "level", "rate_per_s", "updated")

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        self.rate_per_s = rate_per_s
        self.capacity = capacity
        self.level = capacity
        self.updated = now

    def refill(self, now: float) -> None:
        if now > self.updated:
            self.level = min(self.capacity, self.level + (now - self.updated) * self.rate_per_s)
            self.updated = now

    def wait_s(self, amount: float) -> float:
        """Seconds until ``amount`` is available (0 if it is now); call ``refill`` first."""
        amount = min(amount, self.capacity)
        return max(0.0, (amount - self.level) / self.rate_per_s)

    @property
    def full(self) -> bool:
        return self.level >= self.capacity

    def quota(self) -> Quota:
        """Its standing now (call ``refill`` first)."""
        return Quota.of(self.capacity, self.level, self.rate_per_s)

    def __repr__(self) -> str:
        return f"<TokenBucket {self.level:.1f}/{self.capacity:g} +{self.rate_per_s:g}/s>"


class _Tenant:
    __slots__ = ("requests", "tokens")

    def __init__(self, requests: TokenBucket | None, tokens: TokenBucket | None) -> None:
        self.requests = requests
        self.tokens = tokens

    def standing(self) -> Standing:
        """Both buckets' standing (refilled by the caller)."""
        return Standing(
            None if self.requests is None else self.requests.quota(),
            None if self.tokens is None else self.tokens.quota(),
        )


class RateLimiter:
    """The buckets of every tenant under one ``RateLimit``."""

    def __init__(
        self,
        limit: RateLimit,
        *,
        clock: Clock = SYSTEM_CLOCK,
        max_tenants: int = DEFAULT_MAX_TENANTS,
    ) -> None:
        self.limit = limit
        self.max_tenants = max_tenants
        self.rejected = 0
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def check(self, tenant: str, tokens: float = 0) -> Standing:
        """Admit one request of about ``tokens`` model tokens, or raise ``RateLimited``
        (its headers the tenant's standing); the standing after it."""
        now = self._clock.now()
        state = self._tenants.get(tenant) or self._add(tenant, now)
        wait = 0.0
        if state.requests is not None:
            state.requests.refill(now)
            wait = state.requests.wait_s(1)
        if state.tokens is not None:
            state.tokens.refill(now)
            if tokens > 0:
                wait = max(wait, state.tokens.wait_s(tokens))
        if wait > 0:
            self.rejected += 1
            raise OverRate(
                f"tenant {tenant!r} is over its rate limit",
                float(max(1, math.ceil(wait))),
                state.standing(),
            )
        if state.requests is not None:
            state.requests.level -= 1
        if state.tokens is not None and tokens > 0:
            state.tokens.level -= min(tokens, state.tokens.capacity)
        return state.standing()

    def charge(self, tenant: str, tokens: float) -> Standing | None:
        """Settle a request's real token use against the estimate ``check`` took: pass the
        difference (negative refunds).  The bucket may go into debt.  The standing after
        it (None for a tenant no longer kept)."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        if state.tokens is not None:
            state.tokens.refill(self._clock.now())
            state.tokens.level = min(state.tokens.capacity, state.tokens.level - tokens)
        return state.standing()

    def _add(self, tenant: str, now: float) -> _Tenant:
        if len(self._tenants) >= self.max_tenants:
            self._prune(now)
        limit = self.limit
        requests = tokens = None
        if limit.requests_per_s is not None:
            requests = TokenBucket(limit.requests_per_s, request_burst(limit), now)
        if limit.tokens_per_min is not None:
            tokens = TokenBucket(limit.tokens_per_min / 60, limit.tokens_per_min, now)
        state = self._tenants[tenant] = _Tenant(requests, tokens)
        return state

    def _prune(self, now: float) -> None:
        """Drop tenants whose buckets refilled (forgetting them loses nothing), then the
        oldest if that was not enough."""
        for name, state in list(self._tenants.items()):
            buckets = [b for b in (state.requests, state.tokens) if b is not None]
            for bucket in buckets:
                bucket.refill(now)
            if all(b.full for b in buckets):
                del self._tenants[name]
        while len(self._tenants) >= self.max_tenants:
            del self._tenants[next(iter(self._tenants))]

    def __repr__(self) -> str:
        return f"<RateLimiter tenants={len(self._tenants)} rejected={self.rejected}>"
