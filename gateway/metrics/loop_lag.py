"""Event-loop lag: a timer due every ``interval_s``, and how late the loop runs it; and
the pauses of Python's cyclic garbage collector, one of the things that hold it.

Every request of a sidecar shares one event loop, so a callback that holds it (a large
body parsed, a hash, a blocking call) delays all of them; the lag histogram shows that next
to the request latency it explains.  Lag is read on the loop's own clock (``loop.time()``,
what its timers are scheduled by; 1 ms steps under uvloop), so a test can drive ``observe``
with any numbers, or patch the loop's clock.

A full collection scans every object the collector tracks, with the loop held: its pauses
(``gateway_gc_pause_seconds{generation}``) are timed by a ``gc.callbacks`` hook.  The hook
runs inside the collector, which may start at any allocation, also inside a metric's own
lock: it takes none, only queues the pause, which the sampler records at its next tick.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import deque
from typing import Any, Protocol

INTERVAL_S = 0.25
"""How often the lag is sampled: often enough to catch a stall, rare enough to cost nothing."""
MAX_PAUSES = 4096
"""Collector pauses queued between two samples at most (the oldest are dropped)."""


class Observer(Protocol):
    """What the lag is recorded in (a prometheus ``Histogram``)."""

    def observe(self, amount: float) -> None: ...


class Labelled(Protocol):
    """A histogram by label (a prometheus ``Histogram`` with one label)."""

    def labels(self, *values: str) -> Observer: ...


class LoopLag:
    """The sampler: ``start()`` on the running loop, ``aclose()`` at shutdown; with
    ``gc_pauses``, the collector's pauses by generation too."""

    def __init__(
        self,
        histogram: Observer,
        interval_s: float = INTERVAL_S,
        gc_pauses: Labelled | None = None,
    ) -> None:
        self._histogram = histogram
        self.interval_s = interval_s
        self.samples = 0
        self.last_s: float | None = None
        self._task: asyncio.Task[None] | None = None
        self._gc_pauses = gc_pauses
        self._paused: deque[tuple[int, float]] = deque(maxlen=MAX_PAUSES)
        self._gc_started = 0.0
        self._gc_children: dict[int, Observer] = {}

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start sampling on the running loop (idempotent)."""
        if not self.running:
            self._task = asyncio.get_running_loop().create_task(self._run())
            if self._gc_pauses is not None and self._on_gc not in gc.callbacks:
                gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        """``gc.callbacks``' hook: time a collection (no lock taken; see the module)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._paused.append((info["generation"], time.perf_counter() - self._gc_started))

    def record_gc_pauses(self) -> None:
        """Record the collector's pauses queued since the last call."""
        if self._gc_pauses is None:
            return
        children = self._gc_children
        while self._paused:
            generation, pause_s = self._paused.popleft()
            child = children.get(generation)
            if child is None:  # a label lookup costs more than the observation
                child = children[generation] = self._gc_pauses.labels(str(generation))
            child.observe(pause_s)

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
            self.record_gc_pauses()

    async def aclose(self) -> None:
        with contextlib.suppress(ValueError):  # not there: never started, or closed before
            gc.callbacks.remove(self._on_gc)
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        last = "-" if self.last_s is None else f"{self.last_s * 1000:.1f}ms"
        return f"<LoopLag every={self.interval_s:g}s {state} samples={self.samples} last={last}>"
