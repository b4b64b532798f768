"""One keep-alive HTTP/1.1 connection to a backend, for the hot path.

Responses are parsed by llhttp (through ``httptools``, the parser under uvicorn and
Node.js), strictly: ``Content-Length`` is digits only and given once, never with
``Transfer-Encoding``; chunk sizes are hex digits; obsolete line folding, whitespace before a
colon, bare LF, and NUL or CR in a value are errors.  On top of llhttp this module refuses
what a proxy must not relay: a status outside 100-599, a version other than 1.0 and 1.1, a
``Transfer-Encoding`` that is anything but ``chunked``, a head over ``MAX_HEAD_BYTES``,
trailers over as much, and an upgrade nobody asked for.  Each is a ``BadUpstreamResponse``
(502, or a cut stream once its head is gone), and that connection is closed, never pooled.
Trailer fields are never headers: they are read, bounded and dropped.

A connection is reusable only after a clean exchange: the whole answer read, keep-alive
agreed, not a 5xx (servers often close after an error without saying so), and not one byte
more.  Any byte after the answer (or while idle in the pool) retires it.  A body delimited
by the connection's close is complete only on a clean close (FIN); a reset cuts it.  The
client also does what a proxy needs around the parser: one write per request, flow
control, timeouts from a single timer per exchange, and whether a reused connection closed
before any byte of its answer arrived (a stale keep-alive socket, safe to send again).
"""

from __future__ import annotations

import asyncio
import collections
import re
from collections.abc import AsyncGenerator, Callable

import httptools

from gateway.errors import BadUpstreamResponse, UpstreamError, UpstreamTimeout, UpstreamUnavailable

HIGH_WATER_BYTES = 256 * 1024
LOW_WATER_BYTES = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024
CHUNK_OVERHEAD_BYTES = 256
"""Framing bytes a chunk may take: llhttp bounds no extension, and httptools holds a trailer
field whole before handing it over, so a chunked body's framing is bounded here."""

_IDLE, _HEAD, _BODY, _DONE = range(4)
_VERSIONS = frozenset({"1.0", "1.1"})
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


class StaleConnection(Exception):
    """A reused connection closed before any byte of the response: safe to send again."""


class _AfterAnswer(Exception):
    """Raised from a parser callback when a second message begins after the answer."""


class Head:
    """Status and headers of a response."""

    __slots__ = ("content_length", "headers", "status")

    def __init__(
        self, status: int, headers: list[tuple[str, str]], content_length: int | None
    ) -> None:
        self.status = status
        self.headers = headers
        self.content_length = content_length


