"""Per-tenant rate limits: token buckets for requests and model tokens, per second or minute
and per day, for the prompt's and the answer's tokens apart, and for what they cost.

A route's optional ``rate_limit`` gives each tenant its own buckets: requests
(``requests_per_s``, its ``burst``), model tokens (``tokens_per_min``), and a day's worth of
each (``requests_per_day``, ``tokens_per_day``: OpenAI's RPD and TPD), each a bucket that
holds the amount and refills continuously over its period.  ``check`` admits a request only
when every bucket can pay for it, else raises ``RateLimited`` (429) with the seconds until
they could.  Model tokens are known only after the answer, so ``check`` takes an estimate
and ``charge`` settles the difference; the token buckets may go into debt, which later
requests wait out.  A spend budget (``cost_per_day``, ``cost_per_month``) is a bucket of
the backends' ``price`` currency, estimated and settled as tokens are, at the price of the
backend that was asked and then of the one that answered; past it the 429 says
``insufficient_quota``.  Both tell the tenant's standing after them (``quota.py``: the
``x-ratelimit-*`` headers, the tightest bucket of each unit), a refusal too.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.policy.rate_limit import MONTH_DAYS, RateLimit
from gateway.resilience.quota import OverBudget, OverRate, Quota, Standing, tightest

DEFAULT_MAX_TENANTS = 10_000
"""Buckets kept at most; idle (full) buckets are dropped first when there are more."""
DAY_S = 86_400.0
REQUESTS, TOKENS, REQUESTS_DAY, TOKENS_DAY = "rq", "tk", "rd", "td"
INPUT_TOKENS, OUTPUT_TOKENS = "ti", "to"
COST_DAY, COST_MONTH = "cd", "cm"
"""The bucket kinds (each a key of its own in Redis)."""
UNIT_OF = {
    REQUESTS: "requests",
    REQUESTS_DAY: "requests",
    TOKENS: "tokens",
    TOKENS_DAY: "tokens",
    INPUT_TOKENS: "input_tokens",
    OUTPUT_TOKENS: "output_tokens",
    COST_DAY: "cost",
    COST_MONTH: "cost",
}
"""What each kind counts (``quota.UNITS``)."""


@dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket kind of a limit: ``capacity`` units, refilled at ``rate_per_s``."""

    kind: str
    rate_per_s: float
    capacity: float

    @property
    def unit(self) -> str:
        return UNIT_OF[self.kind]

    @property
    def tokens(self) -> bool:
        """Whether the answer settles it: it counts model tokens or their cost (else
        requests)."""
        return self.unit != "requests"

    def amount(self, tokens: float, output: float, cost: float = 0.0) -> float:
        """What a call of ``tokens`` model tokens, ``output`` of them generated, costing
        ``cost``, takes from this bucket (a request bucket: one)."""
        return {
            "requests": 1.0,
            "tokens": tokens,
            "input_tokens": tokens - output,
            "output_tokens": output,
            "cost": cost,
        }[self.unit]

    def standing(self, quota: Quota) -> Standing:
        """``quota`` as a standing of this bucket's unit."""
        return Standing(**{self.unit: quota})


def request_burst(limit: RateLimit) -> float:
    """The requests bucket's size: ``burst``, else one second of rate (at least 1)."""
    if limit.burst is not None:
        return limit.burst
    return max(1.0, limit.requests_per_s or 0.0)


def buckets_of(limit: RateLimit) -> tuple[Bucket, ...]:
    """The buckets ``limit`` gives each tenant."""
    found = []
    if limit.requests_per_s is not None:
        found.append(Bucket(REQUESTS, limit.requests_per_s, request_burst(limit)))
    if limit.tokens_per_min is not None:
        found.append(Bucket(TOKENS, limit.tokens_per_min / 60, limit.tokens_per_min))
    if limit.requests_per_day is not None:
        found.append(Bucket(REQUESTS_DAY, limit.requests_per_day / DAY_S, limit.requests_per_day))
    if limit.tokens_per_day is not None:
        found.append(Bucket(TOKENS_DAY, limit.tokens_per_day / DAY_S, limit.tokens_per_day))
    for kind, per_min in (
        (INPUT_TOKENS, limit.input_tokens_per_min),
        (OUTPUT_TOKENS, limit.output_tokens_per_min),
    ):
        if per_min is not None:
            found.append(Bucket(kind, per_min / 60, per_min))
    for kind, budget, days in (
        (COST_DAY, limit.cost_per_day, 1),
        (COST_MONTH, limit.cost_per_month, MONTH_DAYS),
    ):
        if budget is not None:
            found.append(Bucket(kind, budget / (days * DAY_S), budget))
    return tuple(found)


