"""One client connection of the data plane: llhttp (``httptools``) parses its requests, and
this module does what a parser does not.

- **Limits** (``server:`` in the policy, read afresh for each request): the whole head within
  ``header_timeout_s`` and ``max_header_bytes`` (431; 414 for the target alone) and
  ``max_header_count`` lines; at most ``body_timeout_s`` of silence inside a body and
  ``max_body_bytes`` of it (413); every body's bytes counted against the server's shared
  ``max_buffered_body_bytes`` (503); an idle keep-alive connection closed after
  ``keepalive_timeout_s``; an answer the client leaves unread for ``client_send_timeout_s``
  cut.  One timer per connection, moved lazily.
- **What llhttp admits but a proxy must not serve**: versions other than 1.0 and 1.1 (505),
  CONNECT and TRACE (405), a ``Transfer-Encoding`` other than ``chunked``, a second Host or
  Authorization, an HTTP/1.1 request without Host, an ``Expect`` other than
  ``100-continue`` (417), and a target that ``target.normalise`` refuses (400).
- **Upgrades are declined, bodies kept**: llhttp stops at the head of a request offering an
  upgrade (the JDK's HttpClient offers ``h2c`` on every first request, with its body).  The
  gateway answers in HTTP/1.1, so the body is read on by a fresh parser, primed with the
  head's own validated framing (its Content-Length, or chunked).
- **Keep-alive and pipelining**: one request is answered at a time; a pipelined one waits,
  parsed, and reading pauses until its turn (at most ``MAX_PIPELINED`` wait).  A refused
  request is answered (OpenAI-shaped, ``Connection: close``) after the answers before it;
  then the connection half-closes and discards input for up to ``LINGER_S``, so the client
  reads the refusal instead of a reset.
- **Answers**: whole (one write) or streamed (chunked, or by length), with back-pressure.
  The client going away (close or reset) cancels the request's task.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from typing import TYPE_CHECKING

import httptools

from .errors import BodyTooLarge, GatewayError, MalformedRequest, Overloaded, RequestTimeout
from .target import normalise
from .wire import error_body, error_headers, http_date, response_head

if TYPE_CHECKING:
    from .policy.model import Server as Limits
    from .server import HttpServer

log = logging.getLogger("gateway.server")

LINGER_S = 2.0
MAX_PIPELINED = 32
_VERSIONS = frozenset({"1.1", "1.0"})
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
_ALLOW = ("Allow", "GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS")
_NO_BODY_STATUS = frozenset({204, 304})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_WAIT, _HEAD, _BODY = range(3)


def _shutting_down() -> Overloaded:
    return Overloaded("the gateway is shutting down; retry", retry_after_s=1.0, reason="shutdown")


class Request:
    """One request as the edge sees it, and the way its answer goes back.

    ``path`` and ``query`` are the normalised target (``target.normalise``); ``headers`` are
    as received, in order; ``host`` is the Host header.  Answer with ``respond`` (one write),
    or ``start``, ``write``... and ``end`` (a stream); ``cut`` ends a stream that cannot be
    completed, so the client sees it incomplete.
    """

    __slots__ = (
        "_chunked",
        "_chunks",
        "_close_delimited",
        "_conn",
        "_expect",
        "_keep",
        "_length",
        "_reserved",
        "body",
        "finished",
        "headers",
        "host",
        "interrupted",
        "keep_alive",
        "method",
        "path",
        "peer",
        "query",
        "sent",
        "started",
        "version",
    )

    def __init__(
        self,
        conn: ClientConnection,
        method: str,
        path: str,
        query: str,
        version: str,
        headers: list[tuple[str, str]],
        host: str,
        keep_alive: bool,
    ) -> None:
        self._conn = conn
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.headers = headers
        self.host = host
        self.keep_alive = keep_alive
        self.peer = conn.peer
        self.body = b""
        self.started = False
        self.finished = False
        self.sent = 0
        self.interrupted = False
        self._close_delimited = False
        self._chunks: list[bytes] = []
        self._reserved = 0
        self._expect = False
        self._keep = keep_alive
        self._chunked = False
        self._length: int | None = None

    def header(self, name: str) -> str | None:
        """The first value of header ``name``, case-insensitively."""
        name = name.lower()
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    # -- answering ---------------------------------------------------------------------------
    def _framing(self, status: int, length: int | None) -> str:
        conn = self._conn
        self._keep = self._keep and not conn.closing and not conn.server.draining
        lines = f"Date: {http_date()}\r\n"
        if status not in _NO_BODY_STATUS and status >= 200:
            if length is not None:
                lines = f"Content-Length: {length}\r\n" + lines
            elif self.method != "HEAD" and self.version == "1.1":
                self._chunked = True
                lines = "Transfer-Encoding: chunked\r\n" + lines
            elif self.method != "HEAD":
                self._keep = False  # HTTP/1.0: a body of unknown length ends at the close
                self._close_delimited = True
        if not self._keep:
            lines += "Connection: close\r\n"
        elif self.version == "1.0":
            lines += "Connection: keep-alive\r\n"
        return lines

    def respond(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """The whole answer in one write (no body bytes for HEAD, 204 and 304)."""
        head = response_head(status, headers, self._framing(status, len(body)))
        self.started = self.finished = True
        if self.method == "HEAD" or status in _NO_BODY_STATUS:
            self._conn.write(head)
        else:
            self._conn.write(head + body)
            self.sent = len(body)

    async def start(
        self, status: int, headers: list[tuple[str, str]], content_length: int | None = None
    ) -> None:
        """Send the head of a streamed answer: by length when known, else chunked."""
        self._length = content_length
        self._conn.write(response_head(status, headers, self._framing(status, content_length)))
        self.started = True
        if self.method == "HEAD" or status in _NO_BODY_STATUS:
            self._length = 0
        await self._conn.drain()

    async def write(self, data: bytes) -> None:
        """One piece of a streamed answer; waits while the client is behind."""
        if not data or self._length == 0:
            return
        if self._chunked:
            self._conn.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            self._conn.write(data)
        self.sent += len(data)
        await self._conn.drain()

    async def end(self) -> None:
        """Complete a streamed answer."""
        self.finished = True
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        elif self._length is not None and self.method != "HEAD" and self.sent != self._length:
            self.cut()  # fewer bytes than announced: the client must see it incomplete
            return
        await self._conn.drain()

    def end_with(self, data: bytes) -> None:
        """Complete a streamed answer with ``data`` as its last piece and close, without
        waiting on the client (the drain's last word to a stream it cuts short)."""
        if self._length is None and data:
            if self._chunked:
                self._conn.writelines((b"%x\r\n" % len(data), data, b"\r\n0\r\n\r\n"))
            else:
                self._conn.write(data)
        elif self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.finished = True
        self._keep = False
        self._conn.close()

    def cut(self) -> None:
        """End an answer that cannot be completed: the connection closes mid-answer."""
        self.finished = True
        self._keep = False
        self._conn.close(abort=self._conn.write_paused)

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path} started={self.started} sent={self.sent}>"


