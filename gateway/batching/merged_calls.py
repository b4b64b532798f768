"""A batcher's merged calls upstream, and each caller's share of what comes back.

Failures of a merged call are the batcher's to sort out, so that a caller sees what it would
have seen alone:

- 2xx: the answer is split by the adapter.
- out of memory (507, or a 5xx whose body says out of memory / OOM): the limit drops to half
  the failed batch's items for good (``BatchLimit.backoff_to``) and the callers are retried
  in chunks of the new limit, one chunk after another.  A lone caller gets the answer as is.
- a bad input: 4xx other than 408/429, 5xx other than 503 and out of memory (MLServer and
  KServe answer 500 to a malformed row), or a 2xx that cannot be split: the callers are
  split in halves, retried concurrently, and so on down to single callers, so a poison input
  fails only its own request, with the upstream's own status and body.  A batch of one gets
  its answer as is; one that cannot be split, ``BatchSplitError``.  The bisection of one
  batch is bounded (``bisect_budget``: about 2 log2 n extra calls, what one bad input
  costs; and within ``deadline_s`` of the batch's first call); past either bound, the
  callers still failing get the failure they were in.  408, 429 and 503 say nothing about
  the inputs and are not bisected.
- any other status, and transport errors: every caller of that call gets the same.

A caller whose future is already done (it went away) is left out of a call, and an answer
that comes for it later is dropped.

Every call of one batch (the merged call, its halves, the callers alone) carries one
``Verdict``: the breaker holds their 5xx until the batch is over, and then counts them only
if they were the backend's.  They were a caller's input when the bisection left callers
answered and at most as many failed as were answered (one bad row among twelve: the
eleven's answers prove the backend well); with none answered they were the backend's.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar

from gateway.batching.adapters import Adapter
from gateway.batching.aimd import BatchLimit
from gateway.batching.answer import Answer, as_is, split_answer
from gateway.batching.observer import BatchObserver
from gateway.clock import Clock
from gateway.errors import BatchSplitError, GatewayError, Overloaded, UpstreamUnavailable
from gateway.pipeline import Headers, Verdict

NOT_BISECTED = frozenset({408, 429, 503})
SPLIT_REASONS = ("4xx", "5xx", "unsplittable")
OOM_PATTERN = re.compile(rb"out of memory|outofmemory|\boom\b", re.IGNORECASE)
OOM_SCAN_BYTES = 8192
DEFAULT_DEADLINE_S = 120.0
"""How long after a batch's first call its bisection may go on (the backend's timeout)."""


def bisect_budget(callers: int) -> int:
    """Extra calls a batch of ``callers`` may make to isolate bad inputs: two per halving,
    what one bad input costs (``2 * ceil(log2 n)``)."""
    return 2 * max(0, (callers - 1).bit_length())


class _Bisection:
    """The bounds of one batch's bisection: extra calls left, and its deadline; and the
    verdict its calls' failures wait for."""

    __slots__ = ("calls_left", "deadline", "verdict")

    def __init__(self, calls_left: int, deadline: float) -> None:
        self.calls_left = calls_left
        self.deadline = deadline
        self.verdict = Verdict()


Send = Callable[[Any, Verdict], Awaitable[tuple[int, Headers, bytes]]]


class Caller(Protocol):
    """What a merged call needs of one of its callers."""

    body: Any
    items: int
    future: asyncio.Future[Answer]


C = TypeVar("C", bound=Caller)


