"""A small HTTP/1.1 client for the hot path: one keep-alive connection to a backend.

aiohttp's client costs more per request than the rest of the proxy together (URL objects,
trace signals, cookie handling, per-request timers).  This client does only what a proxy
needs: one write per request, a response head parsed from bytes, bodies by length, chunked
or until close, flow control, and timeouts from a single timer per exchange.  It knows
whether a connection was reused and whether any byte of the response arrived, which is what
deciding a retry after a stale keep-alive socket needs.  The connections to one backend
are pooled in ``http1_pool``.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from .errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable

if TYPE_CHECKING:
    from .http1_pool import Pool

HIGH_WATER_BYTES = 256 * 1024
LOW_WATER_BYTES = 64 * 1024
MAX_HEAD_BYTES = 64 * 1024

_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(8)


class StaleConnection(Exception):
    """A reused connection closed before any byte of the response: safe to send again."""


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
    """One keep-alive connection; serves one exchange at a time."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.exchanges = 0
        self.reusable = False
        self.closed = False
        self._buf = bytearray()
        self._state = _DONE
        self._remaining = 0
        self._head_waiter: asyncio.Future[Head] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._body_waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._got_bytes = False
        self._no_body = False
        self._last_data = 0.0
        self._deadline = 0.0
        self._idle_s = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        self._last_data = self._loop.time()
        self._buf += data
        try:
            self._parse()
        except UpstreamError as exc:
            self._fail(exc)
            self._abort()

    def eof_received(self) -> bool:
        if self._state == _UNTIL_CLOSE:
            self._finish()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.reusable = False
        self._pool.forget(self)
        if self._state == _UNTIL_CLOSE:
            self._finish()
        elif self._state != _DONE:
            if not self._got_bytes and self.exchanges > 1:
                self._fail(StaleConnection())
            else:
                self._fail(
                    UpstreamUnavailable(
                        f"backend {self._pool.name!r} closed the connection mid-response"
                        + (f": {exc}" if exc else ""),
                        self._pool.name,
                    )
                )
        self._cancel_timer()

    def pause_writing(self) -> None:  # request bodies are written whole; nothing to pause
        pass

    # -- one exchange ----------------------------------------------------------------------
    def send(
        self, head: bytes, body: bytes, *, no_body: bool, timeout_s: float, idle_s: float
    ) -> asyncio.Future[Head]:
        """Write a request; the future resolves with the response head."""
        assert self.transport is not None
        self.exchanges += 1
        self.reusable = False
        self._state = _HEAD
        self._buf.clear()
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

    async def body_chunks(self) -> AsyncIterator[bytes]:
        """The response body as it arrives (de-chunked)."""
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

    @property
    def complete(self) -> bool:
        return self._state == _DONE and self._error is None

    # -- parsing -----------------------------------------------------------------------------
    def _parse(self) -> None:
        buf = self._buf
        while buf:
            state = self._state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end > MAX_HEAD_BYTES or (end < 0 and len(buf) > MAX_HEAD_BYTES):
                    raise self._bad("response head too large")
                if end < 0:
                    return
                head = bytes(buf[:end])
                del buf[: end + 4]
                self._on_head(head)
            elif state == _LENGTH:
                take = min(self._remaining, len(buf))
                self._deliver(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    self._finish()
            elif state == _CHUNK_SIZE:
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 1024:
                        raise self._bad("chunk size line too long")
                    return
                line = bytes(buf[:end]).split(b";", 1)[0].strip()
                del buf[: end + 2]
                try:
                    size = int(line, 16)
                except ValueError:
                    raise self._bad(f"bad chunk size {line!r}") from None
                if size == 0:
                    self._state = _TRAILERS
                else:
                    self._remaining = size
                    self._state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                take = min(self._remaining, len(buf))
                self._deliver(bytes(buf[:take]))
                del buf[:take]
                self._remaining -= take
                if self._remaining == 0:
                    self._state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise self._bad("missing CRLF after chunk")
                del buf[:2]
                self._state = _CHUNK_SIZE
            elif state == _TRAILERS:
                end = buf.find(b"\r\n")
                if end < 0:
                    return
                del buf[: end + 2]
                if end == 0:  # the empty line that ends the trailers
                    self._finish()
            elif state == _UNTIL_CLOSE:
                self._deliver(bytes(buf))
                buf.clear()
            else:  # _DONE: bytes after a complete response; the answer stands, but a
                # connection out of step with its framing is never reused
                buf.clear()
                self.reusable = False
                if self.transport is not None:
                    self.transport.close()
                return

    def _on_head(self, raw: bytes) -> None:
        lines = raw.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise self._bad(f"bad status line {lines[0][:80]!r}")
        try:
            status = int(parts[1])
        except ValueError:
            raise self._bad(f"bad status line {lines[0][:80]!r}") from None
        if 100 <= status < 200:
            return  # interim (103 Early Hints, a stray 100): the real head follows
        headers: list[tuple[str, str]] = []
        length: int | None = None
        chunked = False
        keep_alive = parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise self._bad("bad header line")
            key = name.strip().decode("latin-1")
            val = value.strip().decode("latin-1")
            lower = key.lower()
            if lower == "content-length":
                try:
                    length = int(val)
                except ValueError:
                    raise self._bad("bad Content-Length") from None
            elif lower == "transfer-encoding":
                chunked = "chunked" in val.lower()
            elif lower == "connection":
                tokens = val.lower()
                if "close" in tokens:
                    keep_alive = False
                elif "keep-alive" in tokens:
                    keep_alive = True
            headers.append((key, val))
        self._keep_alive = keep_alive
        if self._no_body or status in (204, 304):
            # No body follows; a HEAD answer's Content-Length still describes the GET's.
            self._state = _DONE
            if status in (204, 304):
                length = None if chunked else 0
            self._finish()
        elif chunked:
            length = None
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._remaining = length
            self._state = _LENGTH
            if length == 0:
                self._finish()
        else:
            self._keep_alive = False
            self._state = _UNTIL_CLOSE
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(Head(status, headers, length))

    def _deliver(self, data: bytes) -> None:
        if not data:
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self._state = _DONE
        self._cancel_timer()
        self.reusable = getattr(self, "_keep_alive", False) and not self._buf and not self.closed
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._state = _DONE
        self.reusable = False
        self._cancel_timer()
        waiter = self._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self._wake()

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _bad(self, what: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(
            f"backend {self._pool.name!r} sent an invalid response: {what}", self._pool.name
        )

    # -- timeouts ------------------------------------------------------------------------------
    def _on_timer(self) -> None:
        self._timer = None
        if self._state == _DONE:
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
        self._fail(UpstreamTimeout(f"backend {self._pool.name!r} {what}", self._pool.name))
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
        return (
            f"<Connection {self._pool.name} exchanges={self.exchanges} "
            f"state={self._state} reusable={self.reusable}>"
        )
