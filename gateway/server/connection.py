"""One client connection of the data plane: llhttp (``httptools``) parses its requests, and
this module does what a parser does not.

- **Limits** (``server:`` in the policy, read afresh for each request): the whole head within
  ``header_timeout_s`` and ``max_header_bytes`` (431; 414 for the target alone) and
  ``max_header_count`` lines; a body at ``min_body_rate_bytes_s`` at least, once it has
  fallen ``body_timeout_s`` behind that pace (a pace, not only silence: a body trickling a
  byte every few seconds is cut), whole within ``body_deadline_s``, and ``max_body_bytes``
  of it (413), kept in one buffer however small its pieces; every body's bytes counted
  against the server's shared ``max_buffered_body_bytes`` (503, after the server has cut
  the stalled uploads holding more than their share); the chunk framing of a body
  (extensions) bounded; an idle keep-alive connection closed after
  ``keepalive_timeout_s``; an answer the client leaves unread for ``client_send_timeout_s``
  cut.  One timer per connection, moved lazily.
- **Trailers** of a chunked body are never headers: they are dropped, bounded like a head
  (431 past ``max_header_bytes``), and a field that may not be a trailer (framing, routing,
  credentials, request modifiers: RFC 9110 6.5.1) is a 400.
- **What llhttp admits but a proxy must not serve**: versions other than 1.0 and 1.1 (505),
  CONNECT and TRACE (405), a ``Transfer-Encoding`` other than ``chunked``, a second Host or
  Authorization, an HTTP/1.1 request without Host, an ``Expect`` other than
  ``100-continue`` (417), and a target that ``target.normalise`` refuses (400).
- **Upgrades are declined, bodies kept**: llhttp stops at the head of a request offering an
  upgrade (the JDK's HttpClient offers ``h2c`` on every first request, with its body).  The
  gateway answers in HTTP/1.1, so the body is read on by a fresh parser, primed with the
  head's own validated framing (its Content-Length, or chunked).
- **Pipelining**: a request parsed while another is answered waits for its turn
  (``turns``), and reading pauses; at most ``MAX_PIPELINED`` wait.  Nothing after a
  request that closes the connection (``Connection: close``, even beside ``keep-alive``;
  HTTP/1.0 without ``keep-alive``) is parsed or
  answered (RFC 9112 9.6): it is read and discarded, so a client that pipelined past
  its own close is not told "400" for requests that were never processed, and the close
  then lingers, so that the bytes still on their way draw no reset that could cost the
  client its answer.
"""

from __future__ import annotations

import asyncio
import logging

import httptools

from gateway.errors import (
    BodyTooLarge,
    GatewayError,
    MalformedRequest,
    Overloaded,
    RequestTimeout,
)
from gateway.server.body import BodyReading
from gateway.server.clock import Deadline
from gateway.server.request import Request, read_head
from gateway.server.turns import BODY, CONTINUE, HEAD, LAST_CALL_S, WAIT, Host, Turns
from gateway.wire import connection_options

log = logging.getLogger("gateway.server.listener")

MAX_PIPELINED = 32
BUSY_READ_PIECES = 1024
"""A read that brought more body pieces than this (a body in tiny chunks: a callback each)
gives the loop a turn before the connection is read again (``Turns.give_turn``)."""


