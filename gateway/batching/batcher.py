"""Micro-batching: requests alike in every non-input field share one upstream array call.

One ``Batcher`` serves one route and backend; callers are grouped inside it by the adapter's
compat key plus a ``scope`` the caller supplies (tenant, route, backend, path), so requests
of different tenants or parameters never share a call.  A group goes upstream when

- it is full (``limit`` items; a caller with that many items or more goes alone, unsplit:
  the gateway never changes what one request asks of the backend),
- ``max_wait_ms`` has passed since its first caller arrived, or
- the backend is idle (fewer than ``slots`` batches of this batcher in flight), on the next
  turn of the event loop: waiting only pays while the GPU is busy, so with one slot batch
  N+1 fills while batch N runs and goes the moment N returns.

With ``max_in_flight`` (at least ``slots``) batches are *held*: never more than that many are
upstream at once.  Callers queue per group and a batch is cut, at the limit as it is then,
only when it may go: at once while fewer than ``slots`` are in flight; when full or past
``max_wait_ms`` while fewer than ``max_in_flight`` are; otherwise when one returns, the
groups taking turns (round robin, so no tenant starves another).  Without a cap, a saturated
backend collects a queue of partial batches, each sent when its wait ran out, and closed-loop
clients stay split into those small cohorts for good; held, the batches stay full.  With
``max_in_flight == slots`` a batch never queues at the backend behind another of this batcher,
so its latency is the backend's time for that batch alone: what an AIMD limit must see, or it
would read queueing as the cost of size and shrink the batches when the backend is saturated.
A returning batch frees its slot before its answer is split, so the next one is on its way
while the callers of the last are answered.

A batch that goes is one merged call upstream; how its answer, or its failure, reaches each
caller is ``merged_calls``.

A caller that goes away before its batch is sent leaves the batch; after that its share of
the answer is dropped.  The upstream call itself runs on: the GPU is doing the work anyway.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from gateway.batching.adapters import Adapter
from gateway.batching.aimd import BatchLimit, FixedLimit
from gateway.batching.answer import Answer
from gateway.batching.merged_calls import DEFAULT_DEADLINE_S, MergedCalls, Send, chunks, fail
from gateway.batching.observer import BatchObserver, NullObserver
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import Overloaded

DEFAULT_MAX_SIZE = 32
DEFAULT_MAX_WAIT_MS = 5.0
DEFAULT_SLOTS = 1

Sleep = Callable[[float], Awaitable[None]]


@dataclass(slots=True, eq=False)
class _Caller:
    body: Any
    items: int
    future: asyncio.Future[Answer]
    arrived: float
    group: _Group | None = None


@dataclass(slots=True, eq=False)
class _Slot:
    held: bool = True


@dataclass(slots=True, eq=False)
class _Group:
    key: Hashable
    callers: list[_Caller] = field(default_factory=list)
    items: int = 0
    timer: asyncio.Task[None] | None = None


class Batcher:
    """Merges concurrent ``submit`` calls into array calls to ``send``; see the module doc."""

    def __init__(
        self,
        adapter: Adapter,
        send: Send,
        *,
        name: str = "",
        limit: BatchLimit | None = None,
        max_wait_ms: float = DEFAULT_MAX_WAIT_MS,
        slots: int = DEFAULT_SLOTS,
        observer: BatchObserver | None = None,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Sleep = asyncio.sleep,
        max_in_flight: int | None = None,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        if slots < 1 or max_wait_ms < 0:
            raise ValueError("slots must be >= 1 and max_wait_ms >= 0")
        if max_in_flight is not None and max_in_flight < slots:
            raise ValueError("max_in_flight must be at least slots")
        self.name = name or adapter.name
        self._adapter = adapter
        self._limit: BatchLimit = limit or FixedLimit(DEFAULT_MAX_SIZE)
        self._max_wait_s = max_wait_ms / 1000.0
        self._slots = slots
        self._hold = max_in_flight is not None
        self._depth = max_in_flight or slots
        self._observer: BatchObserver = observer or NullObserver()
        self._clock = clock
        self._calls = MergedCalls(
            adapter,
            send,
            limit=self._limit,
            observer=self._observer,
            clock=clock,
            deadline_s=deadline_s,
        )
        self._sleep = sleep
        self._groups: dict[Hashable, _Group] = {}
        self._in_flight = 0
        self._running: set[asyncio.Task[None]] = set()
        self._idle_call: asyncio.Handle | None = None
        self._closed = False

    @property
    def limit(self) -> int:
        """Items a batch may hold now."""
        return self._limit.limit

    @property
    def in_flight(self) -> int:
        """Batches of this batcher upstream now."""
        return self._in_flight

    @property
    def waiting(self) -> int:
        """Callers waiting for their batch to go."""
        return sum(len(g.callers) for g in self._groups.values())

    @property
    def upstream_calls(self) -> int:
        """Merged calls sent upstream, retries included."""
        return self._calls.upstream_calls

    @property
    def splits(self) -> int:
        """Merged calls answered 4xx and split in halves."""
        return self._calls.splits

    @property
    def oom_backoffs(self) -> int:
        """Merged calls that ran the backend out of memory and lowered the limit."""
        return self._calls.oom_backoffs

    async def submit(self, body: Any, scope: Hashable = ()) -> Answer:
        """Send ``body`` upstream in company and return this caller's share of the answer.

        ``body`` must be ``adapter.batchable``.  Raises what ``send`` raised (foreign errors
        as ``UpstreamUnavailable``), ``BatchSplitError``, or ``Overloaded`` when closed.
        """
        if self._closed:
            raise Overloaded("the batcher is closed", reason="shutdown")
        loop = asyncio.get_running_loop()
        caller = _Caller(body, self._adapter.count(body), loop.create_future(), self._clock.now())
        limit = self._limit.limit
        if self._hold:
            self._queue(caller, (scope, self._adapter.compat_key(body)))
        elif caller.items >= limit:
            self._observer.waited(0.0)
            self._dispatch([caller])
        else:
            self._enqueue(caller, (scope, self._adapter.compat_key(body)), limit)
        try:
            return await caller.future
        except asyncio.CancelledError:
            self._leave(caller)
            raise

    def _enqueue(self, caller: _Caller, key: Hashable, limit: int) -> None:
        group = self._groups.get(key)
        if group is not None and group.items + caller.items > limit:
            self._flush(group)
            group = None
        if group is None:
            group = self._groups[key] = _Group(key)
            group.timer = asyncio.get_running_loop().create_task(self._wait_out(group))
        group.callers.append(caller)
        group.items += caller.items
        caller.group = group
        if group.items >= limit:
            self._flush(group)
        elif self._in_flight < self._slots:
            self._flush_when_idle()

    def _queue(self, caller: _Caller, key: Hashable) -> None:
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = _Group(key)
        group.callers.append(caller)
        group.items += caller.items
        caller.group = group
        self._arm(group)
        if self._in_flight < self._depth:
            self._flush_when_idle()

    def _send_ready(self) -> None:
        """Held: start every batch that may go now, the groups taking turns."""
        now = self._clock.now()
        while self._groups and self._in_flight < self._depth:
            idle = self._in_flight < self._slots
            limit = self._limit.limit
            group = next(
                (
                    g
                    for g in self._groups.values()
                    if idle or g.items >= limit or g.callers[0].arrived + self._max_wait_s <= now
                ),
                None,
            )
            if group is None:
                return
            self._take(group)

    def _take(self, group: _Group) -> None:
        """Send the first callers of ``group`` up to the limit; the rest wait their turn."""
        chunk = chunks(group.callers, self._limit.limit)[0]
        del group.callers[: len(chunk)]
        now = self._clock.now()
        for caller in chunk:
            caller.group = None
            group.items -= caller.items
            self._observer.waited(now - caller.arrived)
        self._drop(group)
        if group.callers:
            self._groups[group.key] = group  # to the back of the line
            self._arm(group)
        self._dispatch(chunk)

    def _arm(self, group: _Group) -> None:
        """Held: wake up when the group's oldest caller has waited ``max_wait_ms``."""
        if group.timer is not None or self._depth == self._slots:
            return  # (with no room past the slots, the wait never sends anything)
        due = group.callers[0].arrived + self._max_wait_s - self._clock.now()
        if due > 0:
            group.timer = asyncio.get_running_loop().create_task(self._wait_out(group, due))

    def _leave(self, caller: _Caller) -> None:
        group = caller.group
        if group is None:
            return
        caller.group = None
        group.callers.remove(caller)
        group.items -= caller.items
        if not group.callers:
            self._drop(group)

    def _drop(self, group: _Group) -> None:
        if self._groups.get(group.key) is group:
            del self._groups[group.key]
        if group.timer is not None:
            group.timer.cancel()
            group.timer = None

    async def _wait_out(self, group: _Group, due_s: float | None = None) -> None:
        await self._sleep(self._max_wait_s if due_s is None else due_s)
        group.timer = None
        if self._groups.get(group.key) is not group:
            return
        if not self._hold:
            self._flush(group)
            return
        self._send_ready()
        if self._groups.get(group.key) is group:
            self._arm(group)

    def _flush_when_idle(self) -> None:
        if self._idle_call is None:
            self._idle_call = asyncio.get_running_loop().call_soon(self._on_idle)

    def _on_idle(self) -> None:
        self._idle_call = None
        if self._hold:
            self._send_ready()
            return
        while self._groups and self._in_flight < self._slots:
            self._flush(next(iter(self._groups.values())))

    def _flush(self, group: _Group) -> None:
        self._drop(group)
        now = self._clock.now()
        for caller in group.callers:
            caller.group = None
            self._observer.waited(now - caller.arrived)
        # The limit may have dropped (AIMD, out of memory) since the group began.
        for chunk in chunks(group.callers, self._limit.limit):
            self._dispatch(chunk)

    def _dispatch(self, callers: list[_Caller]) -> None:
        self._in_flight += 1
        task = asyncio.get_running_loop().create_task(self._run(callers))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, callers: list[_Caller]) -> None:
        slot = _Slot()
        try:
            await self._calls.attempt(callers, release=lambda: self._free(slot))
        finally:
            self._free(slot)

    def _free(self, slot: _Slot) -> None:
        """Give back the batch's slot (once) and send what may go now."""
        if not slot.held:
            return
        slot.held = False
        self._in_flight -= 1
        if self._hold:
            self._send_ready()
        elif self._groups:
            self._flush_when_idle()

    async def aclose(self) -> None:
        """Refuse new callers, fail the waiting ones, and let the batches upstream finish."""
        self._closed = True
        for group in list(self._groups.values()):
            self._drop(group)
            fail(group.callers, Overloaded("the batcher is closed", reason="shutdown"))
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)

    def __repr__(self) -> str:
        waiting = self.waiting
        items = sum(g.items for g in self._groups.values())
        return (
            f"<Batcher {self.name} limit={self.limit}/{self._limit.max_size} "
            f"waiting={waiting} ({items} items, {len(self._groups)} groups) "
            f"in_flight={self._in_flight}/{self._slots} calls={self.upstream_calls} "
            f"splits={self.splits} oom_backoffs={self.oom_backoffs}"
            f"{f' held<={self._depth}' if self._hold else ''}{' closed' if self._closed else ''}>"
        )
