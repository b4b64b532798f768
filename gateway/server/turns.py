"""The answering side of a client connection: its requests answered one at a time, in the
order they came, refusals in their turn, the lingering close, the drain's interruption, and
the transport's flow control.  ``connection.ClientConnection`` is the reading side:
it parses requests and hands them here, complete, in order.

A refused request is answered (OpenAI-shaped, ``Connection: close``) after the answers
before it; then the connection half-closes and discards input for up to ``LINGER_S``, so the
client reads the refusal instead of a reset (nginx's lingering close).  The client going
away (close or reset) cancels the request being answered.
"""

from __future__ import annotations

import asyncio
import logging
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from gateway.errors import GatewayError, MalformedRequest, Overloaded
from gateway.policy.model import Server as Limits
from gateway.server.clock import ConnectionClock, Deadline
from gateway.server.request import Request, shutting_down
from gateway.wire import error_body, error_headers, http_date, keep_alive_line, response_head

log = logging.getLogger("gateway.server.listener")

LINGER_S = 2.0
LAST_CALL_S = 1.0
"""During the drain, how long a connection whose answer ended keep-alive (its head went out
before the drain began, so its client was never told the connection closes) waits for the
request its client may be sending already; closed at once, that request would meet a reset
or nothing.  It is served like any on an open connection, its answer closing."""
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
WAIT, HEAD, BODY = range(3)
"""What the reading side is doing: waiting for a request, in a head, in a body."""


class Host(Protocol):
    """What a connection needs of the server that accepted it (``server.HttpServer``)."""

    loop: asyncio.AbstractEventLoop
    handler: Callable[[Request], Awaitable[None]]
    limits: Callable[[], Limits]
    draining: bool
    cutting: bool

    def admit(self, conn: Turns) -> bool: ...

    def forget(self, conn: Turns) -> None: ...

    def idle(self, conn: Turns) -> None: ...

    def busy(self, conn: Turns) -> None: ...

    def reserve(self, size: int, conn: Turns) -> bool: ...

    def release(self, size: int) -> None: ...

    def timed_out(self, phase: str) -> None: ...

    def answered_refusal(self, status: int) -> None: ...