class ClientConnection(Turns):
    """One client connection: parses its requests and enforces the limits on reading them;
    ``Turns`` answers them."""

    def __init__(self, server: Host) -> None:
        super().__init__(server)
        self._parser = httptools.HttpRequestParser(self)
        self._url: list[bytes] = []
        self._url_size = 0
        self._headers: list[tuple[str, str]] = []
        self._head_size = 0
        self._head_fed = 0
        self._framing: bytes | None = None
        self._continuing = False
        self._upgrade_skipped = False
        self._read_last = False  # a request that closes the connection was read whole
        self._body: BodyReading | None = None  # made once a body outlives its first read
        self._body_started = 0.0
        self._pieces: list[bytes] = []  # body bytes parsed in this read, not yet settled

    # -- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = str(peer[0]) if peer else ""
        if not self.server.admit(self):
            self.closed = True
            transport.close()
            return
        self._clock.arm()

    def data_received(self, data: bytes) -> None:
        if self._lingering or self.closed:
            return
        if self._read_last:
            self.discarded = True  # past the last request: the close lingers (turns)
            return
        self._last_read = self._loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as exc:
            self._declined_upgrade(data[exc.args[0] :])
            return
        except httptools.HttpParserError as exc:
            self._pieces.clear()
            if self._read_last:  # bytes after the last request: discarded
                self.discarded = True
            else:
                self._refuse(self._parse_error(exc))
            return
        pieces = len(self._pieces)
        if pieces:
            if pieces > BUSY_READ_PIECES:
                self.give_turn()
            try:
                self._settle_body()
            except GatewayError as exc:
                self._refuse(exc)
                return
        if self._state == HEAD:
            self._head_fed += len(data)
            if self._head_fed > self._limits.max_header_bytes:
                self._refuse(self._head_too_large())
                return
        elif self._state == BODY and self._reading().chunked:
            payload = self._incoming._reserved if self._incoming is not None else 0
            if self._reading().framing_overflows(len(data), payload, self._limits):
                self._refuse(MalformedRequest("the request body's chunk framing is too long"))
                return
        self._clock.arm()

    def eof_received(self) -> bool:
        return False  # a client that closes its side is gone: close (and cancel its request)

    # -- llhttp callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self._continuing:
            return
        if self._read_last:
            # A request after one that closes, in the same read: llhttp parses on when it
            # took the connection for kept alive (HTTP/1.0 with close beside keep-alive).
            raise _PastTheLast
        self._limits = self.server.limits()
        self._state = HEAD
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
        if self._state == BODY:
            self._reading().trailer(name, value, self._limits)
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
        self._state = BODY
        self._body = None
        self._body_started = self._last_read

    def on_body(self, body: bytes) -> None:
        # Only kept here: a read of tiny chunks makes tens of thousands of these calls, so
        # the limits, the buffer and the pace are settled once per read (``_settle_body``).
        self._pieces.append(body)

    def on_message_complete(self) -> None:
        request = self._incoming
        assert request is not None
        self._settle_body(whole=True)
        if self._parser.should_upgrade():
            self._upgrade_skipped = True  # llhttp skipped the body: see _declined_upgrade
            return
        self._complete(request)

    def _reading(self) -> BodyReading:
        """The body being read, as ``body.BodyReading`` tracks it (made when first needed:
        most bodies arrive whole in the read that brought their head)."""
        if self._body is None:
            chunked = self._framing is not None and self._framing.startswith(b"Transfer")
            self._body = BodyReading(self._body_started, self._limits, chunked=chunked)
        return self._body

    def _settle_body(self, *, whole: bool = False) -> None:
        """Count the body bytes this read brought against the limits (raised when past
        one) and keep them; a body not ``whole`` yet has its pace credited."""
        pieces = self._pieces
        if not pieces:
            return
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        count = len(pieces)
        pieces.clear()
        request, limits, size = self._incoming, self._limits, len(data)
        assert request is not None
        if request._reserved + size > limits.max_body_bytes:
            raise BodyTooLarge(f"request body exceeds the limit of {limits.max_body_bytes} bytes")
        if not self.server.reserve(size, self):
            raise Overloaded(
                "the gateway holds as many request bodies as it may "
                "(server.max_buffered_body_bytes); retry shortly",
                retry_after_s=1.0,
                reason="body_buffer_full",
            )
        request._reserved += size
        if not request.body and request._buffer is None:
            request.body = data  # the whole body in one piece: the common case
        else:
            request.add_body(data)
        if not whole or self._body is not None:
            reading = self._reading()
            reading.pieces += count
            reading.arrived(size, self._last_read, limits)

    # -- requests ----------------------------------------------------------------------------
    def _request(self) -> Request:
        """The head just parsed as a ``Request``, or the refusal it deserves (raised)."""
        parser = self._parser
        head = read_head(
            parser.get_http_version(),
            parser.get_method().decode("ascii"),
            b"".join(self._url).decode("latin-1"),
            self._headers,
            self._limits,
        )
        keep_alive = parser.should_keep_alive()
        if keep_alive and head.version == "1.0" and _says_close(self._headers):
            # llhttp keeps an HTTP/1.0 connection open when "keep-alive" is among its
            # Connection options, even beside "close"; RFC 9112 9.6: close wins.
            keep_alive = False
        request = Request(self, head, self._headers, keep_alive, self.peer)
        self._framing = head.framing
        if head.framing is not None and head.expect:
            if self._active is None and not self._queue:
                self.write(CONTINUE)
            else:
                request._expect = True  # sent when the answers before it are done
        return request

    def _complete(self, request: Request) -> None:
        self._incoming = None
        self._state = WAIT
        self._read_last = not request.keep_alive
        request.body_complete()
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
            self._clock.arm()

    # -- bodies ----------------------------------------------------------------------------------
    def body_stall_s(self) -> float:
        """How far the body being read has fallen behind its pace (0: on pace, or no body
        being read): what the server cuts first when request bodies crowd its buffer."""
        if self._state != BODY or self._incoming is None:
            return 0.0
        return self._reading().stall_s(self._loop.time(), self._last_read, self._limits)

    def head_stall_s(self) -> float:
        """How long a head has been arriving, or a new connection has sent nothing (0:
        neither)."""
        if self._state == HEAD:
            return self._loop.time() - self._head_started
        if self._state == WAIT and self.requests == 0:
            return self._loop.time() - self._accepted
        return 0.0

    def held_bytes(self) -> int:
        """The body bytes of the request being read, held in the shared buffer."""
        return self._incoming._reserved if self._incoming is not None else 0

    def cut_stalled(self, reason: str) -> None:
        """The server needs the room this connection holds: its stalled request is a 408."""
        self.server.timed_out("body" if self._state == BODY else "head")
        self._refuse(RequestTimeout(reason))

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
        if in_target and self._state == HEAD:
            return MalformedRequest(f"the request target is longer than {limit} bytes", 414)
        return MalformedRequest(f"the request head is larger than {limit} bytes", 431)

    # -- timers --------------------------------------------------------------------------------
    def _deadline(self) -> Deadline | None:
        if self.closed:
            return None
        limits = self._limits
        if self._lingering:
            return self._linger_until, "linger"
        if self.write_paused:
            return self._paused_at + limits.client_send_timeout_s, "send"
        if self._reading_paused:
            return None
        if self._state == HEAD:
            return self._head_started + limits.header_timeout_s, "head"
        if self._state == BODY:
            return self._reading().deadline(self._last_read, limits)
        if self._active is None and not self._queue:
            if self.requests == 0:
                return self._accepted + limits.header_timeout_s, "head"
            if self.draining:
                return self._idle_since + LAST_CALL_S, "linger"
            return self._idle_since + limits.keepalive_timeout_s, "idle"
        return None

    def _expired(self, phase: str) -> None:
        if self.closed:
            return
        if phase == "linger":
            self.close()
            return
        limits = self._limits
        if phase == "body_whole":
            self.server.timed_out("body")
            whole = limits.body_deadline_s
            self._refuse(RequestTimeout(f"the request body took longer than {whole:g} s"))
            return
        self.server.timed_out(phase)
        if phase == "send":
            log.warning(
                "cut an answer to %s: unread for %g s", self.peer, limits.client_send_timeout_s
            )
            self.close(abort=True)
        elif phase == "idle" or (phase == "head" and self._state == WAIT):
            self.close()
        elif phase == "body" and limits.min_body_rate_bytes_s > 0:
            self._refuse(
                RequestTimeout(
                    f"the request body fell {limits.body_timeout_s:g} s behind the slowest "
                    f"pace served ({limits.min_body_rate_bytes_s} bytes/s)"
                )
            )
        else:
            what = "request head" if phase == "head" else "request body"
            limit = limits.header_timeout_s if phase == "head" else limits.body_timeout_s
            self._refuse(RequestTimeout(f"the {what} did not arrive within {limit:g} s"))


class _PastTheLast(Exception):
    """Raised to stop llhttp at a request after the last one: discarded (data_received)."""


def _says_close(headers: list[tuple[str, str]]) -> bool:
    """Whether any Connection header line lists the ``close`` option."""
    return any(
        key.lower() == "connection" and "close" in connection_options(value)
        for key, value in headers
    )
