"""Upstream connections: one keep-alive pool per backend, timeouts, and the translation of
aiohttp's exceptions into the gateway's (the only place they are caught).

Pools belong to a backend by name and URL (and the settings that shape a pool): a reload
that keeps them keeps the pool; one that changes them gets a fresh pool, and the old pool
closes once its in-flight requests are done.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Protocol

import aiohttp
from aiohttp import ClientTimeout, TraceConfig, TraceConnectionReuseconnParams

from .errors import UpstreamError, UpstreamTimeout, UpstreamUnavailable
from .headers import RESPONSE_OWNED, strip
from .metrics import Metrics
from .pipeline import Reply
from .policy.model import Backend, Policy

# Bodies up to this size are read whole and answered with a Content-Length; larger ones,
# chunked ones and SSE streams are relayed chunk by chunk.
BUFFER_LIMIT_BYTES = 1024 * 1024
_SKIP_AUTO = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
_BACKGROUND: set[asyncio.Task[None]] = set()


class Transport(Protocol):
    """Sends a request to a backend and returns the reply (real: ``Upstreams``)."""

    async def send(
        self,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        streaming: bool,
    ) -> Reply: ...


def pool_key(backend: Backend) -> tuple[object, ...]:
    """What makes two backend definitions share a pool."""
    return (
        backend.name,
        backend.url.rstrip("/"),
        backend.max_connections,
        backend.verify_tls,
        backend.ca_bundle,
    )


async def _on_reuse(
    _session: aiohttp.ClientSession, ctx: SimpleNamespace, _params: TraceConnectionReuseconnParams
) -> None:
    if isinstance(ctx.trace_request_ctx, dict):
        ctx.trace_request_ctx["reused"] = True


class Pool:
    """Keep-alive connections to one backend URL."""

    def __init__(self, backend: Backend, metrics: Metrics) -> None:
        self.key = pool_key(backend)
        self.name = backend.name
        self.base_url = backend.url.rstrip("/")
        self.inflight = 0
        self._metrics = metrics
        self._ssl = _ssl_context(backend)
        self._limit = backend.max_connections
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._retired = False
        self._closing = False
        self._closed = asyncio.Event()
        self._inflight_gauge = metrics.inflight.labels(backend.name)
        self._retry_counter = metrics.upstream_retries.labels(backend.name)
        self._upstream_hist = metrics.upstream_duration.labels(backend.name)

    def _make_session(self, *, fresh: bool) -> aiohttp.ClientSession:
        trace = TraceConfig()
        trace.on_connection_reuseconn.append(_on_reuse)
        connector = aiohttp.TCPConnector(
            limit=self._limit,
            limit_per_host=0,
            ssl=self._ssl,
            force_close=fresh,
            ttl_dns_cache=10,
            enable_cleanup_closed=False,
        )
        return aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,
            skip_auto_headers=_SKIP_AUTO,
            trace_configs=[trace],
            cookie_jar=aiohttp.DummyCookieJar(),
        )

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
        """Send one request; the reply holds the connection until its ``close``."""
        if self._session is None:
            self._session = self._make_session(fresh=False)
        timeout = ClientTimeout(
            total=backend.stream_timeout_s if streaming else backend.timeout_s,
            sock_connect=backend.connect_timeout_s,
            sock_read=backend.idle_timeout_s,
        )
        url = self.base_url + path_qs
        loop = asyncio.get_running_loop()
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
                    await self._close_sessions()

        try:
            resp = await self._request(method, url, headers, body, timeout)
        except BaseException:
            await release()
            raise
        self._upstream_hist.observe(loop.time() - started)
        return await self._reply(resp, release)

    async def _request(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes,
        client_timeout: ClientTimeout,
    ) -> aiohttp.ClientResponse:
        ctx: dict[str, bool] = {"reused": False}
        session = self._session
        assert session is not None
        for attempt in (1, 2):
            try:
                return await session.request(
                    method,
                    url,
                    headers=headers,
                    data=body or None,
                    timeout=client_timeout,
                    allow_redirects=False,
                    trace_request_ctx=ctx,
                )
            except aiohttp.ClientConnectorError as exc:
                raise UpstreamUnavailable(
                    f"cannot connect to backend {self.name!r}: {exc.os_error or exc}", self.name
                ) from exc
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                # A pooled keep-alive socket the backend had already closed: nothing was
                # answered, so send once more on a connection that is certainly new.
                if attempt == 1 and ctx["reused"]:
                    self._retry_counter.inc()
                    if self._fresh is None:
                        self._fresh = self._make_session(fresh=True)
                    session = self._fresh
                    ctx = {"reused": False}
                    continue
                raise UpstreamUnavailable(
                    f"backend {self.name!r} closed the connection: {exc}", self.name
                ) from exc
            except TimeoutError as exc:
                raise UpstreamTimeout(
                    f"backend {self.name!r} did not answer in time", self.name
                ) from exc
            except aiohttp.ClientError as exc:
                raise UpstreamUnavailable(
                    f"backend {self.name!r} failed: {exc}", self.name
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _reply(self, resp: aiohttp.ClientResponse, release: _Release) -> Reply:
        headers = tuple(
            strip(
                ((k.decode("latin-1"), v.decode("latin-1")) for k, v in resp.raw_headers),
                RESPONSE_OWNED,
            )
        )
        length = resp.content_length
        ctype = resp.headers.get("Content-Type", "")
        if (
            length is not None
            and length <= BUFFER_LIMIT_BYTES
            and not ctype.startswith("text/event-stream")
        ):
            try:
                body = await resp.read()
            except BaseException as exc:
                resp.close()
                await release()
                if isinstance(exc, Exception):
                    raise _translate(exc, self.name) from exc
                raise
            resp.release()
            await release()
            return Reply(resp.status, headers, body=body, backend=self.name)

        async def close() -> None:
            if resp.content.at_eof():
                resp.release()
            else:
                resp.close()  # the backend sees the disconnect and stops generating
            await release()

        return Reply(
            resp.status,
            headers,
            stream=_chunks(resp, self.name),
            backend=self.name,
            close=close,
            notes={"content_length": length},
        )

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
            task = asyncio.get_running_loop().create_task(self._close_sessions())
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)

    async def _close_sessions(self) -> None:
        self._closing = True
        for session in (self._session, self._fresh):
            if session is not None and not session.closed:
                await session.close()
        self._closed.set()

    async def aclose(self) -> None:
        """Close now."""
        await self._close_sessions()

    def __repr__(self) -> str:
        state = "retired" if self._retired else "live"
        return (
            f"<Pool {self.name} {self.base_url} {state} inflight={self.inflight} "
            f"limit={self._limit}>"
        )


class _Release(Protocol):
    async def __call__(self) -> None: ...


async def _chunks(resp: aiohttp.ClientResponse, name: str) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.content.iter_any():
            yield chunk
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _translate(exc, name) from exc


def _translate(exc: Exception, name: str) -> UpstreamError:
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(f"backend {name!r} went silent mid-response", name)
    return UpstreamUnavailable(f"backend {name!r} broke off the response: {exc}", name)


def _ssl_context(backend: Backend) -> ssl.SSLContext | bool:
    if not backend.url.startswith("https://"):
        return False
    if not backend.verify_tls:
        return False
    return ssl.create_default_context(cafile=backend.ca_bundle)


class Upstreams:
    """The real transport: a pool per backend, kept across reloads while its key holds."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._pools: dict[str, Pool] = {}
        self._retired: dict[tuple[object, ...], Pool] = {}

    def sync(self, policy: Policy) -> None:
        """Make the pools match ``policy``: keep, replace (retiring the old) or drop."""
        wanted = {b.name: b for b in policy.backends}
        for name, pool in list(self._pools.items()):
            backend = wanted.get(name)
            if backend is None or pool_key(backend) != pool.key:
                pool.retire()
                del self._pools[name]
                if not pool.closed:
                    self._retired[pool.key] = pool
        self._retired = {k: p for k, p in self._retired.items() if not p.closed}
        for name, backend in wanted.items():
            if name not in self._pools:
                self._pools[name] = Pool(backend, self._metrics)

    def pool(self, backend: Backend) -> Pool:
        """The live pool of ``backend`` (a request started on an older policy still gets the
        pool its backend's URL calls for)."""
        pool = self._pools.get(backend.name)
        if pool is not None and pool.key == pool_key(backend):
            return pool
        retired = self._retired.get(pool_key(backend))
        if retired is not None and not retired.closed:
            return retired
        pool = Pool(backend, self._metrics)
        pool.retire_after_use()
        return pool

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
        return await self.pool(backend).send(
            backend, method, path_qs, headers, body, streaming=streaming
        )

    async def aclose(self) -> None:
        for pool in [*self._pools.values(), *self._retired.values()]:
            await pool.aclose()
        self._pools.clear()
        self._retired.clear()

    def __repr__(self) -> str:
        return f"<Upstreams {list(self._pools.values())!r}>"
