"""The data plane's HTTP/1.1 server: its listening sockets, the client connections they
accepted (``connection``), what those connections share, and the drain.

Shared across connections:

- ``max_connections``: at the limit, the connection idle longest in keep-alive is closed to
  make room (nginx reuses such connections the same way); with none idle the new connection
  is accepted and closed at once, counted in
  ``gateway_refused_connections_total{reason="max_connections"}`` (as Envoy's global
  downstream connection limit does).  A closed connection is one the openai SDK and the JDK
  clients retry; a backlog would hold such clients silently.
- ``max_buffered_body_bytes``: the bytes of every request body held, from its first byte
  until its answer is done.
- the counts behind ``gateway_connections{state}`` and ``gateway_client_timeouts_total``.

The drain (``drain``): stop listening, close idle connections, answer everything still in
progress with ``Connection: close``; when the grace period is over, end each request with
an answer (a 503, or an error event that ends a stream), then close what is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from gateway.metrics import Metrics
from gateway.policy.model import Server as Limits
from gateway.server.connection import ClientConnection
from gateway.server.request import Request
from gateway.server.turns import Turns

log = logging.getLogger("gateway.server.listener")

Handler = Callable[[Request], Awaitable[None]]
INTERRUPT_S = 0.5
"""After the grace: how long the requests cut short have to write their last word."""
STALL_S = 1.0
"""How far behind (a body's pace, a head's arrival) a connection is before the server may
cut it to make room for others."""
RESCAN_S = 0.1
"""After a search for a stalled connection found none, how long the next waits: a flood of
new connections or bodies at the limit must not cost a scan of every connection each."""


class HttpServer:
    """Client connections of the data plane, served by ``handler``."""

    def __init__(self, handler: Handler, limits: Callable[[], Limits], metrics: Metrics) -> None:
        self.loop = asyncio.get_running_loop()
        self.handler = handler
        self.limits = limits
        self.draining = False
        self.cutting = False
        self.body_bytes = 0
        self._metrics = metrics
        self._connections: set[Turns] = set()
        self._idle: dict[Turns, None] = {}
        self._listeners: list[asyncio.Server] = []
        self._timeouts = {
            phase: metrics.client_timeouts.labels(phase)
            for phase in ("head", "body", "idle", "send")
        }
        self._refused = metrics.refused_connections.labels("max_connections")
        self._emptied: asyncio.Event | None = None
        self._none_stalled_until = 0.0
        metrics.connections.states = self.states

    async def listen(
        self, host: str, port: int, *, backlog: int = 1024, reuse_port: bool = False
    ) -> tuple[str, int]:
        """Start accepting on ``host``:``port``; the address bound (port 0 picks one).  With
        ``reuse_port`` the socket shares the port with other processes' (``SO_REUSEPORT``:
        the workers of ``gateway serve --workers N``; the kernel spreads connections)."""
        listener = await self.loop.create_server(
            lambda: ClientConnection(self),
            host,
            port,
            backlog=backlog,
            reuse_address=True,
            reuse_port=reuse_port or None,
        )
        self._listeners.append(listener)
        bound = listener.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    # -- connections ---------------------------------------------------------------------------
    def admit(self, conn: Turns) -> bool:
        """Whether a new connection may stay (closing the longest-idle one to make room)."""
        if self.draining:
            return False
        if len(self._connections) >= self.limits().max_connections:
            if self._idle:
                oldest = next(iter(self._idle))
                del self._idle[oldest]
                oldest.close()
            elif not self._cut_most_stalled():
                self._refused.inc()
                return False
        self._connections.add(conn)
        return True

    def forget(self, conn: Turns) -> None:
        self._connections.discard(conn)
        self._idle.pop(conn, None)
        if self._emptied is not None and not self._connections:
            self._emptied.set()

    def idle(self, conn: Turns) -> None:
        """``conn`` waits in keep-alive; when draining, only ``LAST_CALL_S`` (its answer's
        head went out before the drain, so its client may be sending its next request)."""
        if self.draining:
            return
        self._idle.pop(conn, None)
        self._idle[conn] = None

    def busy(self, conn: Turns) -> None:
        self._idle.pop(conn, None)

    def timed_out(self, phase: str) -> None:
        self._timeouts[phase].inc()

    def answered_refusal(self, status: int) -> None:
        """A request refused before the edge saw it: counted like any answer, routeless."""
        self._metrics.count_request("", "", status)

    def _cut_most_stalled(self) -> bool:
        """Close the connection most stalled (a head, or a body behind its pace), if one
        is stalled ``STALL_S`` or more, to make room for a new one."""
        if not self._may_scan():
            return False
        worst, stall = None, STALL_S
        for conn in self._connections:
            behind = max(conn.head_stall_s(), conn.body_stall_s())
            if behind >= stall and not conn.closing:
                worst, stall = conn, behind
        if worst is None:
            self._none_stalled_until = self.loop.time() + RESCAN_S
            return False
        worst.cut_stalled("the request arrived too slowly while others waited for a connection")
        return True

    def _may_scan(self) -> bool:
        return self.loop.time() >= self._none_stalled_until

    # -- request bodies --------------------------------------------------------------------------
    def reserve(self, size: int, conn: Turns) -> bool:
        """Hold ``size`` more body bytes for ``conn``, if the shared budget allows (after
        cutting stalled uploads that hold more than their share)."""
        limit = self.limits().max_buffered_body_bytes
        if self.body_bytes + size > limit and not self._make_room(size, conn, limit):
            return False
        self.body_bytes += size
        return True

    def _make_room(self, size: int, requester: Turns, limit: int) -> bool:
        if not self._may_scan():
            return False
        holders = [c for c in self._connections if c is not requester and c.held_bytes()]
        fair = limit / (len(holders) + 1)
        stalled = [c for c in holders if c.held_bytes() > fair and c.body_stall_s() >= STALL_S]
        stalled.sort(key=lambda c: c.body_stall_s(), reverse=True)
        for conn in stalled:
            conn.cut_stalled("the request body arrived too slowly for the buffer room it held")
            if self.body_bytes + size <= limit:
                return True
        if not stalled:
            self._none_stalled_until = self.loop.time() + RESCAN_S
        return False

    def release(self, size: int) -> None:
        self.body_bytes -= size

    # -- state and shutdown ----------------------------------------------------------------------
    def states(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for conn in self._connections:
            state = conn.state
            counts[state] = counts.get(state, 0) + 1
        return counts

    def stop_listening(self) -> None:
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; let what is in progress finish within ``grace_s``; then end the
        rest, every request answered (``ClientConnection.interrupt``), and close."""
        self.draining = True
        self.stop_listening()
        for conn in list(self._idle):
            conn.close()
        self._idle.clear()
        for conn in list(self._connections):
            if conn.requests == 0:
                conn.close()  # connected, but never asked for anything
        if not await self._emptied_within(grace_s):
            log.warning(
                "shutdown grace of %g s ran out; ending %d connections",
                grace_s,
                len(self._connections),
            )
            self.cutting = True
            for conn in list(self._connections):
                conn.interrupt()
            await self._emptied_within(INTERRUPT_S)
        for conn in list(self._connections):
            conn.close(abort=True)
        await self._emptied_within(0.1)

    async def _emptied_within(self, seconds: float) -> bool:
        if not self._connections:
            return True
        self._emptied = asyncio.Event()
        try:
            async with asyncio.timeout(seconds):
                await self._emptied.wait()
        except TimeoutError:
            return False
        return True

    def __repr__(self) -> str:
        return (
            f"<HttpServer connections={len(self._connections)} idle={len(self._idle)} "
            f"body_bytes={self.body_bytes} draining={self.draining}>"
        )
