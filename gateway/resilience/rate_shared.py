"""A route's ``rate_limit`` with ``store: redis``: one limit per tenant across every process
and replica, decided in Redis (``rate_redis.py``), else by this process's local share.

Each decision is one script call: the requests buckets (``requests_per_s`` with its
``burst``, ``requests_per_day``) and the tokens buckets (``tokens_per_min``,
``tokens_per_day``, ``input_tokens_per_min``, ``output_tokens_per_min``) and the spend
budgets (``cost_per_day``, ``cost_per_month``) for the tokens and cost the request is
estimated at (none asked of them when it is estimated at none, but their
standing told all the same), all paid or none, as in ``rate_limit.py``; the answer's
``usage`` settles the estimate with a second call (``charge``), as there.  A route without
``store: redis`` never talks to Redis.

While Redis cannot decide (down, slow past its budget, or answering with an error), each
process enforces its local share instead, the memory limiter of ``rate_limit.py`` over the
limit divided by ``replicas`` (rates and burst alike), so that the fleet stays near its limit;
the request itself never fails for it.  ``decided`` counts where decisions were made
(``gateway_rate_limit_decisions_total{route,store}``) and ``up`` tells which applies now
(``gateway_rate_limit_store_up{route}``).
"""

from __future__ import annotations

import dataclasses

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError
from gateway.metrics import Metrics
from gateway.metrics.collectors import RateLimitFigures
from gateway.policy.rate_limit import RateLimit
from gateway.policy.redis import Redis
from gateway.redis import shared_link
from gateway.resilience.quota import Quota, Standing, tightest
from gateway.resilience.rate_limit import (
    Bucket,
    RateLimiter,
    buckets_of,
    refused,
    request_burst,
    scaled,
)
from gateway.resilience.rate_redis import RedisRates, bucket_key
from gateway.state import Kind, Registry

RATE_LIMIT_REDIS: Kind[RedisRates] = Kind("rate-limit-redis")
SHARED_RATE_LIMITERS: Kind[SharedRateLimiter] = Kind("shared-rate-limit")
STORES = ("redis", "local")


def local_share(limit: RateLimit) -> RateLimit:
    """This process's part of ``limit`` while Redis is down: rates and burst over
    ``replicas``, in memory."""
    n = limit.replicas
    return dataclasses.replace(
        scaled(limit, 1 / n),
        burst=None if limit.requests_per_s is None else request_burst(limit) / n,
        store="memory",
        replicas=1,
    )


class SharedRateLimiter:
    """One route's limit, shared through ``rates``; see the module docstring."""

    def __init__(
        self, route: str, limit: RateLimit, rates: RedisRates, *, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.route = route
        self.limit = limit
        self.local = RateLimiter(local_share(limit), clock=clock)
        self.decided = dict.fromkeys(STORES, 0)
        self._rates = rates
        self._refused = 0
        self._buckets = buckets_of(limit)
        self.counts_tokens = any(bucket.tokens for bucket in self._buckets)

    @property
    def rejected(self) -> int:
        """Requests refused, in Redis and by the local share."""
        return self._refused + self.local.rejected

    @property
    def up(self) -> bool:
        """Whether decisions are being made in Redis."""
        return self._rates.up

    async def check(
        self, tenant: str, tokens: float = 0, output: float = 0, cost: float = 0
    ) -> Standing:
        """Admit one request of about ``tokens`` model tokens, ``output`` of them to be
        generated, costing about ``cost``, or raise ``RateLimited`` (its headers the
        tenant's standing); the standing after it."""
        # every bucket, a tokens one asked for none when no tokens are estimated: its
        # standing is told all the same, as the memory limiter tells it
        buckets = [(self._key(tenant, b), b, b.amount(tokens, output, cost)) for b in self._buckets]
        if self._rates.usable():
            try:
                wait, quotas = await self._rates.decide(buckets)
            except StoreError:
                pass  # decided locally, below
            else:
                self.decided["redis"] += 1
                standing = told(buckets, quotas)
                if wait > 0:
                    self._refused += 1
                    raise refused(tenant, wait, standing, short_of_budget(buckets, quotas))
                return standing
        self.decided["local"] += 1
        return self.local.check(tenant, tokens, output, cost)

    async def charge(
        self, tenant: str, tokens: float, output: float = 0, cost: float = 0
    ) -> Standing | None:
        """Settle a request's real token use against the estimate ``check`` took (the
        differences, of all its tokens, of those generated and of their cost; negative
        refunds), where decisions are being made now; the standing after it (None when
        nothing was settled)."""
        settled = [
            (self._key(tenant, b), b, b.amount(tokens, output, cost))
            for b in self._buckets
            if b.tokens
        ]
        if not any(amount for _, _, amount in settled):
            return None
        if self._rates.usable():
            try:
                return told(settled, await self._rates.settle(settled))
            except StoreError:
                pass
        return self.local.charge(tenant, tokens, output, cost)

    async def standing(self, tenant: str) -> Standing | None:
        """``tenant``'s standing now, taking nothing: Redis's, else the local share's
        (None: the local share does not know it)."""
        peek = [(self._key(tenant, b), b, 0.0) for b in self._buckets]
        if self._rates.usable():
            try:
                return told(peek, await self._rates.settle(peek))
            except StoreError:
                pass
        return self.local.standing(tenant)

    def figures(self) -> RateLimitFigures:
        return RateLimitFigures(self.route, self.up, dict(self.decided))

    def _key(self, tenant: str, bucket: Bucket) -> str:
        return bucket_key(self._rates.prefix, self.route, tenant, bucket.kind)

    def __repr__(self) -> str:
        where = "redis" if self.up else "local"
        counts = " ".join(f"{store}={n}" for store, n in self.decided.items())
        return f"<SharedRateLimiter {self.route} {where} {counts} rejected={self.rejected}>"


def told(buckets: list[tuple[str, Bucket, float]], quotas: list[Quota]) -> Standing:
    """The tightest of each unit among ``buckets``' ``quotas``."""
    return tightest(b.standing(q) for (_, b, _), q in zip(buckets, quotas, strict=True))


def short_of_budget(buckets: list[tuple[str, Bucket, float]], quotas: list[Quota]) -> bool:
    """Whether a spend budget among ``buckets`` could not pay its amount (a refusal's
    standings, as they were)."""
    return any(
        b.unit == "cost" and min(amount, b.capacity) > q.remaining
        for (_, b, amount), q in zip(buckets, quotas, strict=True)
    )


def shared_limiter(
    registry: Registry,
    route: str,
    limit: RateLimit,
    redis: Redis,
    clock: Clock,
    metrics: Metrics,
) -> SharedRateLimiter:
    """The route's limiter on the gateway's Redis (``redis:``, its one ``RedisLink``), kept
    across reloads while the limit and the Redis settings are unchanged."""
    link = shared_link(registry, redis, clock, metrics)
    rates = registry.get(RATE_LIMIT_REDIS, "", redis, lambda: RedisRates(link))
    return registry.get(
        SHARED_RATE_LIMITERS,
        route,
        (limit, redis),
        lambda: SharedRateLimiter(route, limit, rates, clock=clock),
    )