class ClientConnection(asyncio.Protocol):
    """One client connection: parses its requests, runs each through the server's handler
    in turn, and enforces the limits."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.peer = ""
        self.requests = 0
        self.closing = False
        self.closed = False
        self.write_paused = False
        self._limits: Limits = server.limits()
        self._parser = httptools.HttpRequestParser(self)
        self._state = _WAIT
        self._incoming: Request | None = None
        self._active: Request | None = None
        self._task: asyncio.Task[None] | None = None
        self._queue: deque[Request | GatewayError] = deque()
        self._url: list[bytes] = []
        self._url_size = 0
        self._headers: list[tuple[str, str]] = []
        self._head_size = 0
        self._head_fed = 0
        self._framing: bytes | None = None
        self._continuing = False
        self._upgrade_skipped = False
        self._reading_paused = False
        self._lingering = False
        self._accepted = self._loop.time()
        self._head_started = self._accepted
        self._last_read = self._accepted
        self._idle_since = self._accepted
        self._paused_at = 0.0
        self._linger_until = 0.0
        self._drain_waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        if not self.server.admit(self):
            self.closed = True
            transport.close()
            return
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.closed:
            return
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._declined_upgrade(data[exc.args[0] :])
            return
        except httptools.HttpParserError as exc:
            self._refuse(self._parse_error(exc))
            return
        if self._state == _HEAD:
            self._head_fed += len(data)
            if self._head_fed > self._limits.max_header_bytes:
                self._refuse(self._head_too_large())
                return
        self._arm()

    def eof_received(self) -> bool:
        return False  # a client that closes its side is gone: close (and cancel its request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
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
        self._arm()

    def resume_writing(self) -> None:
        self.write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- llhttp callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._continuing:
            return
        self._limits = self.server.limits()
        self._state = _HEAD
        self._head_started = self._loop.time() if self.requests else self._accepted
        self.requests += 1
        self._url = []
        self._url_size = 0
        self._headers = []
        self._head_size = 0
        self._head_fed = 0
        self.server.busy(self)

    def on_url(self, url: bytes) -> None:
        if self._continuing:
            return
        self._url.append(url)
        self._url_size += len(url)
        self._head_size += len(url)
        if self._head_size > self._limits.max_header_bytes:
            raise MalformedRequest(
                f"the request target is longer than {self._limits.max_header_bytes} bytes", 414
            )

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._continuing:
            return
        self._head_size += len(name) + len(value) + 4
        if self._head_size > self._limits.max_header_bytes:
            raise self._head_too_large()
        if len(self._headers) >= self._limits.max_header_count:
            raise MalformedRequest(f"more than {self._limits.max_header_count} header lines", 431)
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        if self._continuing:
            self._continuing = False  # the primed framing is in: the body follows
            return
        self._incoming = self._request()
        self._state = _BODY

    def on_body(self, body: bytes) -> None:
        request = self._incoming
        assert request is not None
        if request._reserved + len(body) > self._limits.max_body_bytes:
            raise BodyTooLarge(
                f"request body exceeds the limit of {self._limits.max_body_bytes} bytes"
            )
        if not self.server.reserve(len(body)):
            raise Overloaded(
                "the gateway holds as many request bodies as it may "
                "(server.max_buffered_body_bytes); retry shortly",
                retry_after_s=1.0,
                reason="body_buffer_full",
            )
        request._reserved += len(body)
        request._chunks.append(body)

    def on_message_complete(self) -> None:
        request = self._incoming
        assert request is not None
        if self._parser.should_upgrade():
            self._upgrade_skipped = True  # llhttp skipped the body: see _declined_upgrade
            return
        self._complete(request)

    # -- requests ----------------------------------------------------------------------------
    def _request(self) -> Request:
        """The head just parsed as a ``Request``, or the refusal it deserves (raised)."""
        parser = self._parser
        version = parser.get_http_version()
        if version not in _VERSIONS:
            raise MalformedRequest(f"HTTP/{version} is not served; use HTTP/1.1", 505)
        method = parser.get_method().decode("ascii")
        if method in _REFUSED_METHODS:
            error = MalformedRequest(f"{method} is not served by the gateway", 405)
            error.extra_headers = (_ALLOW,)
            raise error
        path, query = normalise(b"".join(self._url).decode("latin-1"))
        host: str | None = None
        seen_auth = chunked = expect = False
        length = 0
        for key, value in self._headers:
            lower = key.lower()
            if lower == "host":
                if host is not None:
                    raise MalformedRequest("more than one Host header")
                host = value.strip()
            elif lower == "authorization":
                if seen_auth:
                    raise MalformedRequest("more than one Authorization header")
                seen_auth = True
            elif lower == "transfer-encoding":
                if chunked or value.strip().lower() != "chunked":
                    raise MalformedRequest(f"Transfer-Encoding {value!r} is not served")
                chunked = True
            elif lower == "content-length":
                length = int(value)  # llhttp admits digits only, given once
            elif lower == "expect":
                if value.strip().lower() != "100-continue":
                    raise MalformedRequest(f"Expect {value!r} cannot be met", 417)
                expect = True
        if host is None and version == "1.1":
            raise MalformedRequest("an HTTP/1.1 request needs a Host header")
        if length > self._limits.max_body_bytes:
            raise BodyTooLarge(
                f"request body of {length} bytes exceeds the limit of {self._limits.max_body_bytes}"
            )
        request = Request(
            self,
            method,
            path,
            query,
            version,
            self._headers,
            host or "",
            parser.should_keep_alive(),
        )
        if chunked or length:
            self._framing = (
                b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % length
            )
            if expect and version == "1.1":
                if self._active is None and not self._queue:
                    self.write(_CONTINUE)
                else:
                    request._expect = True  # sent when the answers before it are done
        else:
            self._framing = None
        return request

    def _complete(self, request: Request) -> None:
        self._incoming = None
        self._state = _WAIT
        request.body = (
            request._chunks[0] if len(request._chunks) == 1 else b"".join(request._chunks)
        )
        request._chunks = []
        if self._active is None and not self._queue:
            self._dispatch(request)
        elif len(self._queue) >= MAX_PIPELINED:
            # Parsed from one read: without a cap, a buffer of tiny requests would cost
            # far more memory as queued requests than it took to send.
            self._release(request)
            raise MalformedRequest(f"more than {MAX_PIPELINED} requests pipelined at once")
        else:
            self._queue.append(request)
            self._pause_reading()

    def _declined_upgrade(self, rest: bytes) -> None:
        """A request offering an upgrade (``h2c``, a WebSocket): llhttp stopped at its head.
        It is answered in HTTP/1.1; its body, if it has one, is read by a fresh parser
        primed with the head's own framing, and then the requests that follow."""
        request = self._incoming
        self._parser = httptools.HttpRequestParser(self)
        if request is None or not self._upgrade_skipped:
            self._refuse(MalformedRequest("an unexpected protocol switch"))
            return
        self._upgrade_skipped = False
        framing = self._framing
        if framing is None:
            self._complete(request)
        else:
            self._continuing = True
            close = b"" if request.keep_alive else b"Connection: close\r\n"
            self._parser.feed_data(b"POST / HTTP/1.1\r\nHost: _\r\n" + framing + close + b"\r\n")
        if rest:
            self.data_received(rest)
        else:
            self._arm()

    def _dispatch(self, request: Request) -> None:
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
                request.respond(failed.status, error_headers(failed), error_body(failed))
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
        if request._close_delimited or (not request._keep and not self._queue):
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
            self.write(_CONTINUE)
        if self._state == _WAIT:
            self._idle_since = self._loop.time()
            self.server.idle(self)
            self._arm()

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
        elif self._state == _BODY and self._incoming is not None:
            self._refuse(_shutting_down())
        else:
            self.close()

    def _refuse_queued(self) -> None:
        """Answer every pipelined request still waiting with a 503; the last closes."""
        pending = [item for item in self._queue if isinstance(item, Request)]
        self._queue.clear()
        for request in pending:
            self._release(request)
        error = _shutting_down()
        body = error_body(error)
        for i, request in enumerate(pending):
            self.server.answered_refusal(error.status)
            request._keep = i < len(pending) - 1
            request.respond(error.status, error_headers(error), body)
        self.close()

    # -- refusals ------------------------------------------------------------------------------
    def _parse_error(self, exc: httptools.HttpParserError) -> GatewayError:
        cause = exc.__context__
        if isinstance(cause, GatewayError):
            return cause
        if self._parser.get_method() == b"PRI":
            return MalformedRequest("HTTP/2 with prior knowledge is not served; use HTTP/1.1", 505)
        if isinstance(exc, httptools.HttpParserInvalidMethodError):
            return MalformedRequest("unknown request method")
        reason = str(exc).strip() or "malformed request"
        return MalformedRequest(reason[0].upper() + reason[1:])

    def _head_too_large(self) -> MalformedRequest:
        limit = self._limits.max_header_bytes
        in_target = not self._headers and self._url_size + 16 >= self._head_fed
        if in_target and self._state == _HEAD:
            return MalformedRequest(f"the request target is longer than {limit} bytes", 414)
        return MalformedRequest(f"the request head is larger than {limit} bytes", 431)

    def _refuse(self, error: GatewayError) -> None:
        """The request being read cannot be served: answer ``error`` after the answers
        before it, then close; nothing more is read."""
        incoming, self._incoming = self._incoming, None
        if incoming is not None:
            self._release(incoming)
        self._state = _WAIT
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
            self._arm()
        else:
            transport.close()

    # -- timers --------------------------------------------------------------------------------
    def _deadline(self) -> tuple[float, str] | None:
        limits = self._limits
        if self._lingering:
            return self._linger_until, "linger"
        if self.write_paused:
            return self._paused_at + limits.client_send_timeout_s, "send"
        if self._reading_paused:
            return None
        if self._state == _HEAD:
            return self._head_started + limits.header_timeout_s, "head"
        if self._state == _BODY:
            return self._last_read + limits.body_timeout_s, "body"
        if self._active is None and not self._queue:
            if self.requests == 0:
                return self._accepted + limits.header_timeout_s, "head"
            return self._idle_since + limits.keepalive_timeout_s, "idle"
        return None

    def _arm(self) -> None:
        found = self._deadline()
        if found is None or self.closed:
            return
        when = found[0]
        timer = self._timer
        if timer is not None:
            if timer.when() <= when:
                return  # it fires first and moves itself on
            timer.cancel()
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        found = self._deadline()
        if found is None or self.closed:
            return
        when, phase = found
        if self._loop.time() < when:
            self._timer = self._loop.call_at(when, self._on_timer)
            return
        if phase == "linger":
            self.close()
            return
        self.server.timed_out(phase)
        if phase == "send":
            log.warning(
                "cut an answer to %s: unread for %g s",
                self.peer,
                self._limits.client_send_timeout_s,
            )
            self.close(abort=True)
        elif phase == "idle" or (phase == "head" and self._state == _WAIT):
            self.close()
        else:
            what = "request head" if phase == "head" else "request body"
            limit = (
                self._limits.header_timeout_s if phase == "head" else self._limits.body_timeout_s
            )
            self._refuse(RequestTimeout(f"the {what} did not arrive within {limit:g} s"))

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

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
        if self._state != _WAIT:
            return "reading"
        return "idle"

    def __repr__(self) -> str:
        return (
            f"<ClientConnection {self.peer} {self.state} requests={self.requests} "
            f"queued={len(self._queue)} closing={self.closing}>"
        )
