"""The gateway's one ``RedisLink``, kept in the registry for every user of the policy's
``redis:`` section: one client (one connection pool, one Cluster slot map), one health.

The cache store, the ``store: redis`` rate limits and the fleet's rate history each ask
for it while their stage is built; it is kept across reloads while ``redis:`` is unchanged,
and closed by the registry once a policy no longer uses Redis.
"""

from __future__ import annotations

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.policy.redis import Redis
from gateway.redis.link import RedisLink
from gateway.state import Kind, Registry

REDIS_LINK: Kind[RedisLink] = Kind("redis")
"""The registry's one link (name ``""``), its settings the ``redis:`` section."""


def shared_link(registry: Registry, settings: Redis, clock: Clock, metrics: Metrics) -> RedisLink:
    """The gateway's link to the Redis of ``settings``, made on first use; its figures are
    what ``gateway_redis_*`` report."""
    link = registry.get(REDIS_LINK, "", settings, lambda: RedisLink.connect(settings, clock=clock))
    metrics.redis.links = lambda: [item.figures() for _, item in registry.items(REDIS_LINK)]
    return link