class Turns(asyncio.Protocol, ABC):
    """A client connection's state, and the answering of its requests in turn."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.requests = 0
        self.closing = False
        self.closed = False
        self.write_paused = False
        self._limits: Limits = server.limits()
        self._state = WAIT
        self._incoming: Request | None = None
        self._active: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._queue: deque[Request | GatewayError] = deque()
        self._reading_paused = False
        self._turn_given = False  # reading paused until the loop has run once (give_turn)
        self._lingering = False
        self.discarded = False  # input past the last request was thrown away
        self._accepted = self._loop.time()
        self._head_started = self._accepted
        self._last_read = self._accepted
        self._idle_since = self._accepted
        self._paused_at = 0.0
        self._linger_until = 0.0
        self._drain_waiter: asyncio.Future[None] | None = None
        self._clock = ConnectionClock(self._loop, self._deadline, self._expired)

    @abstractmethod
    def _deadline(self) -> Deadline | None:
        """The deadline of the phase the connection is in (the parser's to say)."""

    @abstractmethod
    def _expired(self, phase: str) -> None:
        """Answer a deadline that passed in ``phase``."""

    @abstractmethod
    def body_stall_s(self) -> float:
        """How far the body being read is behind its pace (0: none, or on pace)."""

    @abstractmethod
    def head_stall_s(self) -> float:
        """How long the head being read has been arriving (0: none is)."""

    @abstractmethod
    def held_bytes(self) -> int:
        """The body bytes of the request being read, in the server's shared buffer."""

    @abstractmethod
    def cut_stalled(self, reason: str) -> None:
        """Refuse the request being read with a 408: the server needs its room."""

    @property
    def draining(self) -> bool:
        return self.server.draining

    @property
    def keep_alive(self) -> str:
        """The ``Keep-Alive`` line of an answer that keeps the connection: how long it then
        waits idle, so that a client that reads it closes first, not into a request."""
        return keep_alive_line(self._limits.keepalive_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._clock.cancel()
        if self._task is not None and not self._task.done():
            self._task.cancel()
        for item in (self._incoming, *self._queue):
            if isinstance(item, Request):
                self._release(item)
        self._queue.clear()
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(ConnectionResetError("the client went away"))
            waiter.exception()
        self.server.forget(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        self._paused_at = self._loop.time()
        self._clock.arm()

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _dispatch(self, request: Request) -> None:
        if self.server.cutting:  # the grace is over: nothing more is begun, but answered
            self._queue.append(request)
            self._refuse_queued()
            return
        self._active = request
        self._task = self._loop.create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        try:
            await self.server.handler(request)
            if not request.finished:
                raise RuntimeError("the handler returned without finishing its answer")
        except asyncio.CancelledError:
            pass  # the client went away, or the drain ran out of time
        except Exception:
            log.exception("answering %s %s failed", request.method, request.path)
            if not request.started:
                failed = GatewayError("the gateway failed to handle the request")
                request._keep = False
                request.respond(
                    failed.status, error_headers(failed), error_body(failed, request.path)
                )
            else:
                request.cut()
        finally:
            self._answered(request)

    def _answered(self, request: Request) -> None:
        self._release(request)
        self._active = None
        self._task = None
        if self.closed:
            return
        if request._close_delimited or not request._keep:
            # The answer said the connection closes: nothing after it is processed (RFC 9112
            # 9.6), so what was pipelined behind it is dropped unanswered, for its client to
            # send again (the drain marks every answer so).
            pending = [item for item in self._queue if isinstance(item, Request)]
            self._queue.clear()
            for item in pending:
                self._release(item)
            if self.discarded or pending:
                self._linger()  # the client is still sending: no reset over its answer
            else:
                self.close()
            return
        if self._queue:
            if self.server.cutting:
                self._refuse_queued()
                return
            following = self._queue.popleft()
            if isinstance(following, GatewayError):
                self._send_refusal(following)
                return
            self._dispatch(following)
            return
        self._resume_reading()
        incoming = self._incoming
        if incoming is not None and incoming._expect:
            incoming._expect = False
            self.write(CONTINUE)
        if self._state == WAIT:
            self._idle_since = self._loop.time()
            self.server.idle(self)
            self._clock.arm()

    def _release(self, request: Request) -> None:
        if request._reserved:
            self.server.release(request._reserved)
            request._reserved = 0

    def interrupt(self) -> None:
        """The drain's grace is over: end what this connection does, each request answered.
        A request being handled is cancelled (the edge writes its last word: a 503, or an
        error event to end a stream); one whose body is arriving gets a 503."""
        if self._task is not None and not self._task.done() and self._active is not None:
            self._active.interrupted = True
            self._task.cancel()
        elif self._state == BODY and self._incoming is not None:
            self._refuse(shutting_down())
        else:
            self.close()

    def _refuse_queued(self) -> None:
        """Answer every pipelined request still waiting with a 503; the last closes."""
        pending = [item for item in self._queue if isinstance(item, Request)]
        self._queue.clear()
        for request in pending:
            self._release(request)
        error = shutting_down()
        for i, request in enumerate(pending):
            self.server.answered_refusal(error.status)
            request._keep = i < len(pending) - 1
            request.respond(error.status, error_headers(error), error_body(error, request.path))
        self.close()

    def _refuse(self, error: GatewayError) -> None:
        """The request being read cannot be served: answer ``error`` after the answers
        before it, then close; nothing more is read."""
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            self._release(incoming)
        self._state = WAIT
        if self._active is None and not self._queue:
            self._send_refusal(error)
        else:
            self._queue.append(error)
            self._pause_reading()

    def _send_refusal(self, error: GatewayError) -> None:
        if error.status >= 500 and not isinstance(error, Overloaded | MalformedRequest):
            log.error("refused a request from %s: %s", self.peer, error)
        else:
            log.warning("refused a request from %s: %d %s", self.peer, error.status, error)
        self.server.answered_refusal(error.status)
        body = error_body(error)
        headers = [*error_headers(error), *error.extra_headers]
        framing = f"Content-Length: {len(body)}\r\nDate: {http_date()}\r\nConnection: close\r\n"
        self.write(response_head(error.status, headers, framing) + body)
        self._linger()

    def _linger(self) -> None:
        """Half-close and discard what the client still sends, for up to ``LINGER_S``, so it
        reads the answer before the connection closes (nginx's lingering close)."""
        self._lingering = True
        self.closing = True
        self._linger_until = self._loop.time() + LINGER_S
        transport = self.transport
        if transport is None or self.closed:
            return
        self._resume_reading()
        if transport.can_write_eof():
            transport.write_eof()
            self._clock.arm()
        else:
            transport.close()

    # -- transport -------------------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def writelines(self, parts: tuple[bytes, ...]) -> None:
        if self.transport is not None and not self.closed:
            self.transport.writelines(parts)

    async def drain(self) -> None:
        """Wait while the client is behind (the send timeout cuts it past its limit)."""
        if not self.write_paused or self.closed:
            return
        waiter = self._loop.create_future()
        self._drain_waiter = waiter
        try:
            await waiter
        finally:
            self._drain_waiter = None

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            if not self._turn_given:
                self.transport.resume_reading()

    def give_turn(self) -> None:
        """Read no more until the event loop has run once.  The loop reads a socket again
        and again while it has data (libuv: up to 32 reads of 64 KiB in one go), so a read
        that cost many callbacks (a body in tiny chunks) would otherwise be followed by
        thirty more before any other connection or timer ran."""
        if self._turn_given or self._reading_paused or self.transport is None or self.closed:
            return
        self._turn_given = True
        self.transport.pause_reading()
        self._loop.call_soon(self._turn_back)

    def _turn_back(self) -> None:
        self._turn_given = False
        if not self._reading_paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self, *, abort: bool = False) -> None:
        """Close once what was written is sent (``abort``: at once)."""
        self.closing = True
        if self.transport is not None and not self.closed:
            if abort:
                self.transport.abort()
            else:
                self.transport.close()

    @property
    def state(self) -> str:
        """reading, active or idle (for ``gateway_connections``)."""
        if self._active is not None or self._queue:
            return "active"
        if self._state != WAIT:
            return "reading"
        return "idle"

    def __repr__(self) -> str:
        return (
            f"<{type(self).__name__} {self.peer} {self.state} requests={self.requests} "
            f"queued={len(self._queue)} closing={self.closing}>"
        )
