"""Shadow traffic (``routes[].mirror``): a copy of each call a route sends its backend goes to
another backend too, and that backend's answer is read to the end and dropped.  The way to
try a new model version or server on real traffic before a client depends on it.

Which calls are copied: the stage runs after the cache and single flight, so a cache hit and
a coalesced joiner, which never reached a backend, are not, and before batching, so a copy is
one caller's call as the route's backend is asked it (the target model, the usage asked for),
never a merged batch.  A call is copied once its own answer is on its way (a whole body, or
a stream's head) or once its backend failed it (``UpstreamError``).  A call the gateway
refused (a rate limit, a tenant's cap, a full queue, a throttle rule, an open breaker) is
not: a client held back by its limits drives no shadow traffic.

The client never waits for a copy: each runs in a task of its own, at most ``max_in_flight``
per route in each process (one more is not sent, counted as ``shed``).  A copy goes straight
to the mirror backend's endpoints with the original's headers and ``X-Request-ID``, the
mirror backend's own ``headers`` and ``X-Gateway-Mirror: <route>`` (a client's own is never
passed on), and to a backend with ``upstream_priority: vllm`` at vLLM's lowest priority,
whatever the client's body asked.  A copy is held to that backend's limits, which guard the
routes it serves itself, and never waits for them: it needs a free slot under its
``max_concurrency`` that no queued call waits for, held till the copy ends, and none is
sent while a throttle rule sheds or reroutes the backend or its breaker is not closed
(``resilience.guard.BackendGuard.spare``; not sent, counted as ``no_room``).  So shadow
traffic never takes a slot a served call needs, nor adds load to a GPU a rule protects.
``max_in_flight`` bounds its load besides.  A reload that changes the mirror, and
shutdown, cancel the copies in flight.

A deterministic call's two answers are compared (``compare.py``), streams too, once both
have ended whole (the client's is recorded as it passes, at most ``MAX_COMPARED_BYTES``):
whether the mirror said
the same, ids, times, model names and token counts aside, is counted in
``gateway_mirror_comparisons_total{route, backend, result}``, and a difference logged (at
most every ``DIFFERENCE_LOG_EVERY_S``) with the request's id, under which both servers
logged it.  Counted in ``gateway_mirror_requests_total{route, backend, outcome}``, timed
whole in ``gateway_mirror_duration_seconds``, and in flight in ``gateway_mirror_in_flight``;
with the access log on, each copy writes its own line (``"kind": "mirror"``, the original's
``id``) once answered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import random
import sys
from collections.abc import Callable
from typing import Any

from gateway.cache.replies import Tee
from gateway.clock import Clock
from gateway.errors import GatewayError, UpstreamError
from gateway.metrics import Metrics
from gateway.metrics.children import Counted
from gateway.mirror.compare import (
    MAX_COMPARED_BYTES,
    agree,
    assembled,
    comparable,
    comparable_stream,
)
from gateway.openai import vllm_priority as vllm
from gateway.openai.body import dumps_yielding
from gateway.pipeline import Call, Handler, Reply, Spare, Stage, unbounded
from gateway.policy.mirror import Mirror
from gateway.policy.model import Policy
from gateway.policy.show import redact_url
from gateway.resilience.stage import GUARDS
from gateway.runtime import Runtime
from gateway.state import Kind
from gateway.transport.forward import Forward

log = logging.getLogger("gateway.mirror")
MIRROR_HEADER = "X-Gateway-Mirror"
ERROR_LOG_EVERY_S = 60.0
DIFFERENCE_LOG_EVERY_S = 10.0
SHED = "shed"
NO_ROOM = "no_room"
ERROR = "error"


class Shadow:
    """One route's copies: which calls are drawn, where they go, and those in flight."""

    def __init__(
        self,
        route: str,
        mirror: Mirror,
        forward: Handler,
        metrics: Metrics,
        clock: Clock,
        draw: Callable[[], float] = random.random,
        room: Spare | None = None,
    ) -> None:
        self._route = route
        self._room = room  # the mirror backend's leave for one more call (its guard's)
        self._mirror = mirror
        self._forward = forward
        self._clock = clock
        self._draw = draw
        self._tasks: set[asyncio.Task[None]] = set()
        self._draining = False
        self._last_error_log = self._last_difference_log = -math.inf
        compared = metrics.mirror_comparisons
        self._compared = {
            True: compared.labels(route, mirror.backend, "same"),
            False: compared.labels(route, mirror.backend, "different"),
        }
        self._outcomes = Counted(metrics.mirror_requests, route, mirror.backend)
        self._duration = metrics.mirror_duration.labels(route, mirror.backend)
        self._in_flight = metrics.mirror_in_flight.labels(route)
        self._in_flight.set(0)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def copy(self, call: Call, answered: Reply | None = None) -> Reply | None:
        """Send a copy of ``call`` to the mirror backend, if it is drawn and there is room;
        its answer is compared with ``answered``'s, the route's backend's, where they can
        be (``compare.comparable``, ``comparable_stream``).  Returns ``answered``, its
        stream recorded as it passes where it is compared."""
        mirror = self._mirror
        if self._draining or (mirror.fraction < 1 and self._draw() >= mirror.fraction):
            return answered
        if len(self._tasks) >= mirror.max_in_flight:
            self._outcomes.inc(SHED)
            return answered
        release = self._room() if self._room is not None else None
        if self._room is not None and release is None:
            self._outcomes.inc(NO_ROOM)
            return answered
        original: Original = None
        if answered is not None and comparable_stream(call, answered):
            original, answered = _recorded(answered)
        elif answered is not None:
            original = comparable(call, answered)
        task = asyncio.get_running_loop().create_task(
            self._send(call, original, release or unbounded)
        )
        self._tasks.add(task)
        self._in_flight.set(len(self._tasks))
        task.add_done_callback(self._done)
        return answered

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._in_flight.set(len(self._tasks))

    async def _send(self, call: Call, original: Original, release: Callable[[], None]) -> None:
        started = self._clock.now()
        logged = call.record is not None and call.record.logged
        try:
            try:
                reply = await self._forward(await self._copy_of(call))
                body = await _read_whole(reply, keep=original is not None)
            finally:
                release()  # the mirror's slot: not held while the client's stream goes on
        except asyncio.CancelledError:
            raise  # a reload or shutdown: not the mirror's answer
        except Exception as exc:
            self._outcomes.inc(ERROR)
            self._failed(exc)
            if logged:
                self._log(call, started, None, {"error": getattr(exc, "code", "error")})
            return
        self._duration.observe(self._clock.now() - started)
        self._outcomes.inc(f"{reply.status // 100}xx")
        same = None
        if original is not None and reply.status == 200 and body is not None:
            if isinstance(original, asyncio.Future):  # the client's stream, once it ended
                original, body = await original, assembled(data=body)
            if original is not None and body is not None:
                same = self._compare(call, original, body)
        if logged:
            self._log(call, started, reply, {} if same is None else {"mirror_same": same})

    def _log(self, call: Call, started: float, reply: Reply | None, more: dict[str, Any]) -> None:
        """The copy's access-log line, beside its original's (the same ``id``)."""
        entry: dict[str, Any] = {
            "ts": round(self._clock.wall(), 3),
            "id": call.id,
            "kind": "mirror",
            "method": call.method,
            "path": call.path,
            "route": self._route,
            "backend": self._mirror.backend,
            "status": reply.status if reply is not None else 0,
            "duration_ms": round((self._clock.now() - started) * 1000, 3),
        }
        if call.tenant:
            entry["tenant"] = call.tenant
        if reply is not None and reply.endpoint:
            entry["endpoint"] = redact_url(reply.endpoint)  # never a URL's credentials
        sys.stderr.write(json.dumps({**entry, **more}) + "\n")

    def _compare(self, call: Call, original: bytes, copied: bytes) -> bool | None:
        """Whether the two answers agree (None: they cannot be compared), counted."""
        same = agree(original, copied)
        if same is None:
            return None
        self._compared[same].inc()
        now = self._clock.now()
        if not same and now - self._last_difference_log >= DIFFERENCE_LOG_EVERY_S:
            self._last_difference_log = now
            log.info(
                "route %s: mirror %s answered request %s otherwise than %s",
                self._route,
                self._mirror.backend,
                call.id,
                call.backend,
            )
        return same

    async def _copy_of(self, call: Call) -> Call:
        mirror = self._mirror
        changes: dict[str, Any] = {
            "backend": mirror.backend,
            "headers": (*call.headers, (MIRROR_HEADER, self._route)),
            "pin": None,  # the original's endpoint is the route backend's, not the mirror's
            "record": None,
            "verdict": None,
        }
        if mirror.model is not None and call.json is not None:
            asked = {**call.json, "model": mirror.model}
            changes["json"] = asked
            changes["body"] = await dumps_yielding(asked, len(call.body))
        copy = dataclasses.replace(call, **changes)
        if call.policy.backend(mirror.backend).upstream_priority == "vllm":
            copy = await vllm.with_priority(copy, vllm.LOW)  # never the client's, nor above
        return copy

    def _failed(self, exc: Exception) -> None:
        now = self._clock.now()
        if now - self._last_error_log < ERROR_LOG_EVERY_S:
            return
        self._last_error_log = now
        if isinstance(exc, GatewayError):
            log.warning("route %s: mirror %s failed: %s", self._route, self._mirror.backend, exc)
        else:
            log.exception("route %s: mirror %s failed", self._route, self._mirror.backend)

    def drain(self) -> None:
        """Shutdown has begun: copy nothing more."""
        self._draining = True

    async def aclose(self) -> None:
        """Cancel the copies in flight (a reload that changed the mirror, or shutdown)."""
        self._draining = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def __repr__(self) -> str:
        m = self._mirror
        return (
            f"<Shadow {self._route} -> {m.backend} in_flight={len(self._tasks)}/"
            f"{m.max_in_flight} fraction={m.fraction:g}{' draining' if self._draining else ''}>"
        )


