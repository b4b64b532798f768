"""Endpoints that join a backend are warmed before they take calls: those ``discovery``
finds, and those a reload adds to its ``endpoints``.

A replica that joins (scaled up by the autoscaler, a pod restarted, discovery's first answer
at start, one a policy edit lists) is cold: its model server has not run a request yet, and
whichever call is picked for it first pays for that (the case study's first request timed
out until warm-up was added).  So the backend's ``warmup`` requests go to it first, over its
own pool, retried every ``RETRY_DELAY_S`` while it is still starting (a 5xx or a refused
connection: its model still loading), for at most ``warmup_timeout_s``.  Meanwhile it is
``warming`` (``gateway_endpoint_state``) and takes no call while another endpoint can
(``pick``).  Then it joins the rotation; one whose warm-up gave up joins all the same
(logged), and outlier ejection judges it as any other.  Counted in
``gateway_endpoint_warmups_total{backend, outcome}`` (``warmed``, ``gave_up``).

A backend with a ``pool`` warms its standby endpoints its own way (``sizing.py``), and one
without ``warmup`` requests has nothing to send: their endpoints take calls at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.metrics.children import Counted
from gateway.policy.model import Backend
from gateway.policy.show import redact_url
from gateway.transport.endpoint import Endpoint
from gateway.transport.sizing import warm

log = logging.getLogger("gateway.transport.joining")
RETRY_DELAY_S = 1.0
"""Between two warm-ups of an endpoint whose server is still starting."""


class Joining:
    """The warm-ups of one backend's endpoints that joined it."""

    def __init__(
        self,
        backend: Backend,
        metrics: Metrics,
        clock: Clock,
        sleep: Callable[[float], Awaitable[Any]],
    ) -> None:
        self.backend = backend  # the live definition (a reload may change its `warmup`)
        self._clock = clock
        self._sleep = sleep
        self._tasks: dict[Endpoint, asyncio.Task[None]] = {}
        self._counted = Counted(metrics.endpoint_warmups, backend.name)

    def join(self, endpoint: Endpoint) -> None:
        """Warm ``endpoint`` (new to the backend) before it takes calls."""
        if not self.backend.warmup:
            return
        endpoint.warming = True
        endpoint.show_state()
        task = asyncio.get_running_loop().create_task(self._warm(endpoint))
        self._tasks[endpoint] = task
        task.add_done_callback(lambda _: self._tasks.pop(endpoint, None))

    def leave(self, endpoint: Endpoint) -> None:
        """``endpoint`` left the backend: its warm-up, if one runs, stops."""
        task = self._tasks.pop(endpoint, None)
        if task is not None:
            task.cancel()

    async def _warm(self, endpoint: Endpoint) -> None:
        backend = self.backend
        deadline = self._clock.now() + backend.warmup_timeout_s
        try:
            while not await warm(endpoint.pool, backend):
                if self._clock.now() >= deadline:
                    log.error(
                        "backend %s: warm-up of the new endpoint %s gave up after %.0f s; "
                        "it takes calls all the same",
                        backend.name,
                        redact_url(endpoint.url),  # never a URL's credentials
                        backend.warmup_timeout_s,
                    )
                    self._counted.inc("gave_up")
                    return
                await self._sleep(RETRY_DELAY_S)
            self._counted.inc("warmed")
        finally:
            endpoint.warming = False
            if endpoint in self._tasks:  # still the backend's (``leave`` forgets it first)
                endpoint.show_state()

    def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()

    def __repr__(self) -> str:
        return f"<Joining {self.backend.name} warming={len(self._tasks)}>"
