"""One request of the data plane as the edge sees it, and how its answer goes back: whole
in one write, or streamed (by length, or chunked) with back-pressure.  Also what llhttp
admits but the gateway refuses in a request head (``read_head``).

The request writes through its connection, which it knows only as a ``Wire``.
"""

from __future__ import annotations

import re
from typing import Protocol

from gateway.errors import BodyTooLarge, MalformedRequest, Overloaded
from gateway.policy.model import Server as Limits
from gateway.server.target import normalise
from gateway.wire import http_date, response_head

_VERSIONS = frozenset({"1.1", "1.0"})
_REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
NO_BODY_STATUS = frozenset({204, 304})
_HOST = re.compile(
    r"(?:\[[0-9A-Fa-f:.]+\]"  # IP-literal (IPv6, no zone)
    r"|(?:[A-Za-z0-9\-._~!$&'()*+,;=]|%[0-9A-Fa-f]{2})*)"  # IPv4 or reg-name
    r"(?::[0-9]*)?"
)
"""RFC 9112 3.2: ``Host = uri-host [ ":" port ]`` (RFC 3986's host and port)."""
_PLAIN_HOST = re.compile(r"[A-Za-z0-9.\-]+(?::[0-9]+)?")
"""A name or IPv4 address with an optional port: the common case, checked first."""


class Wire(Protocol):
    """What a request writes its answer through (its client connection)."""

    closing: bool
    write_paused: bool

    @property
    def draining(self) -> bool: ...

    @property
    def keep_alive(self) -> str: ...

    def write(self, data: bytes) -> None: ...

    def writelines(self, parts: tuple[bytes, ...]) -> None: ...

    async def drain(self) -> None: ...

    def close(self, *, abort: bool = False) -> None: ...


