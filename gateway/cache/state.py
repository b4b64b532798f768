"""The cache's long-lived state: the one store every caching route shares.

``CacheState`` holds the store the policy's ``cache:`` block names (memory LRU bounded by
``max_bytes``, or Redis over the gateway's ``RedisLink``, ``redis:``), the tenant scope
rule, and a background sweep of expired memory entries.  It lives in the runtime registry
as ``CACHE_STATE`` with the ``cache:`` block (and, for Redis, the ``redis:`` section) as its
settings, so reloads keep it, and its entries, until those change.  The admin's
``POST /cache/purge`` finds it there.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping

from gateway.cache.control import LearnedVary
from gateway.cache.stores import MemoryStore, RedisStore, StoreStats
from gateway.clock import Clock
from gateway.policy.model import DEFAULT_FEEDBACK_PER_MIN
from gateway.policy.model import CacheStore as CacheStoreSettings
from gateway.policy.rate_limit import RateLimit
from gateway.redis import RedisLink
from gateway.resilience.rate_limit import RateLimiter
from gateway.state import Kind, Registry
from gateway.tenant import scope_hash

log = logging.getLogger("gateway.cache")

SWEEP_INTERVAL_S = 30.0
"""How often expired memory entries are dropped, so the entry and byte gauges stay true."""


class CacheState:
    """The store and tenant-scope rule shared by every caching route."""

    def __init__(
        self,
        settings: CacheStoreSettings,
        clock: Clock,
        on_health: Callable[[bool], None] | None = None,
        link: RedisLink | None = None,
    ) -> None:
        self.settings = settings
        self.store: MemoryStore | RedisStore
        if settings.store == "redis":
            if link is None:
                raise ValueError("the redis cache store needs the gateway's RedisLink")
            self.store = RedisStore(link, on_health=on_health)
        else:
            self.store = MemoryStore(settings.max_bytes, clock=clock)
        self._sweeper: asyncio.Task[None] | None = None
        self._vary: dict[str, LearnedVary] = {}
        self.judged_right: OrderedDict[bytes, None] = OrderedDict()  # feedback.py

    @property
    def kind(self) -> str:
        return self.settings.store

    def tenant_scope(self, tenant: str | Mapping[str, str]) -> str:
        """The scope hash of a tenant named by a mapping of scope header to value (the
        headers it sends, those it does not left out), or by one raw value: that of the only
        scope header, else of ``Authorization`` (a client that sends no other credential);
        ``ValueError`` if ambiguous."""
        names = self.settings.scope_headers
        if isinstance(tenant, str):
            lowered = [n.lower() for n in names]
            if len(names) == 1:
                return scope_hash([(names[0], tenant)], names)
            if "authorization" in lowered:
                return scope_hash([("authorization", tenant)], names)
            raise ValueError(
                f"the scope has {len(names)} headers ({', '.join(names) or 'none'}): "
                "give the tenant as an object of header: value, or give `scope`"
            )
        unknown = {k.lower() for k in tenant} - {n.lower() for n in names}
        if unknown:
            raise ValueError(f"not scope headers: {', '.join(sorted(unknown))}")
        return scope_hash(tenant.items(), names)

    def vary(self, route: str) -> LearnedVary:
        """The headers ``route``'s answers vary on, as learned so far (kept across reloads
        with the store, whose entries were keyed by them)."""
        learned = self._vary.get(route)
        if learned is None:
            learned = self._vary[route] = LearnedVary(self.settings.scope_headers)
        return learned

    def stats(self) -> StoreStats:
        stats: StoreStats = self.store.stats()
        return stats

    def start(self) -> None:
        """Start the periodic sweep of a memory store (idempotent; on the running loop, by
        ``Registry.start``)."""
        if self._sweeper is None and isinstance(self.store, MemoryStore):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep(self.store))

    @staticmethod
    async def _sweep(store: MemoryStore) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            store.sweep()

    async def purge(
        self,
        *,
        backend: str | None = None,
        model_version: str | None = None,
        scope: str | None = None,
    ) -> int:
        """Delete matching entries (every entry without filters); raises ``StoreError``."""
        purged: int = await self.store.purge(
            backend=backend, model_version=model_version, scope=scope
        )
        log.info(
            "cache purge backend=%s model_version=%s scope=%s: %d entries",
            backend,
            model_version,
            scope,
            purged,
        )
        return purged

    async def aclose(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
        await self.store.close()

    def __repr__(self) -> str:
        return f"<CacheState {self.store!r} scope_headers={list(self.settings.scope_headers)}>"


CACHE_STATE: Kind[CacheState] = Kind("cache-store")
"""The registry's one cache state (name ``""``)."""


def store_settings(settings: CacheStoreSettings) -> CacheStoreSettings:
    """The ``cache:`` settings the store is kept under across reloads: all but the
    feedback's rate, which changes no entry."""
    return dataclasses.replace(settings, feedback_per_min=DEFAULT_FEEDBACK_PER_MIN)


FEEDBACK_LIMITS: Kind[RateLimiter] = Kind("cache-feedback-limits")
"""Each caller scope's verdicts (``cache.feedback_per_min``), kept across reloads while
the rate is unchanged."""


def feedback_limits(registry: Registry, per_min: float, clock: Clock) -> RateLimiter:
    """The limiter of ``POST /cache/feedback``: ``per_min`` a minute, a minute's worth at
    once, per caller scope (a bounded number of scopes kept, as every rate limit's)."""
    limit = RateLimit(requests_per_s=per_min / 60, burst=max(1.0, per_min))
    return registry.get(FEEDBACK_LIMITS, "", per_min, lambda: RateLimiter(limit, clock=clock))
