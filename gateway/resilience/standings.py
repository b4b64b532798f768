"""Where each named tenant stands in its rate limits and budgets, for the admin's
``GET /tenants``: LiteLLM's ``/key/info``, told from the gateway's own buckets.

For each tenant of ``tenants.keys``: its own limit (``keys[].rate_limit``) and each route's
per-tenant ``rate_limit`` it is counted under (by its name), each as the quotas of its
bucket kinds (``requests``, ``tokens``, ``input_tokens``, ``output_tokens``, ``cost``):
the bucket's size, what it holds now (below zero in debt) and the seconds until it is full.
A bucket no call has touched yet, or one forgotten since (full again), is told full.  With
``store: redis`` it is read from Redis, every replica's count (else this process's share).
Nothing is taken: reading the standing spends no budget.
"""

from __future__ import annotations

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


async def tenant_standings(policy: Policy, registry: Registry) -> list[dict[str, Any]]:
    """Each named tenant's standing in its own limit and in each route's, by name."""
    own = policy.tenants.limits()
    routes = {r.name: r.rate_limit for r in policy.routes if r.rate_limit is not None}
    names = dict.fromkeys(key.name for key in policy.tenants.keys)
    told = []
    for name in names:
        key = TENANT_PREFIX + name
        limit = own.get(name)
        entry: dict[str, Any] = {
            "name": name,
            "own": None if limit is None else await _standing(registry, key, limit, key),
            "routes": {
                route: await _standing(registry, route, rate, key) for route, rate in routes.items()
            },
        }
        told.append(entry)
    return told


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