SHADOWS: Kind[Shadow] = Kind("mirror")


Original = bytes | asyncio.Future[bytes | None] | None
"""The answer a copy's is compared with: a whole body, a stream's assembled answer once it
has ended (None: cut, or too long), or none."""


def _recorded(reply: Reply) -> tuple[asyncio.Future[bytes | None], Reply]:
    """``reply``, its stream recorded as it passes, and the answer it assembles into once it
    has ended (None when it was cut, left by its client or too long)."""
    assert reply.stream is not None
    ended: asyncio.Future[bytes | None] = asyncio.get_running_loop().create_future()

    def settle(answer: bytes | None) -> None:
        if not ended.done():
            ended.set_result(answer)

    async def recorded(events: tuple[str, ...] | None, body: bytes | None) -> None:
        settle(assembled(events))

    tee = Tee(reply.stream, events=True, on_complete=recorded, max_bytes=MAX_COMPARED_BYTES)
    return ended, reply.replace(stream=tee).when_done(lambda: settle(None))


async def _read_whole(reply: Reply, keep: bool = False) -> bytes | None:
    """Read ``reply`` to its end, then release it: its body, or when ``keep`` its stream's
    bytes up to ``MAX_COMPARED_BYTES`` (None past them; without ``keep``, the chunks are
    dropped as they come)."""
    kept: bytearray | None = bytearray() if keep else None
    try:
        if reply.stream is not None:
            async for chunk in reply.stream:
                if kept is not None:
                    kept += chunk
                    if len(kept) > MAX_COMPARED_BYTES:
                        kept = None
    finally:
        if reply.close is not None:
            await reply.close()
    if reply.stream is None:
        return reply.body
    return bytes(kept) if kept is not None else None