class Head:
    """A request head that passed ``read_head``: what the request needs, and its framing."""

    __slots__ = ("expect", "framing", "host", "method", "path", "query", "version")

    def __init__(
        self,
        method: str,
        path: str,
        query: str,
        version: str,
        host: str,
        framing: bytes | None,
        expect: bool,
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.version = version
        self.host = host
        self.framing = framing
        self.expect = expect


def read_head(
    version: str, method: str, target: str, headers: list[tuple[str, str]], limits: Limits
) -> Head:
    """What llhttp admits but a proxy must not serve, refused (raised); else the ``Head``.
    ``framing`` is the head's own body framing (``Content-Length: n`` or chunked), None
    without a body."""
    if version not in _VERSIONS:
        raise MalformedRequest(f"HTTP/{version} is not served; use HTTP/1.1", 505)
    if method in _REFUSED_METHODS or method not in limits.allowed_methods:
        error = MalformedRequest(f"{method} is not served by the gateway", 405)
        error.extra_headers = (("Allow", ", ".join(limits.allowed_methods)),)
        raise error
    path, query = normalise(target)
    host: str | None = None
    seen_auth = chunked = expect = False
    length = 0
    for key, value in headers:
        lower = key.lower()
        if lower == "host":
            if host is not None:
                raise MalformedRequest("more than one Host header")
            host = value.strip()
            if _PLAIN_HOST.fullmatch(host) is None and _HOST.fullmatch(host) is None:
                raise MalformedRequest(f"Host {host[:100]!r} is not a host and port")
        elif lower == "authorization":
            if seen_auth:
                raise MalformedRequest("more than one Authorization header")
            seen_auth = True
        elif lower == "transfer-encoding":
            if version == "1.0":
                # RFC 9112 6.1: its framing is faulty (a 1.0 peer may have kept part of
                # the body); nginx refuses it the same way.
                raise MalformedRequest(
                    "Transfer-Encoding is not HTTP/1.0; send Content-Length, or use HTTP/1.1"
                )
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
    if length > limits.max_body_bytes:
        raise BodyTooLarge(
            f"request body of {length} bytes exceeds the limit of {limits.max_body_bytes}"
        )
    framing = None
    if chunked:
        framing = b"Transfer-Encoding: chunked\r\n"
    elif length:
        framing = b"Content-Length: %d\r\n" % length
    return Head(method, path, query, version, host or "", framing, expect and version == "1.1")


def shutting_down() -> Overloaded:
    return Overloaded("the gateway is shutting down; retry", retry_after_s=1.0, reason="shutdown")


class Request:
    """One request as the edge sees it, and the way its answer goes back.

    ``path`` and ``query`` are the normalised target (``target.normalise``); ``headers`` are
    as received, in order; ``host`` is the Host header.  Answer with ``respond`` (one write),
    or ``start``, ``write``... and ``end`` (a stream); ``cut`` ends a stream that cannot be
    completed, so the client sees it incomplete.
    """

    __slots__ = (
        "_buffer",
        "_chunked",
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
        conn: Wire,
        head: Head,
        headers: list[tuple[str, str]],
        keep_alive: bool,
        peer: str,
    ) -> None:
        self._conn = conn
        self.method = head.method
        self.path = head.path
        self.query = head.query
        self.version = head.version
        self.headers = headers
        self.host = head.host
        self.keep_alive = keep_alive
        self.peer = peer
        self.body = b""
        self.started = False
        self.finished = False
        self.sent = 0
        self.interrupted = False
        self._close_delimited = False
        self._buffer: bytearray | None = None
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

    def add_body(self, data: bytes) -> None:
        """Keep a piece of the body as it arrives: in one growing buffer from the second
        piece on, so that a body sent in tiny pieces costs its size, not an object per
        piece (a 2-byte chunk kept as bytes costs 35 bytes)."""
        if self._buffer is not None:
            self._buffer += data
        elif not self.body:
            self.body = data
        else:
            self._buffer = bytearray(self.body)
            self._buffer += data

    def body_complete(self) -> None:
        """The body is whole: ``body`` is its bytes."""
        if self._buffer is not None:
            self.body = bytes(self._buffer)
            self._buffer = None

    # -- answering ---------------------------------------------------------------------------
    def _framing(self, status: int, length: int | None) -> str:
        conn = self._conn
        self._keep = self._keep and not conn.closing and not conn.draining
        lines = f"Date: {http_date()}\r\n"
        if status not in NO_BODY_STATUS and status >= 200:
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
            lines += "Connection: keep-alive\r\n" + conn.keep_alive
        else:
            lines += conn.keep_alive
        return lines

    def respond(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        """The whole answer in one write (no body bytes for HEAD, 204 and 304)."""
        head = response_head(status, headers, self._framing(status, len(body)))
        self.started = self.finished = True
        if self.method == "HEAD" or status in NO_BODY_STATUS:
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
        if self.method == "HEAD" or status in NO_BODY_STATUS:
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
        """Complete a streamed answer with ``data`` as its last piece, without waiting on the
        client (the drain's last word to a stream it cuts short).  A chunked answer ends
        whole and, if its head said keep-alive, its connection stays for what is left of the
        drain: its client may be sending its next request already, which gets a 503
        (``turns``) rather than a reset.  Any other answer ends only by closing."""
        if self._length is None and data:
            if self._chunked:
                self._conn.writelines((b"%x\r\n" % len(data), data, b"\r\n0\r\n\r\n"))
            else:
                self._conn.write(data)
        elif self._chunked:
            self._conn.write(b"0\r\n\r\n")
        self.finished = True
        if not self._chunked:
            self._keep = False
            self._conn.close()

    def cut(self) -> None:
        """End an answer that cannot be completed: the connection closes mid-answer."""
        self.finished = True
        self._keep = False
        self._conn.close(abort=self._conn.write_paused)

    def __repr__(self) -> str:
        return f"<Request {self.method} {self.path} started={self.started} sent={self.sent}>"
