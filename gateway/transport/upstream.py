"""Upstream connections: one keep-alive pool per backend (``pool.HostPool`` over the llhttp
client in ``connection``), timeouts, and which requests may be sent again.

Pools belong to a backend by name and URL (and the settings that shape a pool): a reload
that keeps them keeps the pool; one that changes them gets a fresh pool, and the old pool
closes once its in-flight requests are done.

A pooled keep-alive connection that the backend closed before answering is the one case
where a request is sent twice (a request that may not be, ``pool.SETTLE_S``, is written only
on a connection idle long enough to have heard a close, or on a new one).  The backend may
have run it before closing, so only requests that may be repeated are resent
(``resendable``): safe methods, inference calls (``routing.INFERENCE_PATH``: the OpenAI
endpoints, KServe/Triton V2 ``infer`` and ``generate``, TF Serving ``:predict``, and the
servers' own APIs: llama.cpp's ``/completion``, Ollama's ``/api/chat``, TGI's (its ``/``
too), TEI's, SGLang's, vLLM's; they run a model and change nothing), and any request with an
``Idempotency-Key``.  Any other POST, a PUT, PATCH or DELETE gets a 502
instead.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Protocol
from urllib.parse import urlsplit

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import Metrics
from gateway.pipeline import Reply, Spare
from gateway.policy.model import Backend
from gateway.policy.routing import INFERENCE_PATH
from gateway.transport.connection import Connection, StaleConnection
from gateway.transport.connection import Head as ResponseHead
from gateway.transport.headers import RESPONSE_OWNED, is_streamed, strip
from gateway.transport.pool import HostPool, heard
from gateway.transport.relocate import Relocation

# Answers up to this size that nobody reads piece by piece are read whole (by length,
# chunked or to the close) and answered with a Content-Length; larger ones, SSE and NDJSON
# streams, and answers to a client that asked to stream are relayed chunk by chunk.
BUFFER_LIMIT_BYTES = 1024 * 1024
_BACKGROUND: set[asyncio.Task[None]] = set()
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def resendable(method: str, path_qs: str, headers: list[tuple[str, str]]) -> bool:
    """Whether a request may be sent a second time after a stale keep-alive connection."""
    if method in SAFE_METHODS:
        return True
    if method == "POST" and INFERENCE_PATH.fullmatch(path_qs.partition("?")[0]):
        return True
    return any(k.lower() == "idempotency-key" for k, _ in headers)


class Transport(Protocol):
    """Sends a request to a backend and returns the reply (real: ``Upstreams``).
    ``affinity`` is the request's leading-context key, for a backend with
    ``prefix_affinity`` (``openai.prefix.leading_key``); a transport may ignore it.
    ``pin`` (``Call.pin``) picks the endpoint that holds what the request names, when the
    backend has several; ``model``, the model the request asks for, is for a ``kv_aware``
    backend's pick (its LoRA adapters)."""

    async def send(
        self,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        streaming: bool,
        affinity: str | None = None,
        pin: Callable[[str], bool] | None = None,
        model: str | None = None,
        spare: Spare | None = None,
    ) -> Reply: ...


def pool_key(backend: Backend, url: str | None = None) -> tuple[object, ...]:
    """What makes two backend definitions share a pool to ``url`` (default: its ``url``)."""
    return (
        backend.name,
        (backend.url if url is None else url).rstrip("/"),
        backend.max_connections,
        backend.verify_tls,
        backend.ca_bundle,
        backend.connect_timeout_s,
        backend.keepalive_s,
    )


