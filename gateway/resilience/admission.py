"""Admission per backend: at most ``max_concurrency`` calls in flight, then a bounded queue.

The case study's ModelPool: GPU capacity is pooled like database connections.  A call takes a
slot; beyond the limit it waits in a queue ordered by priority (high, normal, low), for at most
``timeout_ms``.  The queue is bounded: when it is full a newcomer sheds the newest waiter of
the lowest priority below its own, and is rejected itself when there is none.  Rejections
raise ``Overloaded`` at once (no awaiting), with a ``retry_after_s`` estimated from the queue
length and the recent time a call holds its slot.

Within a priority, waiters belong to flows (``queue.fairness: tenant``: the caller's named
tenant, else its address; ``fifo``: one flow), each first come, first served.  A freed slot
goes to each waiting flow in turn (round robin, one call each: the fair queuing of the
Kubernetes inference extension's flow control), so a tenant with forty waiting calls and one
with a single call share the backend's slots equally while both wait.  A full queue with no
lower priority to shed makes room for a newcomer by shedding the newest waiter of the flow of
its priority holding the most places, when that flow holds at least two more than the
newcomer's would (``queue_share``): places end up shared evenly, and a tenant that filled the
queue first cannot keep the others out of it.  With one flow both rules are plain FIFO.
A flow may have a weight (``tenants.keys[].weight``, named tenants only; 1 otherwise): it
takes up to that many calls a turn where the others take one, and a full queue keeps its
places in that proportion (weighted round robin).

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
from collections.abc import AsyncIterator, Callable, Iterator
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
    __slots__ = ("deadline", "flow", "future", "priority", "queued", "since", "timer")

    def __init__(
        self,
        future: asyncio.Future[None],
        priority: Priority,
        flow: str,
        since: float,
        deadline: float,
    ) -> None:
        self.future = future
        self.priority = priority
        self.flow = flow
        self.since = since
        self.deadline = deadline
        self.queued = True
        self.timer: asyncio.TimerHandle | None = None


def _largest(flows: dict[str, deque[_Waiter]], weight: Callable[[str], int]) -> deque[_Waiter]:
    """The waiters of the flow with the most for its weight (the first in turn among
    equals)."""
    return max(flows.values(), key=lambda waiters: len(waiters) / weight(waiters[0].flow))


class Ticket:
    """A held slot; ``release`` it exactly once (further calls do nothing)."""

    __slots__ = ("_admission", "granted_at", "released")

    def __init__(self, admission: Admission, granted_at: float | None) -> None:
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
    (``gateway_shed_total``), reasons ``queue_full``, ``queue_share`` and ``queue_timeout``;
    ``depth`` is ``gateway_queue_depth``.
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
        # Per priority, each flow's waiters in arrival order; a dict's order is the turn.
        self._queues: tuple[dict[str, deque[_Waiter]], ...] = tuple({} for _ in Priority)
        # Per priority, the calls the flow whose turn it is has taken in that turn.
        self._turns: tuple[dict[str, int], ...] = tuple({} for _ in Priority)
        self.weights: dict[str, int] = {}
        """Each weighted flow's calls a turn (``tenants.keys[].weight``); 1 for any other."""
        self._depths = [0 for _ in Priority]
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
        return self._depths[priority]

    def waiting_of(self, flow: str) -> int:
        """How many of ``flow``'s calls wait, at every priority."""
        return sum(len(flows.get(flow, ())) for flows in self._queues)

    def retry_after_s(self) -> int:
        """Whole seconds a shed client should wait: the queue ahead of it drained at the recent
        pace, at least ``MIN_RETRY_AFTER_S``."""
        estimate = (self.depth + 1) * self.service_s / max(1, self.limit)
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, math.ceil(estimate)))

    @contextlib.asynccontextmanager
    async def slot(
        self, priority: Priority = Priority.NORMAL, flow: str = ""
    ) -> AsyncIterator[Ticket]:
        """``async with admission.slot(priority):`` holds a slot for the block."""
        ticket = await self.acquire(priority, flow)
        try:
            yield ticket
        finally:
            ticket.release()

    async def acquire(self, priority: Priority = Priority.NORMAL, flow: str = "") -> Ticket:
        """A slot, waiting in the queue if need be; ``Overloaded`` when shed or timed out.
        ``flow`` is who the call is for (one turn each within a priority)."""
        now = self._clock.now()
        if self.in_flight < self.limit and not self.depth:
            return self._admit(now)
        if self.draining:
            raise self._reject("shutdown", "the gateway is shutting down")
        if self.depth >= self.config.queue.capacity:
            self._make_room(priority, flow)
        loop = asyncio.get_running_loop()
        timeout_s = self.config.queue.timeout_ms / 1000
        waiter = _Waiter(loop.create_future(), priority, flow, now, now + timeout_s)
        waiter.timer = loop.call_later(timeout_s, self._on_timer, waiter)
        flows = self._queues[priority]
        if flow in flows:
            flows[flow].append(waiter)
        else:
            flows[flow] = deque((waiter,))  # a new flow takes its turn after those waiting
        self._depths[priority] += 1
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

    def spare(self) -> Ticket | None:
        """A slot now, if one is free and no call waits for one; else None (never queued).
        A call the gateway adds holds it (a hedge's second call, a mirror's copy): it goes
        before no waiter, and its time is not a call's (the ``Retry-After`` estimate)."""
        if self.in_flight >= self.limit or self.depth or self.draining:
            return None
        self.in_flight += 1
        return Ticket(self, None)

    def expire_due(self) -> int:
        """Fail every waiter past its deadline with ``Overloaded('queue_timeout')``; how many.

        Called by the waiters' timers; a test calls it after advancing a fake clock."""
        now = self._clock.now()
        due = [w for w in self._waiters() if w.deadline <= now]
        for waiter in due:
            self._unqueue(waiter)
            self._fail(waiter, "queue_timeout", "timed out in the queue")
        return len(due)

    def drain(self) -> int:
        """Shutdown: refuse every waiter now, and queue nobody from here on; how many."""
        self.draining = True
        waiting = list(self._waiters())
        for waiter in waiting:
            self._unqueue(waiter)
            self._fail(waiter, "shutdown", "the gateway is shutting down")
        return len(waiting)

    def shed_waiting(self, below: Priority, reason: str = "throttle") -> int:
        """Fail every queued waiter of a priority below ``below``; how many (a ``shed`` rule)."""
        victims = [w for w in self._waiters() if w.priority < below]
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
        """Hand free slots to queued waiters, highest priority first, each waiting flow in
        turn.  The slot is taken here, when the waiter is woken, so that no newcomer slips in
        before it resumes."""
        for flows, turns in zip(reversed(self._queues), reversed(self._turns), strict=True):
            while flows and self.in_flight < self.limit:
                flow = next(iter(flows))
                waiters = flows[flow]
                waiter = waiters.popleft()
                taken = turns.pop(flow, 0) + 1
                if waiters and taken < self._weight(flow):
                    turns[flow] = taken  # a weighted flow's turn goes on
                else:
                    del flows[flow]
                    if waiters:
                        flows[flow] = waiters  # its next call waits for the others' turns
                waiter.queued = False
                self._depths[waiter.priority] -= 1
                self.depth -= 1
                if waiter.future.done():
                    continue  # cancelled, its task not yet resumed: it is leaving anyway
                self.in_flight += 1
                waiter.future.set_result(None)

    def _make_room(self, priority: Priority, flow: str) -> None:
        """Shed a waiter for a newcomer at a full queue, or refuse the newcomer: the newest
        waiter of the largest flow of the lowest priority below the newcomer's; else, at its
        own priority, of the largest flow when that holds two more than the newcomer's."""
        for p in Priority:
            if p >= priority:
                break
            if flows := self._queues[p]:
                victims = _largest(flows, self._weight)
                self._shed_newest(victims, "queue_full", "by a higher-priority request")
                return
        flows = self._queues[priority]
        if flows:
            largest = _largest(flows, self._weight)
            other = largest[-1].flow
            # Shed when the largest would still hold, for its weight, as many places as
            # the newcomer's flow with it (unweighted: two more than the newcomer's).
            if other != flow and (len(largest) - 1) * self._weight(flow) >= (
                len(flows.get(flow, ())) + 1
            ) * self._weight(other):
                self._shed_newest(largest, "queue_share", "to share it between tenants")
                return
        raise self._reject("queue_full", "the queue is full")

    def _shed_newest(self, waiters: deque[_Waiter], reason: str, why: str) -> None:
        victim = waiters[-1]
        self._unqueue(victim)
        self._fail(victim, reason, f"shed from a full queue {why}")

    def _waiters(self) -> Iterator[_Waiter]:
        return (w for flows in self._queues for waiters in flows.values() for w in waiters)

    def _unqueue(self, waiter: _Waiter) -> None:
        if waiter.queued:
            waiter.queued = False
            flows = self._queues[waiter.priority]
            waiters = flows[waiter.flow]
            waiters.remove(waiter)
            if not waiters:
                del flows[waiter.flow]
                self._turns[waiter.priority].pop(waiter.flow, None)
            self._depths[waiter.priority] -= 1
            self.depth -= 1

    def _weight(self, flow: str) -> int:
        return self.weights.get(flow, 1)

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
