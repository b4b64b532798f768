"""Hedged requests (``backends.<name>.hedge``): a call one endpoint has not answered in time
is sent to a second endpoint as well, and the first good answer wins.

Which calls: those that change nothing on the backend (``upstream.resendable`` without
its ``Idempotency-Key``: inference calls and safe methods; a POST with a key may be sent
twice one after the other, but two replicas running it at once may both act on it) that
name no one endpoint (``Call.pin``): whole answers (``answers``) on their answer, streams
(``streams``) on their first chunk, since a stream's head may come before its first token
and says nothing of how slow it is.  A stream's first chunk comes once the model server
has read the prompt and made the first token, so a hedged stream costs one more prefill:
the other call is cancelled at the winner's first chunk.  When: after ``after_ms``, or the
``percentile`` of the backend's recent answer times, or of its streams' first chunks (the
first endpoint's, timed whether its call won or lost), or at once when the first endpoint
failed to connect (what an unhedged call does too).  How often: each call earns
``max_ratio`` of a hedge, each hedge spends one, and at most ``MAX_SAVED`` are saved up (as
many to start with), so a backend slow for everyone is not sent much more than its load.
Where: the balanced pick among the other endpoints, never an ejected or throttled one, nor
one refusing calls.  Room: a hedge is a call in flight like any other, so it needs a free
slot under the backend's ``max_concurrency`` that no queued call is waiting for, and none
is made while a throttle rule sheds or reroutes the backend or its breaker is not closed
(``Call.spare``; ``no_room`` otherwise): the cap a GPU is protected by holds, hedges
included, and a hedge never goes before a call that waits.

The race: the first answer below 500 wins and the other call is cancelled (its connection
closed, so the model server sees its client leave and stops generating); an answer of 500 or
more, or an error, waits for the other call, and when both fail the first endpoint's
failure is the answer (an answer rather than an error where there is one).  Counted in
``gateway_hedges_total{backend, kind, outcome}``; the delay in use is
``gateway_hedge_delay_seconds{backend, kind}``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import TypeVar

from gateway.metrics import Metrics
from gateway.pipeline import Reply, Spare, unbounded
from gateway.policy.hedge import Hedge
from gateway.policy.model import Backend
from gateway.transport import load
from gateway.transport.endpoint import Endpoint

WINDOW = 256
"""Answer times kept per backend for the percentile."""
MIN_SAMPLES = 32
"""Answer times needed before a percentile delay is trusted (no hedging before)."""
RECOMPUTE_EVERY = 16
"""New answer times between two computations of the percentile."""
MAX_SAVED = 10.0
"""Hedges saved up at most by a quiet backend."""
OUTCOMES = ("won", "lost", "budget", "no_endpoint", "no_room")
KINDS = ("answer", "stream")
_CLOSING: set[asyncio.Future[None]] = set()

E = TypeVar("E")


def hedgeable(backend: Backend, streaming: bool, pinned: bool, inert: bool) -> Hedge | None:
    """The backend's ``hedge`` when this call may be hedged: its kind is hedged (``answers``,
    ``streams``), it changes nothing (``inert``: ``upstream.resendable`` without its
    ``Idempotency-Key``), it is not pinned to one endpoint."""
    hedge = backend.hedge
    if hedge is None or pinned or not inert:
        return None
    return hedge if (hedge.streams if streaming else hedge.answers) else None


def hedge_target(second: Endpoint, first: Endpoint, backend: Backend, now: float) -> bool:
    """Whether ``second`` (the pick among the others) may take a hedge of ``first``'s call:
    another endpoint, not ejected, no throttle rule firing on it, not being warmed
    (``joining.py``), not refusing calls (``calls.py``), (``kv_aware``) not saturated."""
    if second is first or second.ejected_until or second.throttled or second.warming:
        return False
    if second.refused_until > now:
        return False
    return backend.balance != "kv_aware" or not load.saturated(second, backend)


class Window:
    """The recent answer (or first-chunk) times of one kind of call, and their percentile."""

    def __init__(self) -> None:
        self.times: deque[float] = deque(maxlen=WINDOW)
        self._fresh = 0
        self._percentile_s: float | None = None
        self._for: float | None = None  # the percentile it was computed for

    def percentile_s(self, percentile: float) -> float | None:
        if self._for != percentile:
            self._for, self._fresh = percentile, RECOMPUTE_EVERY
        if self._fresh >= RECOMPUTE_EVERY and len(self.times) >= MIN_SAMPLES:
            ordered = sorted(self.times)
            at = min(len(ordered) - 1, int(len(ordered) * percentile / 100))
            self._percentile_s, self._fresh = ordered[at], 0
        return self._percentile_s

    def timed(self, seconds: float) -> None:
        self.times.append(seconds)
        self._fresh += 1


class Hedger:
    """One backend's hedging: its recent answer times, its budget, and the race."""

    def __init__(self, backend: str, metrics: Metrics) -> None:
        self.windows = {kind: Window() for kind in KINDS}
        self.saved = MAX_SAVED  # hedges it may send before its calls have earned any
        self._counted = {
            (k, o): metrics.hedges.labels(backend, k, o) for k in KINDS for o in OUTCOMES
        }
        self._delay = {kind: metrics.hedge_delay.labels(backend, kind) for kind in KINDS}

    def delay_s(self, hedge: Hedge, kind: str) -> float | None:
        """How long the first endpoint has; None: not known yet (no hedge)."""
        if hedge.after_ms is not None:
            delay: float | None = hedge.after_ms / 1000
        else:
            delay = self.windows[kind].percentile_s(hedge.percentile)
        if delay is not None:
            self._delay[kind].set(delay)
        return delay

    async def send(
        self,
        hedge: Hedge,
        first: E,
        attempt: Callable[[E], Awaitable[Reply]],
        another: Callable[[E], E | None],
        streaming: bool = False,
        spare: Spare | None = None,
    ) -> Reply:
        """``attempt(first)``, hedged by ``attempt(another(first))`` when it is slow: to its
        answer, or (``streaming``) to its first chunk.  ``spare`` (``Call.spare``) gives the
        hedge its room under the backend's limits for the race, or refuses it."""
        self.saved = min(MAX_SAVED, self.saved + hedge.max_ratio)
        kind = "stream" if streaming else "answer"
        if streaming:
            attempt = to_first_chunk(attempt)
        window = self.windows[kind]
        loop = asyncio.get_running_loop()
        started = loop.time()
        primary = asyncio.ensure_future(attempt(first))

        def timed(task: asyncio.Future[Reply]) -> None:
            # an answer, or a call slower than the answer it lost to; not a quick refusal
            if task.cancelled() or (_good(task) and task.result().status != 429):
                window.timed(loop.time() - started)

        primary.add_done_callback(timed)
        delay = self.delay_s(hedge, kind)
        try:
            if delay is not None:
                await asyncio.wait({primary}, timeout=delay)
            if delay is None or primary.done():  # answered, or failed as unhedged calls do
                return await primary
            if self.saved < 1:
                self._counted[kind, "budget"].inc()
                return await primary
            second = another(first)
            if second is None:
                self._counted[kind, "no_endpoint"].inc()
                return await primary
            release = spare() if spare is not None else unbounded
            if release is None:
                self._counted[kind, "no_room"].inc()
                return await primary
        except BaseException:
            _drop((primary,))
            raise
        self.saved -= 1
        backup = asyncio.ensure_future(attempt(second))
        try:
            return await self._race(primary, backup, kind)
        finally:
            release()  # one call goes on: the first's own slot holds it

    async def _race(
        self, primary: asyncio.Future[Reply], backup: asyncio.Future[Reply], kind: str
    ) -> Reply:
        both = (primary, backup)
        try:
            while not all(t.done() for t in both):
                running = [t for t in both if not t.done()]
                await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                winner = next((t for t in both if t.done() and _good(t)), None)
                if winner is not None:
                    outcome = "won" if winner is backup else "lost"
                    self._counted[kind, outcome].inc()
                    _drop(t for t in both if t is not winner)
                    return winner.result().replace(hedged=outcome)
        except BaseException:
            _drop(both)
            raise
        # both failed: the first endpoint's answer, else the second's, else the first's error
        chosen = next((t for t in both if not t.cancelled() and t.exception() is None), primary)
        outcome = "won" if chosen is backup else "lost"
        self._counted[kind, outcome].inc()
        _drop(t for t in both if t is not chosen)
        return chosen.result().replace(hedged=outcome)