class MirrorStage:
    """Copies each call its route sends upstream to the route's mirror backend."""

    def __init__(self, shadows: dict[str, Shadow]) -> None:
        self._shadows = shadows

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        shadow = self._shadows.get(call.route.name)
        if shadow is None:
            return await call_next(call)
        try:
            reply = await call_next(call)
        except UpstreamError:
            shadow.copy(call)  # the backend was asked: its mirror is asked too
            raise
        return shadow.copy(call, reply) or reply

    def __repr__(self) -> str:
        return f"<MirrorStage {sorted(self._shadows)}>"


def build(policy: Policy, runtime: Runtime) -> list[Stage]:
    """The mirror stage for ``policy``, or none when no route mirrors."""
    forward = Forward(runtime.transport)
    registry = runtime.registry

    def shadow_of(route: str, mirror: Mirror) -> Shadow:
        def room() -> Callable[[], None] | None:
            guard = registry.peek(GUARDS, mirror.backend)  # none: nothing limits its calls
            return guard.spare() if guard is not None else unbounded

        return registry.get(
            SHADOWS,
            route,
            mirror,
            lambda: Shadow(route, mirror, forward, runtime.metrics, runtime.clock, room=room),
        )

    shadows = {r.name: shadow_of(r.name, r.mirror) for r in policy.routes if r.mirror is not None}
    return [MirrorStage(shadows)] if shadows else []
