"""Admission per backend: at most ``max_concurrency`` calls in flight, then a bounded queue.

The case study's ModelPool: GPU capacity is pooled like database connections.  A call takes a
slot; beyond the limit it waits in a queue ordered by priority (high, normal, low; FIFO within
one), for at most ``timeout_ms``.  The queue is bounded: when it is full a newcomer sheds the
newest waiter of the lowest priority below its own, and is rejected itself when there is none.
Rejections raise ``Overloaded`` at once (no awaiting), with a ``retry_after_s`` estimated from
the queue length and the recent time a call holds its slot.

On shutdown (``drain``) every waiter is refused at once (``Overloaded('shutdown')``, 503 with
Retry-After) and nothing queues any more: a call is admitted only while a slot is free, so
nothing that was waiting at SIGTERM is sent upstream afterwards.

A waiter whose task is cancelled (its client went away) leaves the queue at once.  Limits can
change at run time (a policy reload, a ``limit`` throttle rule): new limits apply to new
admissions while calls in flight finish.  Time comes from the injected clock; a timer per
waiter only wakes the queue up, and ``expire_due`` is what fails waiters past their deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import Overloaded
from gateway.policy.backend import Queue

DEFAULT_SERVICE_S = 1.0
"""Assumed time a call holds its slot before any has finished (for Retry-After)."""
SERVICE_EWMA_WEIGHT = 0.2
MIN_RETRY_AFTER_S = 1
MAX_RETRY_AFTER_S = 60


class Priority(enum.IntEnum):
    """A request's priority: a route's ``priority`` or the ``X-Priority`` header."""

    LOW = 0
    NORMAL = 1
    HIGH = 2

    @classmethod
    def parse(cls, value: str) -> Priority:
        """``high``, ``normal`` or ``low`` (any case); ValueError otherwise."""
        try:
            return cls[value.strip().upper()]
        except KeyError:
            raise ValueError(f"priority must be high, normal or low, not {value!r}") from None


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    """``backends.<name>.max_concurrency`` and ``.queue``."""

    max_concurrency: int
    queue: Queue = field(default_factory=Queue)

    def __post_init__(self) -> None:
        if self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")


class _Waiter:
    __slots__ = ("deadline", "future", "priority", "queued", "since", "timer")

    def __init__(
        self, future: asyncio.Future[None], priority: Priority, since: float, deadline: float
    ) -> None:
        self.future = future
        self.priority = priority
        self.since = since
        self.deadline = deadline
        self.queued = True
        self.timer: asyncio.TimerHandle | None = None


class Ticket:
    """A held slot; ``release`` it exactly once (further calls do nothing)."""

    __slots__ = ("_admission", "granted_at", "released")

    def __init__(self, admission: Admission, granted_at: float) -> None:
        self._admission = admission
        self.granted_at = granted_at
        self.released = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(self.granted_at)

    def __repr__(self) -> str:
        state = "released" if self.released else "held"
        return f"<Ticket {self._admission.backend} {state}>"


class Admission:
    """Slots and the priority queue of one backend.

    ``on_wait(seconds)`` sees the queue wait of every admitted call (0.0 when it got a slot at
    once: ``gateway_queue_wait_seconds``); ``on_shed(reason)`` every rejection
    (``gateway_shed_total``), reasons ``queue_full`` and ``queue_timeout``; ``depth`` is
    ``gateway_queue_depth``.
    """

    def __init__(
        self,
        backend: str,
        config: AdmissionConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_wait: Callable[[float], None] | None = None,
        on_shed: Callable[[str], None] | None = None,
    ) -> None:
        self.backend = backend
        self.config = config
        self.on_wait = on_wait
        self.on_shed = on_shed
        self.shed: Counter[str] = Counter()
        self.in_flight = 0
        self.depth = 0
        self.service_s = DEFAULT_SERVICE_S
        self._throttle_limit: int | None = None
        self._clock = clock
        self._queues: tuple[deque[_Waiter], ...] = tuple(deque() for _ in Priority)
        self.draining = False

    @property
    def limit(self) -> int:
        """The effective concurrency limit: the config's, lowered by a ``limit`` throttle."""
        if self._throttle_limit is None:
            return self.config.max_concurrency
        return min(self.config.max_concurrency, self._throttle_limit)

    def configure(self, config: AdmissionConfig) -> None:
        """Apply reloaded limits to new admissions; calls in flight and queued waiters stay."""
        self.config = config
        self._grant()

    def set_throttle_limit(self, max_concurrency: int | None) -> None:
        """Cap concurrency below the config (a ``limit`` throttle rule); None lifts the cap."""
        self._throttle_limit = max_concurrency
        self._grant()

    def depth_of(self, priority: Priority) -> int:
        return len(self._queues[priority])

    def retry_after_s(self) -> int:
        """Whole seconds a shed client should wait: the queue ahead of it drained at the recent
        pace, at least ``MIN_RETRY_AFTER_S``."""
        estimate = (self.depth + 1) * self.service_s / max(1, self.limit)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(estimate)))

    @contextlib.asynccontextmanager
    async def slot(self, priority: Priority = Priority.NORMAL) -> AsyncIterator[Ticket]:
        """``async with admission.slot(priority):`` holds a slot for the block."""
        ticket = await self.acquire(priority)
        try:
            yield ticket
        finally:
            ticket.release()

    async def acquire(self, priority: Priority = Priority.NORMAL) -> Ticket:
        """A slot, waiting in the queue if need be; ``Overloaded`` when shed or timed out."""
        now = self._clock.now()
        if self.in_flight < self.limit and not self.depth:
            return self._admit(now)
        if self.draining:
            raise self._reject("shutdown", "the gateway is shutting down")
        if self.depth >= self.config.queue.capacity:
            victim = self._lowest_below(priority)
            if victim is None:
                raise self._reject("queue_full", "the queue is full")
            self._unqueue(victim)
            self._fail(victim, "queue_full", "shed from a full queue by a higher-priority request")
        loop = asyncio.get_running_loop()
        timeout_s = self.config.queue.timeout_ms / 1000
        waiter = _Waiter(loop.create_future(), priority, now, now + timeout_s)
        waiter.timer = loop.call_later(timeout_s, self._on_timer, waiter)
        self._queues[priority].append(waiter)
        self.depth += 1
        try:
            await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        finally:
            if waiter.timer is not None:
                waiter.timer.cancel()
        now = self._clock.now()
        if self.on_wait is not None:
            self.on_wait(now - waiter.since)
        return Ticket(self, now)

    def expire_due(self) -> int:
        """Fail every waiter past its deadline with ``Overloaded('queue_timeout')``; how many.

        Called by the waiters' timers; a test calls it after advancing a fake clock."""
        now = self._clock.now()
        due = [w for q in self._queues for w in q if w.deadline <= now]
        for waiter in due:
            self._unqueue(waiter)
            self._fail(waiter, "queue_timeout", "timed out in the queue")
        return len(due)

    def drain(self) -> int:
        """Shutdown: refuse every waiter now, and queue nobody from here on; how many."""
        self.draining = True
        waiting = [w for q in self._queues for w in q]
        for waiter in waiting:
            self._unqueue(waiter)
            self._fail(waiter, "shutdown", "the gateway is shutting down")
        return len(waiting)

    def shed_waiting(self, below: Priority, reason: str = "throttle") -> int:
        """Fail every queued waiter of a priority below ``below``; how many (a ``shed`` rule)."""
        victims = [w for p in Priority if p < below for w in self._queues[p]]
        for waiter in victims:
            self._unqueue(waiter)
            self._fail(waiter, reason, "shed to protect the backend")
        return len(victims)

    def _admit(self, now: float) -> Ticket:
        self.in_flight += 1
        if self.on_wait is not None:
            self.on_wait(0.0)
        return Ticket(self, now)

    def _release(self, granted_at: float | None) -> None:
        self.in_flight -= 1
        if granted_at is not None:
            held = self._clock.now() - granted_at
            self.service_s += SERVICE_EWMA_WEIGHT * (held - self.service_s)
        self._grant()

    def _grant(self) -> None:
        """Hand free slots to queued waiters, highest priority first.  The slot is taken here,
        when the waiter is woken, so that no newcomer slips in before it resumes."""
        for queue in reversed(self._queues):
            while queue and self.in_flight < self.limit:
                waiter = queue.popleft()
                waiter.queued = False
                self.depth -= 1
                if waiter.future.done():
                    continue  # cancelled, its task not yet resumed: it is leaving anyway
                self.in_flight += 1
                waiter.future.set_result(None)

    def _lowest_below(self, priority: Priority) -> _Waiter | None:
        for p in Priority:
            if p >= priority:
                return None
            if self._queues[p]:
                return self._queues[p][-1]
        return None

    def _unqueue(self, waiter: _Waiter) -> None:
        if waiter.queued:
            waiter.queued = False
            self._queues[waiter.priority].remove(waiter)
            self.depth -= 1

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiter's task was cancelled: leave the queue, or hand back a slot just given."""
        if waiter.queued:
            self._unqueue(waiter)
        elif waiter.future.done() and not waiter.future.cancelled():
            if waiter.future.exception() is None:
                self._release(None)  # granted as it was cancelled: pass the slot on

    def _on_timer(self, waiter: _Waiter) -> None:
        if not waiter.queued:
            return
        remaining = waiter.deadline - self._clock.now()
        if remaining > 0:
            waiter.timer = asyncio.get_running_loop().call_later(remaining, self._on_timer, waiter)
        else:
            self.expire_due()

    def _fail(self, waiter: _Waiter, reason: str, why: str) -> None:
        """Refuse a waiter taken off the queue (unless it was cancelled meanwhile)."""
        if not waiter.future.done():
            waiter.future.set_exception(self._reject(reason, why))

    def _reject(self, reason: str, why: str) -> Overloaded:
        self.shed[reason] += 1
        if self.on_shed is not None:
            self.on_shed(reason)
        if reason == "shutdown":  # another replica can take it at once
            return Overloaded(f"{why}; retry", retry_after_s=1.0, reason=reason)
        return Overloaded(
            f"backend {self.backend!r} is overloaded: {why}",
            retry_after_s=float(self.retry_after_s()),
            reason=reason,
        )

    def __repr__(self) -> str:
        return (
            f"<Admission {self.backend} in_flight={self.in_flight}/{self.limit} "
            f"queued={self.depth}/{self.config.queue.capacity} service={self.service_s:.2f}s>"
        )
