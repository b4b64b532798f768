"""The sim's scheduler: FIFO slots, call counters, fault injection and live reconfiguration.

Handlers ask ``Engine.fault`` whether a call fails before it runs, then hold a slot with
``async with engine.call(items, tokens)`` while they sleep the modelled time.  The engine
tells the ``GpuModel`` about every queue, start and finish, and counts what ran, so tests can
check the cost model from counters instead of wall-clock time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections import deque
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from gateway.clock import Clock
from gateway.sim.config import SimConfig, apply_changes
from gateway.sim.gpu import GpuModel, call_cost_ms


@dataclass(frozen=True, slots=True)
class Fault:
    """An injected failure, in the shape of an OpenAI error."""

    status: int
    type: str
    code: str
    message: str


@dataclass(slots=True)
class Counters:
    """What the sim has served since start (or the last reset)."""

    requests: int = 0
    calls: int = 0
    items: int = 0
    tokens: int = 0
    modelled_ms: float = 0.0
    injected_errors: int = 0
    ooms: int = 0
    peak_running: int = 0
    peak_waiting: int = 0
    cold_starts: int = 0


class Slots:
    """At most ``capacity`` holders at once; the others wait and are served in arrival order."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.in_use = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def acquire(self) -> None:
        if self.in_use < self.capacity and not self._waiters:
            self.in_use += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # the slot was handed over just as the caller gave up
            else:
                self._waiters.remove(waiter)
            raise

    def release(self) -> None:
        self.in_use -= 1
        self._wake()

    def resize(self, capacity: int) -> None:
        self.capacity = capacity
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_use < self.capacity:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_use += 1
                waiter.set_result(None)

    def __repr__(self) -> str:
        return f"<Slots in_use={self.in_use}/{self.capacity} waiting={len(self._waiters)}>"


class Engine:
    """One simulated GPU shared by every request the sim serves."""

    def __init__(self, config: SimConfig, clock: Clock) -> None:
        self.clock = clock
        self.gpu = GpuModel(config, clock)
        self.slots = Slots(config.slots)
        self.counters = Counters()
        self._rng = random.Random(config.seed)
        self._warm_at: float | None = None  # when the model is (or was) warm; None: cold
        self._last_end = clock.now()

    @property
    def config(self) -> SimConfig:
        return self.gpu.config

    def reconfigure(self, changes: Mapping[str, Any]) -> SimConfig:
        """Apply ``changes`` (field -> value); ValueError leaves the config as it was."""
        config = apply_changes(self.config, changes)
        self.gpu.config = config
        self.slots.resize(config.slots)
        if "seed" in changes:
            self._rng = random.Random(config.seed)
        return config

    def reset(self) -> None:
        """Zero the counters and the peak temperature (between benchmark runs)."""
        self.counters = Counters()
        self.gpu.reset_peak()

    def fault(self, items: int) -> Fault | None:
        """Count a model request and decide whether it fails instead of running."""
        self.counters.requests += 1
        c = self.config
        if c.oom_above and items > c.oom_above:
            self.counters.ooms += 1
            return Fault(
                status=500,
                type="server_error",
                code="cuda_out_of_memory",
                message=(
                    f"CUDA out of memory. Tried to allocate the KV cache for {items} items "
                    f"(the sim fails calls with more than oom_above={c.oom_above})"
                ),
            )
        if c.error_rate and self._rng.random() < c.error_rate:
            self.counters.injected_errors += 1
            return Fault(
                status=c.fail_status,
                type="server_error",
                code="sim_injected_error",
                message=f"simulated backend failure (error_rate={c.error_rate})",
            )
        return None

    @asynccontextmanager
    async def call(self, items: int, tokens: int = 0) -> AsyncIterator[float]:
        """Hold a GPU slot for a call; yields its modelled cost in ms."""
        self.gpu.queued(items)
        n = self.counters
        n.peak_waiting = max(n.peak_waiting, self.gpu.waiting)
        try:
            await self.slots.acquire()
        finally:
            self.gpu.dequeued(items)
        cost_ms = call_cost_ms(self.config, items, tokens) + self._cold_ms()
        self.gpu.started(items)
        n = self.counters  # re-read: a reset may have replaced them while this call waited
        n.calls += 1
        n.items += items
        n.tokens += tokens
        n.modelled_ms += cost_ms
        n.peak_running = max(n.peak_running, self.gpu.running)
        try:
            yield cost_ms
        finally:
            self.gpu.finished(items)
            self.slots.release()
            self._last_end = self.clock.now()

    def _cold_ms(self) -> float:
        """What a call starting now waits for the model to be warm (``cold_start_ms``): the
        first calls after start, or after ``cold_idle_s`` without one, wait until it is."""
        c = self.config
        if c.cold_start_ms <= 0:
            return 0.0
        now = self.clock.now()
        idle = self.gpu.running == 0 and now - self._last_end >= c.cold_idle_s
        if self._warm_at is None or (idle and now >= self._warm_at):
            self._warm_at = now + c.cold_start_ms / 1000
            self.counters.cold_starts += 1
        return max(0.0, self._warm_at - now) * 1000

    def state(self) -> dict[str, Any]:
        """A JSON-ready snapshot: the GPU, the counters and the slot count."""
        return {
            **dataclasses.asdict(self.gpu.state()),
            **dataclasses.asdict(self.counters),
            "slots": self.config.slots,
            "clock_s": self.clock.now(),
        }

    def __repr__(self) -> str:
        return f"<Engine calls={self.counters.calls} {self.slots!r} {self.gpu!r}>"