class Connection(asyncio.Protocol):
    """One keep-alive connection to backend ``name``; serves one exchange at a time.
    ``on_close`` (set by its pool) hears when the connection closes, for whatever reason."""

    def __init__(self, name: str, loop: asyncio.AbstractEventLoop) -> None:
        self.name = name
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.exchanges = 0
        self.idle_since = 0.0  # when its pool last took it back
        self.keep_s = float("inf")  # how long it may idle: its server's hint (``pool.heard``)
        self.reusable = False
        self.closed = False
        self._state = _IDLE
        self._parser: httptools.HttpResponseParser | None = None
        self._headers: list[tuple[str, str]] = []
        self._head_bytes = 0  # bytes fed while the head is incomplete (bounds the memory)
        self._head_size = 0  # the header lines parsed (bounds the head)
        self._trailer_size = 0  # the trailer lines parsed (bounded like the head, dropped)
        self._chunked = False
        self._chunk_count = 0
        self._body_wire = 0  # bytes fed while a chunked body is read
        self._body_total = 0  # its payload bytes
        self._keep_alive = False
        self._until_close = False
        self._no_body = False
        self._eof = False
        self._head_waiter: asyncio.Future[Head] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._body_waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._got_bytes = False
        self._last_data = 0.0
        self._deadline = self._idle_s = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.on_close: Callable[[Connection], None] | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        state = self._state
        if state == _IDLE or state == _DONE or self._parser is None:
            # Bytes nobody asked for: the connection is out of step with its framing.
            self._retire()
            return
        self._got_bytes = True
        self._last_data = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._bad("it switched protocols, which the gateway never asks for")
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, UpstreamError):
                self._fail(exc.__context__)
                self._abort()
            elif self._state == _DONE:
                self._retire()  # the answer stands; the bytes after it retire the connection
            else:
                self._bad(_reason(exc))
            return
        if self._state == _HEAD:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._bad(f"response head larger than {MAX_HEAD_BYTES} bytes")
        elif self._state == _BODY and self._chunked:
            self._body_wire += len(data)
            allowed = 2 * MAX_HEAD_BYTES + (self._chunk_count + 1) * CHUNK_OVERHEAD_BYTES
            if self._body_wire - self._body_total > allowed:
                self._bad("its chunk framing or trailers are far larger than its chunks")

    def eof_received(self) -> bool:
        self._eof = True
        if self._state == _BODY and self._until_close:
            self._finish()  # a clean close (FIN) ends a close-delimited body
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        if self.on_close is not None:
            self.on_close(self)
        if self._state in (_HEAD, _BODY):
            if self._state == _HEAD and not self._got_bytes and self.exchanges > 1:
                self._fail(StaleConnection())
            else:
                cut = " (reset)" if exc is not None else ""
                self._fail(
                    UpstreamUnavailable(
                        f"backend {self.name!r} closed the connection mid-response{cut}",
                        self.name,
                    )
                )
        self._cancel_timer()

    def pause_writing(self) -> None:  # request bodies are written whole; nothing to pause
        pass

    # -- llhttp callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._state == _DONE:
            raise _AfterAnswer

    def on_status(self, reason: bytes) -> None:
        if _CONTROL.search(reason):  # llhttp admits them; RFC 9112's reason-phrase does not
            raise self._error_for("a control character in the reason phrase")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state == _BODY:
            # A trailer field (after a chunked body): bounded like a head, never a header.
            self._trailer_size += len(name) + len(value) + 4
            if self._trailer_size > MAX_HEAD_BYTES:
                raise self._error_for(f"response trailers larger than {MAX_HEAD_BYTES} bytes")
            return
        self._head_size += len(name) + len(value) + 4
        self._headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        assert parser is not None
        status = parser.get_status_code()
        if self._head_size > MAX_HEAD_BYTES:
            raise self._error_for(f"response head larger than {MAX_HEAD_BYTES} bytes")
        if parser.get_http_version() not in _VERSIONS:
            raise self._error_for(f"HTTP version {parser.get_http_version()} is not HTTP/1.x")
        if not 100 <= status <= 599:
            raise self._error_for(f"status {status} is outside 100-599")
        if status < 200:
            return  # an interim answer (103 Early Hints, a stray 100): the real head follows
        length: int | None = None
        chunked = False
        for key, value in self._headers:
            lower = key.lower()
            if lower == "content-length":
                length = int(value)  # llhttp admits digits only, given once
            elif lower == "transfer-encoding":
                if chunked or value.strip().lower() != "chunked":
                    raise self._error_for(f"Transfer-Encoding {value!r} is not just `chunked`")
                chunked = True
        # HTTP/1.0's keep-alive is an extension parsers disagree on: never pooled.  Nor is a
        # connection after a 5xx: servers close it after an unhandled error without saying
        # so (uvicorn under Starlette's error middleware: MLServer, FastAPI apps).
        self._keep_alive = (
            parser.should_keep_alive() and parser.get_http_version() == "1.1" and status < 500
        )
        self._state = _BODY
        if self._no_body or status in (204, 304):
            # No body follows; a HEAD answer's Content-Length still describes the GET's.
            # llhttp cannot be told to skip a HEAD answer's body: bytes after one with a
            # length reach on_body (and retire the connection), but after a chunked one
            # they could sit unseen in a chunk-size line, so that connection is not reused.
            if status in (204, 304):
                length = None if chunked else 0
            elif chunked:
                self._keep_alive = False
            self._resolve_head(Head(status, self._headers, length))
            self._finish()
            return
        self._chunked = chunked
        self._until_close = length is None and not chunked
        if self._until_close:
            self._keep_alive = False
        self._resolve_head(Head(status, self._headers, None if chunked else length))

    def on_chunk_header(self) -> None:
        self._chunk_count += 1

    def on_body(self, body: bytes) -> None:
        if self._state != _BODY:  # a body after an answer that has none (HEAD)
            raise _AfterAnswer
        self._chunks.append(body)
        self._buffered += len(body)
        self._body_total += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._state == _HEAD:  # the end of an interim answer
            self._headers = []
            self._head_size = 0
            return
        if self._state == _BODY:
            self._finish()

    # -- one exchange ----------------------------------------------------------------------
    def send(
        self, head: bytes, body: bytes, *, no_body: bool, timeout_s: float, idle_s: float
    ) -> asyncio.Future[Head]:
        """Write a request; the future resolves with the response head."""
        assert self.transport is not None
        self.exchanges += 1
        self.reusable = False
        self._state = _HEAD
        if self._parser is None or self._no_body:
            # After a clean exchange llhttp is ready for the next message: reused.
            self._parser = httptools.HttpResponseParser(self)
        self._headers = []
        self._head_bytes = 0
        self._head_size = 0
        self._trailer_size = 0
        self._chunked = False
        self._chunk_count = self._body_wire = self._body_total = 0
        self._keep_alive = False
        self._until_close = False
        self._chunks.clear()
        self._buffered = 0
        self._error = None
        self._got_bytes = False
        self._no_body = no_body
        now = self._loop.time()
        self._last_data = now
        self._deadline = now + timeout_s
        self._idle_s = idle_s
        self._timer = self._loop.call_at(min(self._deadline, now + idle_s), self._on_timer)
        self._head_waiter = self._loop.create_future()
        self.transport.write(head + body if body else head)
        return self._head_waiter

    async def body_chunks(self) -> AsyncGenerator[bytes, None]:
        """The response body as it arrives (de-chunked); raises if it does not end cleanly."""
        while True:
            while self._chunks:
                chunk = self._chunks.popleft()
                self._buffered -= len(chunk)
                if self._paused and self._buffered <= LOW_WATER_BYTES:
                    self._paused = False
                    if self.transport is not None:
                        self.transport.resume_reading()
                yield chunk
            if self._error is not None:
                raise self._error
            if self._state == _DONE:
                return
            self._body_waiter = self._loop.create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None

    async def read_body(self) -> bytes:
        return b"".join([c async for c in self.body_chunks()])

    def whole_body(self) -> bytes | None:
        """The whole body if it has all arrived cleanly already (else None: read on)."""
        if self._state != _DONE or self._error is not None:
            return None
        chunks = self._chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self._buffered = 0
        if self._paused and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return body

    @property
    def complete(self) -> bool:
        return self._state == _DONE and self._error is None

    # -- state -------------------------------------------------------------------------------
    def _resolve_head(self, head: Head) -> None:
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(head)

    def _finish(self) -> None:
        self._state = _DONE
        self._cancel_timer()
        self.reusable = self._keep_alive and not self.closed and not self._eof
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._state = _DONE
        self.reusable = False
        self._cancel_timer()
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
            # Nobody may be waiting any more (a cancelled exchange): never "never retrieved".
            waiter.exception()
        self._wake()

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _error_for(self, what: str) -> BadUpstreamResponse:
        return BadUpstreamResponse(
            f"backend {self.name!r} sent an invalid response: {what}", self.name
        )

    def _bad(self, what: str) -> None:
        self._fail(self._error_for(what))
        self._abort()

    def _retire(self) -> None:
        """Never reuse this connection (the exchange on it, if any, stands as it is)."""
        self.reusable = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    # -- timeouts ------------------------------------------------------------------------------
    def _on_timer(self) -> None:
        self._timer = None
        if self._state == _DONE or self._state == _IDLE:
            return
        now = self._loop.time()
        if self._paused:
            # Silence while we hold the backend back for a slow client is not the
            # backend's: the idle clock starts again from here.
            self._last_data = now
        if now >= self._deadline:
            what = "did not answer in time"
        elif now - self._last_data >= self._idle_s:
            what = f"sent nothing for {self._idle_s:g} s"
        else:
            when = min(self._deadline, self._last_data + self._idle_s)
            self._timer = self._loop.call_at(when, self._on_timer)
            return
        self._fail(UpstreamTimeout(f"backend {self.name!r} {what}", self.name))
        self._abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _abort(self) -> None:
        self.reusable = False
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """Drop the connection (the backend sees the client go away)."""
        self._abort()

    def __repr__(self) -> str:
        state = ("idle", "head", "body", "done")[self._state]
        return (
            f"<Connection {self.name} exchanges={self.exchanges} "
            f"state={state} reusable={self.reusable}>"
        )


def _reason(exc: httptools.HttpParserError) -> str:
    """llhttp's reason, without the Python exception's framing."""
    text = str(exc).strip() or type(exc).__name__
    return text[0].lower() + text[1:] if text else text