class MergedCalls:
    """Sends a batcher's merged calls to ``send`` and answers their callers; see the module doc.

    ``limit`` and ``observer`` are the batcher's own: what the calls learn (latency, out of
    memory) moves the limit the batcher cuts its batches at.
    """

    def __init__(
        self,
        adapter: Adapter,
        send: Send,
        *,
        limit: BatchLimit,
        observer: BatchObserver,
        clock: Clock,
        deadline_s: float = DEFAULT_DEADLINE_S,
    ) -> None:
        self._adapter = adapter
        self._send = send
        self._limit = limit
        self._observer = observer
        self._clock = clock
        self.deadline_s = deadline_s
        self.upstream_calls = 0
        self.splits = 0
        self.oom_backoffs = 0

    async def attempt(
        self, callers: Sequence[Caller], release: Callable[[], None] | None = None
    ) -> None:
        """One merged call for ``callers``, with its retries; every caller gets its answer.

        ``release`` is called once the backend has answered a 2xx, before the answer is split.
        """
        await self._attempt(callers, release, None)

    async def _attempt(
        self,
        callers: Sequence[Caller],
        release: Callable[[], None] | None,
        bisection: _Bisection | None,
    ) -> None:
        live = [c for c in callers if not c.future.done()]
        if not live:
            return
        owner = bisection is None
        if bisection is None:
            bisection = _Bisection(bisect_budget(len(live)), self._clock.now() + self.deadline_s)
        try:
            await self._call(live, release, bisection)
        except asyncio.CancelledError:
            fail(live, Overloaded("the batcher is closed", reason="shutdown"))
            raise
        except GatewayError as exc:
            fail(live, exc)
        except Exception as exc:  # a bug must not leave callers waiting forever
            error = GatewayError(f"batching failed: {exc!r}")
            error.__cause__ = exc
            fail(live, error)
        finally:
            if owner:
                bisection.verdict.rule(_backends_fault(live))

    async def _call(
        self, live: list[Caller], release: Callable[[], None] | None, bisection: _Bisection
    ) -> None:
        bodies = [c.body for c in live]
        items = sum(c.items for c in live)
        merged = self._adapter.merge(bodies)
        self.upstream_calls += 1
        self._observer.batch_sent(items)
        started = self._clock.now()
        try:
            status, headers, raw = await self._send(merged, bisection.verdict)
        except GatewayError:
            raise
        except Exception as exc:
            raise UpstreamUnavailable(f"batched call failed: {exc!r}") from exc
        if 200 <= status < 300:
            self._observe(self._clock.now() - started, items)
            if release is not None:
                release()  # the backend is done: the next batch goes before this one splits
            try:
                shares = split_answer(self._adapter, status, raw, bodies)
            except BatchSplitError:
                if not await self._bisect(live, "unsplittable", bisection):
                    raise
                return
            for caller, share in zip(live, shares, strict=True):
                _resolve(caller, Answer(status, share))
        elif _out_of_memory(status, raw) and len(live) > 1:
            self._back_off(items)
            rest = live
            while rest:  # one chunk at a time, each cut at the limit as it is by then
                chunk = chunks(rest, self._limit.limit)[0]
                rest = rest[len(chunk) :]
                await self._attempt(chunk, None, None)
        elif _bad_input(status, raw) and await self._bisect(
            live, "4xx" if status < 500 else "5xx", bisection
        ):
            return
        else:
            if _out_of_memory(status, raw):
                self._back_off(items)
            answer = as_is(status, headers, raw)
            for caller in live:
                _resolve(caller, answer)

    async def _bisect(self, live: list[Caller], reason: str, bisection: _Bisection) -> bool:
        """Retry ``live`` in two halves, if it can be split and the bounds allow."""
        if len(live) < 2 or bisection.calls_left < 2 or self._clock.now() >= bisection.deadline:
            return False
        bisection.calls_left -= 2
        self.splits += 1
        self._observer.split(reason)
        half = len(live) // 2
        await asyncio.gather(
            self._attempt(live[:half], None, bisection),
            self._attempt(live[half:], None, bisection),
        )
        return True

    def _observe(self, latency_s: float, items: int) -> None:
        before = self._limit.limit
        self._limit.observe(latency_s, items)
        if self._limit.limit != before:
            self._observer.limit_changed(self._limit.limit)

    def _back_off(self, items: int) -> None:
        self.oom_backoffs += 1
        self._observer.oom_backoff()
        before = self._limit.limit
        self._limit.backoff_to(max(1, items // 2))
        if self._limit.limit != before:
            self._observer.limit_changed(self._limit.limit)

    def __repr__(self) -> str:
        return (
            f"<MergedCalls {self._adapter.name} calls={self.upstream_calls} "
            f"splits={self.splits} oom_backoffs={self.oom_backoffs}>"
        )


def chunks(callers: list[C], limit: int) -> list[list[C]]:
    """Consecutive runs of callers of at most ``limit`` items (a bigger caller runs alone)."""
    runs: list[list[C]] = []
    items = 0
    for caller in callers:
        if runs and items + caller.items <= limit:
            runs[-1].append(caller)
            items += caller.items
        else:
            runs.append([caller])
            items = caller.items
    return runs


def fail(callers: Sequence[Caller], exc: BaseException) -> None:
    """Fail every caller that is still waiting with ``exc``."""
    for caller in callers:
        if not caller.future.done():
            caller.future.set_exception(exc)


def _backends_fault(callers: Sequence[Caller]) -> bool:
    """Whether the batch's failures were the backend's: not when callers were answered and
    at most as many failed (a 5xx, or an error) as were answered."""
    answered = failed = 0
    for caller in callers:
        future = caller.future
        if not future.done() or future.cancelled():
            continue
        if future.exception() is not None or future.result().status >= 500:
            failed += 1
        else:
            answered += 1
    return not (answered and failed <= answered)


def _resolve(caller: Caller, answer: Answer) -> None:
    if not caller.future.done():
        caller.future.set_result(answer)


def _bad_input(status: int, raw: bytes) -> bool:
    """A status that may come from one bad input of the batch."""
    if status in NOT_BISECTED or _out_of_memory(status, raw):
        return False
    return 400 <= status < 600


def _out_of_memory(status: int, raw: bytes) -> bool:
    return status == 507 or (status >= 500 and bool(OOM_PATTERN.search(raw[:OOM_SCAN_BYTES])))