def scaled(limit: RateLimit, factor: float) -> RateLimit:
    """``limit`` with its rates and ``burst`` times ``factor``."""

    def times(value: float | None) -> float | None:
        return None if value is None else value * factor

    return dataclasses.replace(
        limit,
        requests_per_s=times(limit.requests_per_s),
        tokens_per_min=times(limit.tokens_per_min),
        requests_per_day=times(limit.requests_per_day),
        tokens_per_day=times(limit.tokens_per_day),
        input_tokens_per_min=times(limit.input_tokens_per_min),
        output_tokens_per_min=times(limit.output_tokens_per_min),
        cost_per_day=times(limit.cost_per_day),
        cost_per_month=times(limit.cost_per_month),
        burst=times(limit.burst),
    )


def refused(tenant: str, wait_s: float, standing: Standing, spent: bool) -> OverRate:
    """The 429 of a tenant that must wait ``wait_s``: ``OverBudget`` when a spend budget is
    what it waits for (``spent``)."""
    refusal = OverBudget if spent else OverRate
    over = "spend budget" if spent else "rate limit"
    return refusal(f"tenant {tenant!r} is over its {over}", max(1, math.ceil(wait_s)), standing)


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
    __slots__ = ("buckets",)

    def __init__(self, buckets: list[tuple[Bucket, TokenBucket]]) -> None:
        self.buckets = buckets

    def standing(self) -> Standing:
        """The tightest bucket of each unit (refilled by the caller)."""
        return tightest(kind.standing(bucket.quota()) for kind, bucket in self.buckets)


def _fullness(state: _Tenant) -> float:
    """How near full a tenant's emptiest bucket is (1: full; below 0: in debt)."""
    return min(bucket.level / bucket.capacity for _, bucket in state.buckets)


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
        self._kinds = buckets_of(limit)
        self.counts_tokens = any(kind.tokens for kind in self._kinds)
        """Whether it has a tokens bucket (so requests under it are estimated)."""
        self._clock = clock
        self._tenants: dict[str, _Tenant] = {}

    def check(self, tenant: str, tokens: float = 0, output: float = 0, cost: float = 0) -> Standing:
        """Admit one request of about ``tokens`` model tokens, ``output`` of them to be
        generated, costing about ``cost``, or raise ``RateLimited`` (its headers the
        tenant's standing); the standing after it."""
        now = self._clock.now()
        state = self._tenants.get(tenant) or self._add(tenant, now)
        paid: list[tuple[TokenBucket, float]] = []
        wait, spent = 0.0, False
        for kind, bucket in state.buckets:
            bucket.refill(now)
            amount = kind.amount(tokens, output, cost)
            if amount > 0:
                waits = bucket.wait_s(amount)
                spent = spent or (waits > 0 and kind.unit == "cost")
                wait = max(wait, waits)
                paid.append((bucket, amount))
        if wait > 0:
            self.rejected += 1
            raise refused(tenant, wait, state.standing(), spent)
        for bucket, amount in paid:
            bucket.level -= min(amount, bucket.capacity)
        return state.standing()

    def charge(
        self, tenant: str, tokens: float, output: float = 0, cost: float = 0
    ) -> Standing | None:
        """Settle a request's real token use against the estimate ``check`` took: pass the
        differences, of all its tokens, of those generated and of their cost (negative
        refunds).  The token and cost buckets may go into debt.  The standing after it
        (None for a tenant no longer kept)."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        now = self._clock.now()
        for kind, bucket in state.buckets:
            if kind.tokens:
                bucket.refill(now)
                taken = kind.amount(tokens, output, cost)
                bucket.level = min(bucket.capacity, bucket.level - taken)
        return state.standing()

    def standing(self, tenant: str) -> Standing | None:
        """``tenant``'s standing now, taking nothing (None: not kept, its buckets full)."""
        state = self._tenants.get(tenant)
        if state is None:
            return None
        now = self._clock.now()
        for _, bucket in state.buckets:
            bucket.refill(now)
        return state.standing()

    def _add(self, tenant: str, now: float) -> _Tenant:
        if len(self._tenants) >= self.max_tenants:
            self._prune(now)
        buckets = [(kind, TokenBucket(kind.rate_per_s, kind.capacity, now)) for kind in self._kinds]
        state = self._tenants[tenant] = _Tenant(buckets)
        return state

    def _prune(self, now: float) -> None:
        """Drop tenants whose buckets refilled (forgetting them loses nothing), then, if
        that was not enough, a tenth of the rest, the fullest first: forgetting a tenant
        refills its buckets, so the ones that spent the most (a day's requests) are kept
        longest, and a client cannot win back its day by flooding the limiter with new
        credentials."""
        for name, state in list(self._tenants.items()):
            for _, bucket in state.buckets:
                bucket.refill(now)
            if all(bucket.full for _, bucket in state.buckets):
                del self._tenants[name]
        if len(self._tenants) < self.max_tenants:
            return
        by_fullness = sorted(self._tenants.items(), key=lambda item: -_fullness(item[1]))
        for name, _ in by_fullness[: len(self._tenants) - self.max_tenants * 9 // 10 + 1]:
            del self._tenants[name]

    def __repr__(self) -> str:
        return f"<RateLimiter tenants={len(self._tenants)} rejected={self.rejected}>"
