"""The fleet's request-rate history in Redis, so that every replica forecasts from all of
the route's traffic, not its own share of it.

With the top-level cache store ``redis``, each route with ``prewarm`` keeps its per-minute
counts in one Redis hash, ``<prefix>rate:<route>``: a field per wall-clock minute since the
epoch, its value the requests of that minute summed over the replicas (``HINCRBY``).  Once
a minute (and at start) each replica, in one pipeline, adds the counts of the minutes it
finished since its last flush, deletes the fields that fell out of the history (a week),
and reads the hash back (``HGETALL``, only while it holds no more fields than a history
can: a hash flooded by someone else is not read whole every minute); the forecast and the best
minute then come from the fleet's counts (``RouteRate.use_fleet``).  Both scale with the
fleet, so the desired endpoints, their ratio, do not double-count.

Redis is the Redis layer's (``gateway/redis/``, the gateway's one ``RedisLink``): down,
slow (past ``TIMEOUT_S``) or answering garbage, the counts not flushed stay owed and go
with the next flush (as far back as the local history reaches), the forecast falls back to
this replica's own history once the fleet's is more than ``FLEET_STALE_MIN`` minutes old,
and nothing on the request path ever waits for Redis.  A flush that timed out
(``StoreTimeout``) is taken as done: ``HINCRBY`` may have run, and sending it again would
count those minutes twice.  Every command of a sync names the route's one hash, so on a
Cluster a sync is one master's.  Fields that are not a minute, values
that are not a count, and minutes ahead of now are ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError, StoreTimeout
from gateway.pool.forecast import MINUTE_S, WEEK_MIN, RouteRate
from gateway.redis import RedisLink

log = logging.getLogger("gateway.pool")

TIMEOUT_S = 2.0
"""How long one sync's command may take before it is abandoned (it is off the request path)."""
KEY_PREFIX = "gw:rate:"
MAX_STALE_FIELDS = 1024
"""Old fields deleted per sync (a long-stopped fleet's leftovers go over a few syncs)."""


class SharedHistory:
    """Syncs one route's ``RouteRate`` with the fleet's counts in Redis, once a minute."""

    def __init__(
        self,
        route: str,
        rate: RouteRate,
        link: RedisLink,
        *,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
        max_minutes: int = WEEK_MIN,
    ) -> None:
        self.route = route
        self.key = KEY_PREFIX + route
        self.rate = rate
        self.errors = 0
        self.syncs = 0
        self._link = link
        self._clock = clock
        self._sleep = sleep or getattr(clock, "sleep", None) or asyncio.sleep
        self._max_minutes = max_minutes
        self._flushed = -1  # the last minute whose count was sent
        self._stale: list[bytes] = []
        self._task: asyncio.Task[None] | None = None
        self._one = asyncio.Lock()  # one sync at a time: see ``sync``

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.sync()
            into_minute = self._clock.wall() % MINUTE_S
            await self._sleep(MINUTE_S - into_minute + 1)  # just after the next minute ends

    async def sync(self) -> bool:
        """Flush the finished minutes, read the fleet's back; False when Redis failed.

        Syncs run one at a time: two at once would both send the minutes owed (counting
        them twice), and the one that read the hash first could apply its older counts last.
        """
        async with self._one:
            return await self._sync()

    async def _sync(self) -> bool:
        counts, first = self.rate.history.complete()
        last = first + len(counts) - 1
        owed = {first + i: n for i, n in enumerate(counts) if first + i > self._flushed and n > 0}

        async def flush() -> int:
            pipe = self._link.client.pipeline(transaction=False)
            for minute, n in owed.items():
                pipe.hincrby(self.key, str(minute), n)
            if self._stale:
                pipe.hdel(self.key, *self._stale)
            pipe.expire(self.key, (self._max_minutes + 60) * MINUTE_S)
            pipe.hlen(self.key)
            return int((await pipe.execute())[-1])

        try:
            fields = await self._link.run("rate history", flush, TIMEOUT_S)
        except StoreTimeout as exc:
            self._flushed = max(self._flushed, last)  # it may have run: never count twice
            return self._failed(str(exc))
        except StoreError as exc:
            return self._failed(str(exc))
        self._flushed = max(self._flushed, last)
        if fields > self._max_minutes + MAX_STALE_FIELDS:
            return self._failed(
                f"hash {self.key} has {fields} fields, more than a history holds: not "
                "read (it is not this gateway's writing; delete it)"
            )
        try:
            raw = await self._link.run(
                "rate history", lambda: self._link.client.hgetall(self.key), TIMEOUT_S
            )
        except StoreError as exc:
            return self._failed(str(exc))
        fleet, self._stale = parse(raw, last - self._max_minutes + 1, last)
        if fleet:
            start = min(fleet)
            self.rate.use_fleet([fleet.get(m, 0) for m in range(start, last + 1)], start)
        self.syncs += 1
        return True

    def _failed(self, why: str) -> bool:
        self.errors += 1
        log.warning("rate history of route %s: %s (using this replica's)", self.route, why)
        return False

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def __repr__(self) -> str:
        return (
            f"<SharedHistory {self.route} flushed={self._flushed} syncs={self.syncs} "
            f"errors={self.errors}>"
        )


def parse(raw: Mapping[Any, Any], oldest: int, last: int) -> tuple[dict[int, int], list[bytes]]:
    """The counts of minutes ``oldest..last`` in a hash as Redis returned it, and the fields
    older than ``oldest`` (to delete); anything that is not a minute and a count is ignored."""
    fleet: dict[int, int] = {}
    stale: list[bytes] = []
    for field, value in raw.items():
        try:
            minute, n = int(field), int(value)
        except (TypeError, ValueError):
            continue
        if minute < oldest:
            if len(stale) < MAX_STALE_FIELDS:
                stale.append(field if isinstance(field, bytes) else str(field).encode())
        elif minute <= last and n > 0:
            fleet[minute] = n
    return fleet, stale