class BackendPool:
    """Keep-alive connections to one backend URL (one endpoint), and the exchange over
    them."""

    def __init__(self, backend: Backend, metrics: Metrics, url: str | None = None) -> None:
        self.key = pool_key(backend, url)
        self.name = backend.name
        self.base_url = (backend.url if url is None else url).rstrip("/")
        parts = urlsplit(self.base_url)
        https = parts.scheme == "https"
        self._prefix = parts.path
        self._relocation = Relocation(self.base_url)
        port = parts.port or (443 if https else 80)
        self._host_header = (
            parts.hostname if parts.port is None else f"{parts.hostname}:{parts.port}"
        )
        self.inflight = 0
        self._limit = backend.max_connections
        counters = {  # resolved once: a label lookup takes a lock
            event: metrics.upstream_connections.labels(backend.name, event)
            for event in ("opened", "retired")
        }
        self._http = HostPool(
            backend.name,
            parts.hostname or "",
            port,
            ssl_context=_ssl_context(backend) if https else None,
            limit=backend.max_connections,
            connect_timeout_s=backend.connect_timeout_s,
            keepalive_s=backend.keepalive_s,
            counted=lambda event: counters[event].inc(),
        )
        self._retired = False
        self._closing = False
        self._closed = asyncio.Event()
        self._inflight_gauge = metrics.inflight.labels(backend.name)
        self._retry_counter = metrics.upstream_retries.labels(backend.name)
        self._upstream_hist = metrics.upstream_duration.labels(backend.name)

    @property
    def waiting(self) -> int:
        """Calls waiting for a free connection to this backend."""
        return self._http.waiting

    def _head(
        self, method: str, path_qs: str, headers: list[tuple[str, str]], body: bytes
    ) -> bytes:
        lines = [f"{method} {self._prefix}{path_qs} HTTP/1.1", f"Host: {self._host_header}"]
        lines.extend(f"{k}: {v}" for k, v in headers)
        if body or method in _BODY_METHODS:
            lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")

    async def send(
        self,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        streaming: bool,
    ) -> Reply:
        """Send one request; a streamed reply holds its connection until ``close``."""
        head = self._head(method, path_qs, headers, body)
        timeout_s = backend.stream_timeout_s if streaming else backend.timeout_s
        loop = self._http.loop
        started = loop.time()
        self.inflight += 1
        self._inflight_gauge.inc()
        released = False

        async def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.inflight -= 1
                self._inflight_gauge.dec()
                if self._retired and self.inflight == 0:
                    await self._close_pool()

        again = resendable(method, path_qs, headers)
        try:
            conn, resp = await self._exchange(
                head, body, method, timeout_s, backend.idle_timeout_s, again
            )
        except BaseException:
            await release()
            raise
        self._upstream_hist.observe(loop.time() - started)
        headers_out = self._relocation.headers(tuple(strip(resp.headers, RESPONSE_OWNED)))
        length = resp.content_length
        prefix: list[bytes] = []
        if method != "HEAD" and not streaming and not is_streamed(resp.headers):
            # An answer nobody reads piece by piece: read it whole, up to the buffer limit,
            # so that one whose framing breaks is a 502 rather than a cut answer.
            whole = conn.whole_body()  # the common case: it came with the head
            if whole is not None:
                self._http.release(conn)
                await release()
                return Reply(
                    resp.status, headers_out, body=whole, backend=self.name, endpoint=self.base_url
                )
            if length is None or length <= BUFFER_LIMIT_BYTES:
                try:
                    data, complete = await _read_up_to(conn, prefix, BUFFER_LIMIT_BYTES)
                except BaseException:
                    conn.close()
                    self._http.release(conn)
                    await release()
                    raise
                if complete:
                    self._http.release(conn)
                    await release()
                    return Reply(
                        resp.status,
                        headers_out,
                        body=data,
                        backend=self.name,
                        endpoint=self.base_url,
                    )

        async def close() -> None:
            if not conn.complete:
                conn.close()  # the backend sees the disconnect and stops generating
            self._http.release(conn)
            await release()

        return Reply(
            resp.status,
            headers_out,
            stream=_chunks(conn, prefix),
            backend=self.name,
            close=close,
            content_length=length,
            endpoint=self.base_url,
        )

    async def _exchange(
        self,
        head: bytes,
        body: bytes,
        method: str,
        timeout_s: float,
        idle_s: float,
        resend: bool,
    ) -> tuple[Connection, ResponseHead]:
        deadline = self._http.loop.time() + timeout_s
        settled = not resend  # written once: never on a connection that may be closing
        for attempt in (1, 2):
            # Waiting for a free pooled connection counts against the exchange's time: a
            # pool full of long streams must not hold a request forever.
            found = self._http.idle_connection(settled=settled) if attempt == 1 else None
            try:
                if found is not None:
                    conn = found
                else:
                    async with asyncio.timeout_at(deadline):
                        conn = await self._http.acquire(fresh=attempt == 2, settled=settled)
            except TimeoutError as exc:
                raise UpstreamTimeout(
                    f"no free connection to backend {self.name!r} within {timeout_s:g} s "
                    f"(max_connections {self._limit} in use)",
                    self.name,
                ) from exc
            remaining_s = max(deadline - self._http.loop.time(), 0.001)
            try:
                resp = await conn.send(
                    head, body, no_body=method == "HEAD", timeout_s=remaining_s, idle_s=idle_s
                )
                heard(conn, resp.headers)
                return conn, resp
            except StaleConnection as exc:
                # A pooled keep-alive socket the backend closed without answering: most
                # likely before it read the request, so a request that may be repeated is
                # sent once more on a connection that is certainly new.
                self._http.release(conn)
                if attempt == 1 and resend:
                    self._retry_counter.inc()
                    continue
                why = "" if resend else f" (a {method} is not sent twice)"
                raise UpstreamUnavailable(
                    f"backend {self.name!r} closed the connection without answering{why}",
                    self.name,
                ) from exc
            except BaseException:
                conn.close()
                self._http.release(conn)
                raise
        raise AssertionError("unreachable")  # pragma: no cover

    @property
    def closed(self) -> bool:
        return self._closed.is_set() or self._closing

    def retire_after_use(self) -> None:
        """Close when the next request in flight is done (a one-off pool)."""
        self._retired = True

    def retire(self) -> None:
        """Close once the requests in flight are done (a reload replaced this pool)."""
        self._retired = True
        if self.inflight == 0:
            self._closing = True
            task = asyncio.get_running_loop().create_task(self._close_pool())
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    async def _close_pool(self) -> None:
        self._closing = True
        self._http.close()
        self._closed.set()

    async def aclose(self) -> None:
        """Close now."""
        await self._close_pool()

    def __repr__(self) -> str:
        state = "retired" if self._retired else "live"
        return (
            f"<BackendPool {self.name} {self.base_url} {state} inflight={self.inflight} "
            f"limit={self._limit}>"
        )


async def _read_up_to(conn: Connection, prefix: list[bytes], limit: int) -> tuple[bytes, bool]:
    """Read the body while it fits in ``limit``: (the body, True) when it ended within it,
    else (b"", False) with what was read left in ``prefix`` for the stream to start with."""
    size = 0
    chunks = conn.body_chunks()
    async for chunk in chunks:
        prefix.append(chunk)
        size += len(chunk)
        if size > limit:
            await chunks.aclose()
            return b"", False
    data = prefix[0] if len(prefix) == 1 else b"".join(prefix)
    prefix.clear()
    return data, True


async def _chunks(conn: Connection, prefix: list[bytes]) -> AsyncIterator[bytes]:
    if prefix:
        yield b"".join(prefix)
        prefix.clear()
    async for chunk in conn.body_chunks():
        yield chunk


def _ssl_context(backend: Backend) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=backend.ca_bundle)
    if not backend.verify_tls:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context
