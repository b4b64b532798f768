"""Keep-alive HTTP/1.1 connections to one backend host, for the client in ``connection``.

At most ``limit`` connections are open; callers past it wait in line.  An idle connection is
reused most recently used first, and one that the backend closed while idle leaves the pool.
A request that may not be sent twice (``upstream.resendable``) is given only a connection
idle for ``SETTLE_S`` or a new one: a server may close a connection right after an answer it
framed as kept alive (llama.cpp's server does after every stream, its FIN some 50 us behind
the last chunk), and a request written in between is lost with the connection, which only a
request that may be repeated survives.  Nor is any request written on a connection idle for
its backend's ``keepalive_s`` (or the server's own ``Keep-Alive: timeout=N`` less
``HINT_MARGIN_S``): a server closes an idle connection at its keep-alive timeout, and a
request that crosses the close on the wire is lost (uvicorn, under vLLM, closes after 5 s
and says nothing); such a connection is closed instead.

Connecting is where the socket's errors become the gateway's: a connect timeout is
``UpstreamTimeout``, any other socket or TLS error (refused, unreachable, a failed
handshake) ``ConnectFailed`` (an ``UpstreamUnavailable``).
"""

from __future__ import annotations

import asyncio
import collections
import re
import socket
import ssl
from collections.abc import Callable, Iterable

from gateway.errors import ConnectFailed, UpstreamTimeout
from gateway.transport.connection import Connection

SETTLE_S = 0.01
"""How long a connection must have been idle before a request that may not be sent twice
is written on it: long past the FIN of a server that closes after its answer."""
HINT_MARGIN_S = 1.0
"""Taken off a server's keep-alive hint (as Node's undici does): its clock started before
the gateway's, and a request must cross the wire before the server's timer runs out."""
_TIMEOUT = re.compile(r"(?:^|[,;\s])timeout\s*=\s*(\d+(?:\.\d+)?)", re.IGNORECASE)


def heard(conn: Connection, headers: Iterable[tuple[str, str]]) -> None:
    """Note on ``conn`` how long its server keeps it open idle, from a ``Keep-Alive:
    timeout=N`` header of its answer (HTTP/1.1 servers such as llama.cpp's send one)."""
    for name, value in headers:
        if len(name) == 10 and name.lower() == "keep-alive":
            found = _TIMEOUT.search(value)
            if found is not None:
                hint = float(found.group(1))
                conn.keep_s = max(hint - HINT_MARGIN_S, hint / 2)
            return


class HostPool:
    """Keep-alive connections to one host, at most ``limit`` open; callers past it wait."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None,
        limit: int,
        connect_timeout_s: float,
        keepalive_s: float = float("inf"),
        counted: Callable[[str], None] = lambda event: None,
    ) -> None:
        self.name = name
        self.host = host
        self.port = port
        self.loop = asyncio.get_running_loop()
        self._ssl = ssl_context
        self._limit = limit
        self._connect_timeout_s = connect_timeout_s
        self._keepalive_s = keepalive_s
        self._counted = counted  # "opened", "retired"
        self._idle: list[Connection] = []
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False

    @property
    def waiting(self) -> int:
        """Callers waiting for a connection (every one of ``limit`` is in use)."""
        return len(self._waiters)

    def idle_connection(self, *, settled: bool = False) -> Connection | None:
        """An idle connection at once (most recently used first; with ``settled``, only
        one idle for ``SETTLE_S``), or None.  One idle past its keep-alive is closed."""
        now = self.loop.time()
        since = now - SETTLE_S if settled else float("inf")
        for at in range(len(self._idle) - 1, -1, -1):
            conn = self._idle[at]
            if conn.closed or now - conn.idle_since >= min(conn.keep_s, self._keepalive_s):
                del self._idle[at]
                self._open -= 1
                if not conn.closed:
                    conn.close()
                    self._counted("retired")
            elif conn.idle_since <= since:
                del self._idle[at]
                return conn
        return None

    async def acquire(self, *, fresh: bool = False, settled: bool = False) -> Connection:
        """An idle connection (most recently used first; with ``settled``, one idle for
        ``SETTLE_S``) or a new one (``fresh``: always new)."""
        while True:
            if not fresh and (conn := self.idle_connection(settled=settled)) is not None:
                return conn
            if self._open < self._limit:
                break
            if self._idle:  # only idle ones it may not have: one makes room for a new one
                self._idle.pop(0).close()
                self._open -= 1
                continue
            waiter = self.loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        self._open += 1
        try:
            return await self._connect()
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _connect(self) -> Connection:
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await self.loop.create_connection(
                    lambda: Connection(self.name, self.loop),
                    self.host,
                    self.port,
                    ssl=self._ssl,
                    server_hostname=self.host if self._ssl else None,
                )
        except TimeoutError as exc:
            raise UpstreamTimeout(
                f"connecting to backend {self.name!r} timed out", self.name
            ) from exc
        except (OSError, ssl.SSLError) as exc:
            raise ConnectFailed(
                f"cannot connect to backend {self.name!r}: {exc}", self.name
            ) from exc
        conn.on_close = self.forget
        self._counted("opened")
        sock = conn.transport.get_extra_info("socket") if conn.transport else None
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass
        return conn

    def release(self, conn: Connection) -> None:
        """Hand a connection back: kept when its exchange completed cleanly, else closed."""
        if conn.reusable and conn.complete and not conn.closed and not self._closed:
            conn.idle_since = self.loop.time()
            self._idle.append(conn)
        else:
            if not conn.closed:
                conn.close()
            self._open -= 1
        self._wake_one()

    def forget(self, conn: Connection) -> None:
        """A connection that closed while idle (the backend's keep-alive ran out, or it sent
        bytes nobody asked for) leaves the pool."""
        if conn in self._idle:
            self._idle.remove(conn)
            self._open -= 1
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            conn.close()
        self._open -= len(self._idle)
        self._idle.clear()

    def __repr__(self) -> str:
        return (
            f"<HostPool {self.name} {self.host}:{self.port} open={self._open}/"
            f"{self._limit} idle={len(self._idle)} waiting={len(self._waiters)}>"
        )
