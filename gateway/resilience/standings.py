"""Where each named tenant stands in its rate limits and budgets, for the admin's
``GET /tenants``: LiteLLM's ``/key/info``, told from the gateway's own buckets.

For each tenant of ``tenants.keys``: its own limit (``keys[].rate_limit``) and each route's
per-tenant ``rate_limit`` it is counted under (by its name), each as the quotas of its
bucket kinds (``requests``, ``tokens``, ``input_tokens``, ``output_tokens``, ``cost``):
the bucket's size, what it holds now (below zero in debt) and the seconds until it is full.
A bucket no call has touched yet, or one forgotten since (full again), is told full.  With
``store: redis`` it is read from Redis, every replica's count (else this process's share),
``MAX_READS`` at a time: a thousand tenants under two limits are 2,000 round trips (one
after another, 0.6-0.7 s on a local Redis; 0.38-0.48 s so; more where each crosses a
network).  Nothing is taken: reading the standing spends no
budget.
"""

from __future__ import annotations

import asyncio
from typing import Any

from gateway.policy.model import Policy, RateLimit
from gateway.resilience.credentials import TENANT_PREFIX
from gateway.resilience.quota import UNITS, Quota, Standing, tightest
from gateway.resilience.rate_limit import buckets_of
from gateway.resilience.rate_shared import SHARED_RATE_LIMITERS
from gateway.resilience.rates import RATE_LIMITERS
from gateway.state import Kind, Registry


class Standings:
    """The named tenants' standings over the limiters in ``registry``."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def told(self, policy: Policy) -> list[dict[str, Any]]:
        return await tenant_standings(policy, self._registry)


STANDINGS: Kind[Standings] = Kind("tenant-standings")
MAX_READS = 16
"""The standings read from Redis at once (the pool's connections are shared with traffic)."""


async def tenant_standings(policy: Policy, registry: Registry) -> list[dict[str, Any]]:
    """Each named tenant's standing in its own limit and in each route's, by name."""
    own = policy.tenants.limits()
    routes = {r.name: r.rate_limit for r in policy.routes if r.rate_limit is not None}
    names = dict.fromkeys(key.name for key in policy.tenants.keys)
    reads = asyncio.Semaphore(MAX_READS)

    async def read(limiter_name: str, limit: RateLimit, key: str) -> dict[str, Any]:
        async with reads:
            return await _standing(registry, limiter_name, limit, key)

    async def entry(name: str) -> dict[str, Any]:
        key = TENANT_PREFIX + name
        limit = own.get(name)
        jobs = [read(r, rate, key) for r, rate in routes.items()]
        if limit is not None:
            jobs.append(read(key, limit, key))
        found = await asyncio.gather(*jobs)
        mine = found.pop() if limit is not None else None
        return {"name": name, "own": mine, "routes": dict(zip(routes, found, strict=True))}

    return list(await asyncio.gather(*(entry(name) for name in names)))


async def _standing(
    registry: Registry, limiter_name: str, limit: RateLimit, key: str
) -> dict[str, Any]:
    standing: Standing | None = None
    if limit.store == "redis":
        shared = registry.peek(SHARED_RATE_LIMITERS, limiter_name)
        if shared is not None:
            standing = await shared.standing(key)
    else:
        local = registry.peek(RATE_LIMITERS, limiter_name)
        if local is not None:
            standing = local.standing(key)
    if standing is None:  # untouched or forgotten: full
        standing = tightest(
            b.standing(Quota(b.capacity, b.capacity, 0.0)) for b in buckets_of(limit)
        )
    return {unit: _quota(q) for unit in UNITS if (q := getattr(standing, unit)) is not None}


def _quota(quota: Quota) -> dict[str, float]:
    return {
        "limit": quota.limit,
        "remaining": round(quota.remaining, 6),
        "reset_s": round(quota.reset_s, 3),
    }