def to_first_chunk(attempt: Callable[[E], Awaitable[Reply]]) -> Callable[[E], Awaitable[Reply]]:
    """``attempt``, done once a streamed answer's first chunk is in (a whole answer, an error
    status: at once); the reply's stream starts with that chunk."""

    async def first_chunk(endpoint: E) -> Reply:
        reply = await attempt(endpoint)
        if reply.stream is None or reply.status >= 300:
            return reply
        try:
            first = await anext(reply.stream, None)
        except BaseException:
            if reply.close is not None:
                await reply.close()
            raise
        return reply.replace(stream=_starting(first, reply.stream))

    return first_chunk


async def _starting(first: bytes | None, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    if first is None:
        return
    yield first
    async for chunk in rest:
        yield chunk


def _good(task: asyncio.Future[Reply]) -> bool:
    """A call that answered below 500 (a done, uncancelled task)."""
    return not task.cancelled() and task.exception() is None and task.result().status < 500


def _drop(tasks: Iterable[asyncio.Future[Reply]]) -> None:
    """Cancel the calls that are not the answer (a cancelled call closes its connection);
    an answer one of them has, or gets despite its cancellation, is closed."""
    for task in tasks:
        task.cancel()
        task.add_done_callback(_close_answer)


def _close_answer(task: asyncio.Future[Reply]) -> None:
    if task.cancelled() or task.exception() is not None:
        return  # the exception is retrieved: nothing is logged for a dropped call
    close = task.result().close
    if close is not None:
        closing = asyncio.ensure_future(close())
        _CLOSING.add(closing)
        closing.add_done_callback(_CLOSING.discard)
