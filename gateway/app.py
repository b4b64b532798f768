"""The gateway's runtime: the data plane's server (``server``) and the admin aiohttp app,
the live policy snapshot, and startup (warm-up), reload and graceful shutdown of everything.

Each request captures ``Gateway.snapshot`` once at the edge; a reload swaps that one
reference.  Long-lived state (upstream pools, later caches and breakers) lives here, keyed
by backend, and survives reloads.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from aiohttp import web

from gateway import stages
from gateway.admin.access import check_admin_token, is_loopback
from gateway.admin.routes import admin_routes
from gateway.cache.embedding_seam import TierFactory
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.edge import Edge
from gateway.errors import PolicyError
from gateway.metrics import Metrics
from gateway.metrics.loop_lag import LoopLag
from gateway.openai.allowed_models import AllowedModels
from gateway.pipeline import compose
from gateway.policy.load import Loaded
from gateway.policy.model import Server, Tracing
from gateway.policy.routing import Router
from gateway.policy.watch import PolicySource, Settling
from gateway.runtime import Runtime
from gateway.server.listener import HttpServer
from gateway.snapshot import Snapshot
from gateway.state import Registry
from gateway.tenant import NamedTenants
from gateway.transport.backends import Upstreams
from gateway.transport.discovery import Resolver
from gateway.transport.forward import Forward
from gateway.transport.forwarding import TrustedProxies
from gateway.transport.sizing import Demand
from gateway.transport.upstream import Transport
from gateway.transport.warmup import warm_up

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

    from gateway.tracing.otel import Tracer

log = logging.getLogger("gateway")
CLOSE_TIMEOUT_S = 0.3
"""After the drain: the most closing stores, pollers and pools may take."""
ADMIN_SHUTDOWN_S = 0.2
"""How long admin requests (a scrape, a probe) may take to finish at exit."""


class Gateway:
    """One gateway: its policy, pipeline, pools, metrics and listeners."""

    def __init__(
        self,
        source: PolicySource,
        *,
        transport: Transport | None = None,
        clock: Clock = SYSTEM_CLOCK,
        access_log: bool = False,
        embedding_tiers: TierFactory | None = None,
        resolver: Resolver | None = None,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.source = source
        self._span_exporter = span_exporter
        self.tracer: Tracer | None = None  # made when a policy first turns tracing on
        self._embedding_tiers = embedding_tiers
        self.clock = clock
        self.access_log = access_log
        self.metrics = Metrics()
        self.loop_lag = LoopLag(self.metrics.event_loop_lag, gc_pauses=self.metrics.gc_pause)
        self.demand: Demand = {}
        self._upstreams = (
            Upstreams(self.metrics, clock, resolver, self.demand) if transport is None else None
        )
        self.transport: Transport = transport if transport is not None else self._upstreams  # type: ignore[assignment]
        self.registry = Registry()
        self.inflight_requests = 0
        self.warmed = asyncio.Event()  # set once warm: what waits for readiness awaits it
        self.draining = False
        self._seen_fingerprint = ""
        self._runners: list[web.BaseRunner] = []
        self._server: HttpServer | None = None
        self._live = False
        self._tasks: list[asyncio.Task[None]] = []
        self._generation = 0
        loaded = source.load()  # an invalid first policy is fatal: raise to the caller
        first = source.read()
        self._seen_fingerprint = first.fingerprint
        self._settling = Settling(first, self.clock)
        self.snapshot = self._build(loaded)

    # -- policy ---------------------------------------------------------------------------
    def _build(self, loaded: Loaded) -> Snapshot:
        self._generation += 1
        policy = loaded.policy
        for warning in loaded.warnings:
            log.warning("policy: %s", warning)
        if self._upstreams is not None:
            self._upstreams.sync(policy)
        self.registry.begin()
        runtime = Runtime(self.metrics, self.registry, self.clock, self.transport, self.demand)
        built = stages.build(policy, runtime, embedding_tiers=self._embedding_tiers)
        tracer = self._tracer_for(policy.tracing)
        forward = Forward(self.transport)
        handler = compose(built, forward if tracer is None else tracer.forward(forward))
        self.registry.end()
        if self._live:  # a reload while running: start the pollers it added
            self.begin()
        self.metrics.set_policy(self._generation, loaded.digest, policy.metrics.const_labels)
        trusted = TrustedProxies(policy.server.trusted_proxies)
        named = policy.tenants
        tenants = (
            NamedTenants(named.by_digest(), required=named.required)
            if named.keys or named.required
            else None
        )
        return Snapshot(
            policy,
            loaded.digest,
            self._generation,
            Router(policy),
            handler,
            trusted,
            tracer,
            tenants,
            {
                name: AllowedModels(globs, own_responses=bool(named.response_id_secret))
                for name, globs in named.models().items()
            }
            or None,
        )

    def _tracer_for(self, settings: Tracing) -> Tracer | None:
        """The tracer while ``tracing.sample_ratio`` is above 0, at that ratio; made on first
        use and kept (a reload only moves its ratio), None without the ``otel`` extra."""
        if settings.sample_ratio <= 0:
            return None
        if self.tracer is None:
            try:
                from gateway.tracing.otel import Tracer
            except ImportError as exc:
                log.warning(
                    "tracing.sample_ratio is %g but OpenTelemetry is not installed (%s): "
                    "no traces; pip install 'sidecar-gateway[otel]'",
                    settings.sample_ratio,
                    exc,
                )
                return None
            try:
                self.tracer = Tracer(settings.sample_ratio, self._span_exporter)
            except ImportError as exc:  # the SDK without the OTLP exporter
                log.warning("tracing: no exporter (%s): no traces", exc)
                return None
        self.tracer.ratio = settings.sample_ratio
        return self.tracer

    def reload(self, *, force: bool = False) -> bool:
        """Re-read the policy; swap it in if valid and changed.  True when swapped."""
        fingerprint = self.source.fingerprint()
        if fingerprint == self._seen_fingerprint and not force:
            return False
        self._seen_fingerprint = fingerprint
        try:
            loaded = self.source.load()
        except PolicyError as exc:
            self.metrics.reload_failures.inc()
            log.error(
                "policy reload rejected, keeping generation %d:\n%s", self.snapshot.generation, exc
            )
            raise
        if loaded.digest == self.snapshot.digest and loaded.policy == self.snapshot.policy:
            return False  # the same text, and the same secrets from its ${file:...}
        old = self.snapshot.policy
        self.snapshot = self._build(loaded)
        log.info("policy generation %d loaded (%s)", self.snapshot.generation, loaded.digest)
        new_backends = [b for b in loaded.policy.backends if b.warmup and b not in old.backends]
        if new_backends:
            self._spawn(warm_up(self.transport, new_backends))
        return True

    async def _watch(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(
                self.snapshot.policy.server.reload_interval_s if interval_s <= 0 else interval_s
            )
            try:
                # Reading files may block (a slow volume): off the loop.  Applying a policy
                # touches live state: on the loop.
                reading = await asyncio.to_thread(self.source.read)
                settle_s = self.snapshot.policy.server.reload_settle_s
                if self._settling.ready(reading, settle_s):
                    self._poll()
                    self._settling.done(reading)
            except Exception:  # the watcher must outlive any one bad read
                log.exception("policy watch failed")

    def _poll(self) -> None:
        try:
            self.reload()
        except PolicyError:
            pass  # logged and counted in reload()

    # -- readiness --------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.warm and not self.draining

    @property
    def warm(self) -> bool:
        """The first warm-up is done (or was not asked for)."""
        return self.warmed.is_set()

    @warm.setter
    def warm(self, done: bool) -> None:
        if done:
            self.warmed.set()
        else:
            self.warmed.clear()

    def admin_token(self) -> str | None:
        return os.environ.get("GATEWAY_ADMIN_TOKEN") or self.snapshot.policy.admin.token

    def model_identity(self, name: str) -> str | None:
        """The version a ``model_version: auto`` backend is keyed by now (None: another)."""
        return self._upstreams.model_identity(name) if self._upstreams is not None else None

    # -- apps and listeners -----------------------------------------------------------------
    def admin_app(self, *, loopback: bool) -> web.Application:
        app = web.Application()
        app.router.add_routes(admin_routes(self, loopback=loopback))
        return app

    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 8080,
        admin_host: str | None = None,
        admin_port: int = 9090,
        *,
        watch_interval_s: float = 0.0,
        warmup: bool = True,
        reuse_port: bool = False,
        admin_socket: str | None = None,
    ) -> tuple[str, str]:
        """Listen on both ports; returns (data URL, admin URL) with the bound ports.  A
        worker of ``gateway serve --workers N`` shares the data port (``reuse_port``) and
        serves its admin app on a Unix socket only its supervisor reaches
        (``admin_socket``)."""
        admin_host = admin_host or host
        check_admin_token(self.admin_token())
        server = HttpServer(Edge(self).handle, self._limits, self.metrics)
        data_url = _url(await server.listen(host, port, reuse_port=reuse_port))
        self._server = server
        admin = web.AppRunner(
            self.admin_app(loopback=admin_socket is not None or is_loopback(admin_host)),
            access_log=None,
            shutdown_timeout=ADMIN_SHUTDOWN_S,
        )
        await admin.setup()
        if admin_socket is not None:
            await web.UnixSite(admin, admin_socket).start()
            admin_url = f"unix:{admin_socket}"
        else:
            site = web.TCPSite(admin, admin_host, admin_port, backlog=128, reuse_address=True)
            await site.start()
            sock = site._server.sockets[0]  # type: ignore[union-attr]
            admin_url = _url(sock.getsockname())
        self._runners.append(admin)
        self.begin()
        if self.source.watchable:
            self._spawn(self._watch(watch_interval_s))
        if warmup:
            self._spawn(self._warm_initial())
        else:
            self.warm = True
        return data_url, admin_url

    def begin(self) -> None:
        """On the running loop: start what runs in the background (telemetry pollers, the
        cache sweep, the event-loop lag sampler); from now on a reload starts what it adds.
        ``start`` calls it; a gateway without listeners (``harness.Pipeline``) calls it
        itself."""
        self._live = True
        self.registry.start()
        self.loop_lag.start()

    def _limits(self) -> Server:
        return self.snapshot.policy.server

    async def _warm_initial(self) -> None:
        await warm_up(self.transport, [b for b in self.snapshot.policy.backends if b.warmup])
        self.warm = True
        log.info("warm-up done; ready")

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def shutdown(self, grace_s: float | None = None) -> None:
        """The drain, within ``grace_s`` (the policy's ``shutdown_grace_s``) plus about a
        second: turn unready at once; refuse what waits in admission queues (503, never sent
        upstream); stop accepting; let requests in flight finish within the grace, then end
        each with an answer (``HttpServer.drain``); close the rest, the admin port last."""
        self.draining = True
        for task in list(self._tasks):
            task.cancel()
        await self.loop_lag.aclose()
        self.registry.drain()
        if self._server is not None:
            grace = self.snapshot.policy.server.shutdown_grace_s if grace_s is None else grace_s
            await self._server.drain(grace)
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                await self.registry.aclose()
                if self._upstreams is not None:
                    await self._upstreams.aclose()
        except TimeoutError:
            log.warning("closing stores and pools took over %g s; left to exit", CLOSE_TIMEOUT_S)
        if self.tracer is not None:
            await self.tracer.aclose()
        for runner in self._runners:  # the admin port closes last: the model server's hook
            await runner.cleanup()  # waits for it to know the gateway is gone
        self._runners.clear()

    def __repr__(self) -> str:
        s = self.snapshot
        return (
            f"<Gateway generation={s.generation} policy={s.digest} ready={self.ready} "
            f"inflight={self.inflight_requests}>"
        )


def _url(bound: tuple[str, int]) -> str:
    host = bound[0]
    return f"http://[{host}]:{bound[1]}" if ":" in host else f"http://{host}:{bound[1]}"
