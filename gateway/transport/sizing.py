"""ModelPool sizing: which of a backend's endpoints take traffic (``pool:`` on a backend).

The first ``core`` endpoints are always in rotation.  The others are *standby*: when the
requests in flight per endpoint in rotation reach ``scale_up_inflight`` (or requests wait
for a connection), the next standby endpoint is *warming*: its ``warmup`` requests are sent
(off the request path) and only once they answered below 500 does it join the rotation, so
no user request pays its cold start.  An endpoint brought in that has had no request for
``idle_timeout_s`` returns to standby.  ``max`` bounds the endpoints in rotation.  A core
endpoint idle for half ``idle_timeout_s`` gets a warm-up request (``keep_warm``), so the
model behind it does not go cold between bursts (the case study's first-request scar).  The
gateway never creates instances: it decides which existing ones take traffic (creating
replicas is the autoscaler's job, fed by ``gateway_desired_endpoints``).  A backend's
``Demand`` entry (set by the pool stage from a route's ``prewarm`` forecast) is a second
reason to warm the next standby endpoint: fewer endpoints in rotation than the forecast
calls for, so they are warm before the peak arrives rather than when it has.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from gateway.clock import Clock
from gateway.errors import UpstreamError
from gateway.policy.model import Backend, ModelPool
from gateway.transport.upstream import BackendPool

log = logging.getLogger("gateway.transport")

ACTIVE, STANDBY, WARMING = "active", "standby", "warming"

Demand = dict[str, Callable[[], int]]
"""Per backend name: the endpoints a forecast says it will need (``pool.stage``)."""


class Member(Protocol):
    """What sizing needs of an endpoint (``endpoints.Endpoint``)."""

    url: str
    pool: BackendPool
    role: str
    last_used: float

    @property
    def inflight(self) -> int: ...

    def show_state(self) -> None: ...


M = TypeVar("M", bound=Member)


class Sizing:
    """Roles (active, standby, warming) over a backend's endpoints, by its ``pool``."""

    def __init__(
        self,
        backend: Backend,
        pool: ModelPool,
        clock: Clock,
        demand: Demand | None = None,
    ) -> None:
        self.backend = backend
        self._demand: Demand = demand if demand is not None else {}
        self.pool = pool
        self.clock = clock
        self._tasks: set[asyncio.Task[None]] = set()
        self.promotions = 0
        self.demotions = 0
        self.keep_warms = 0

    def assign(self, members: Sequence[Member]) -> None:
        """Give new endpoints their role: the first ``core`` active, the rest standby."""
        for i, m in enumerate(members):
            if not m.role:
                m.role = ACTIVE if i < self.pool.core else STANDBY
                m.last_used = self.clock.now()
                m.show_state()

    def wanted(self) -> int:
        """The endpoints the backend's forecast calls for (0: no forecast)."""
        forecast = self._demand.get(self.backend.name)
        return forecast() if forecast is not None else 0

    def in_rotation(self, members: Sequence[M]) -> list[M]:
        """The active endpoints; a brought-in one idle past ``idle_timeout_s`` goes back."""
        now = self.clock.now()
        out = []
        for i, m in enumerate(members):
            idle = now - m.last_used >= self.pool.idle_timeout_s
            if m.role == ACTIVE and i >= self.pool.core and idle and m.inflight == 0:
                m.role = STANDBY
                m.show_state()
                self.demotions += 1
            if m.role == ACTIVE:
                out.append(m)
        return out

    def pressure(self, members: Sequence[Member], active: int, inflight: int, waiting: int) -> None:
        """After a pick: warm the next standby endpoint when the rotation is loaded."""
        limit = min(self.pool.max or len(members), len(members))
        warming = sum(1 for m in members if m.role == WARMING)
        if active + warming >= limit or warming:
            return
        loaded = waiting > 0 or inflight >= self.pool.scale_up_inflight * max(1, active)
        if not loaded and active >= min(self.wanted(), limit):
            return
        standby = next((m for m in members if m.role == STANDBY), None)
        if standby is None:
            return
        standby.role = WARMING
        standby.show_state()
        task = asyncio.get_running_loop().create_task(self._warm(standby))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, member: Member) -> None:
        ok = await warm(member.pool, self.backend)
        if member.role != WARMING:
            return  # it left meanwhile
        member.role = ACTIVE if ok else STANDBY
        member.last_used = self.clock.now()
        member.show_state()
        if ok:
            self.promotions += 1
            log.info("backend %s: %s brought into rotation", self.backend.name, member.url)

    async def keep_warm(
        self, members: Callable[[], Sequence[Member]], sleep: Callable[[float], Awaitable[Any]]
    ) -> None:
        """Every half ``idle_timeout_s``: a warm-up request to each core endpoint that had no
        request for that long (until cancelled)."""
        half = self.pool.idle_timeout_s / 2
        while True:
            await sleep(half)
            now = self.clock.now()
            for m in list(members())[: self.pool.core]:
                if m.inflight == 0 and now - m.last_used >= half and self.backend.warmup:
                    if await warm(m.pool, self.backend):
                        self.keep_warms += 1

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


async def warm(pool: BackendPool, backend: Backend) -> bool:
    """Send the backend's warm-up requests to one endpoint; True when all answered < 500
    (none configured: True)."""
    for request in backend.warmup:
        body = b"" if request.body is None else _json(request.body)
        headers = [("Content-Type", "application/json")] if body else []
        try:
            reply = await pool.send(
                backend, request.method, request.path, headers, body, streaming=False
            )
        except UpstreamError:
            return False
        if reply.close is not None:
            await reply.close()
        if reply.status >= 500:
            return False
    return True


def _json(value: object) -> bytes:
    return json.dumps(value).encode()
