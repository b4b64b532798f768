"""Event-loop lag: a timer due every ``interval_s``, and how late the loop runs it.

Every request of a sidecar shares one event loop, so a callback that holds it (a large
body parsed, a hash, a blocking call) delays all of them; the lag histogram shows that next
to the request latency it explains.  Lag is read on the loop's own clock (``loop.time()``,
what its timers are scheduled by; 1 ms steps under uvloop), so a test can drive ``observe``
with any numbers, or patch the loop's clock.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

INTERVAL_S = 0.25
"""How often the lag is sampled: often enough to catch a stall, rare enough to cost nothing."""


class Observer(Protocol):
    """What the lag is recorded in (a prometheus ``Histogram``)."""

    def observe(self, amount: float) -> None: ...


class LoopLag:
    """The sampler: ``start()`` on the running loop, ``aclose()`` at shutdown."""

    def __init__(self, histogram: Observer, interval_s: float = INTERVAL_S) -> None:
        self._histogram = histogram
        self.interval_s = interval_s
        self.samples = 0
        self.last_s: float | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start sampling on the running loop (idempotent)."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def observe(self, due: float, ran: float) -> float:
        """Record one timer due at ``due`` that ran at ``ran`` (loop seconds); the lag."""
        lag = max(0.0, ran - due)  # a timer may run a clock tick early: that is no lag
        self._histogram.observe(lag)
        self.samples += 1
        self.last_s = lag
        return lag

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            self.observe(due, loop.time())

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        last = "-" if self.last_s is None else f"{self.last_s * 1000:.1f}ms"
        return f"<LoopLag every={self.interval_s:g}s {state} samples={self.samples} last={last}>"
