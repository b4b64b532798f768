"""The supervisor of ``gateway serve --workers N``: N worker processes on one data port, one
admin port for them all.

- The data port: each worker binds its own listening socket with ``SO_REUSEPORT`` and the
  kernel spreads new connections over them.  The supervisor binds the port first (without
  listening, so it takes no connection) to fail at once when it is taken, to turn port 0
  into one port for all, and to hold it while a worker is replaced.
- A worker that exits is started again after its slot's ``Backoff``; the counters it last
  showed stay in the merged ``/metrics`` (``Retired``).
- SIGHUP (and ``POST /reload``) reaches every worker; one still starting gets it once it
  listens.
- SIGTERM: ``/readyz`` turns 503 at once, every worker drains as a single gateway does,
  within the policy's ``shutdown_grace_s`` plus about a second (one still running past
  that is killed), and the admin port closes last.

The supervisor reads the policy for itself too: the admin token, the grace, the constant
labels and the cache store (which decides how some gauges merge); it re-reads it when its
files change and keeps the last valid one.  It never imports the request pipeline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.admin.access import check_admin_token, is_loopback
from gateway.errors import PolicyError, WorkerError
from gateway.metrics.merged import Retired, SupervisorMetrics, merge, render
from gateway.policy.load import Loaded
from gateway.policy.model import Policy
from gateway.policy.watch import PolicySource
from gateway.workers.admin import Answer, supervisor_routes
from gateway.workers.backoff import Backoff
from gateway.workers.worker import Worker

log = logging.getLogger("gateway.workers")
STARTUP_TIMEOUT_S = 120.0
"""The most a worker may take from its start to listening (a local embedding model loads
first)."""
DRAIN_MARGIN_S = 1.5
"""After the grace: how long the workers have to end what they cut short and exit."""
ADMIN_SHUTDOWN_S = 0.2


@dataclass(frozen=True, slots=True)
class Plan:
    """What ``gateway serve --workers N`` runs."""

    workers: int
    worker_args: tuple[str, ...]
    """Each worker's ``gateway`` arguments (``serve``, the policy, the host, flags); the
    supervisor adds ``--port`` and ``--worker``."""
    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str = "127.0.0.1"
    admin_port: int = 9090


@dataclass(slots=True)
class Slot:
    """One of the N places a worker runs in: the worker now, its restarts and back-off."""

    index: int
    worker: Worker | None = None
    restarts: int = 0
    backoff: Backoff = field(default_factory=Backoff)
    hup_pending: bool = False
    """A reload came while its worker was starting: sent once it listens."""


class Supervisor:
    """The worker processes of one data port and their admin port."""

    def __init__(self, plan: Plan, source: PolicySource) -> None:
        self.plan = plan
        self.source = source
        self.metrics = SupervisorMetrics()
        self.retired = Retired()
        self.draining = False
        self.slots = [Slot(i) for i in range(plan.workers)]
        self.port = plan.port
        self._loaded: Loaded = source.load()
        self._fingerprint = source.fingerprint()
        self._reserved: socket.socket | None = None
        self._dir: str | None = None
        self._spawned = 0
        self._keepers: list[asyncio.Task[None]] = []
        self._runner: web.AppRunner | None = None
        self.metrics.workers.set_function(self.running)

    # -- the policy, as the supervisor reads it ---------------------------------------------
    def policy(self) -> Policy:
        """The policy's current valid content (re-read when its files changed)."""
        fingerprint = self.source.fingerprint()
        if fingerprint != self._fingerprint:
            self._fingerprint = fingerprint
            try:
                self._loaded = self.source.load()
            except PolicyError:
                pass  # the workers log and count it; the last valid one stays
        return self._loaded.policy

    def admin_token(self) -> str | None:
        return os.environ.get("GATEWAY_ADMIN_TOKEN") or self.policy().admin.token

    # -- start ------------------------------------------------------------------------------
    async def start(self) -> tuple[str, str]:
        """Bind the data port, serve the admin port (unready until every worker is), start
        every worker and wait until each listens; (data URL, admin URL).  WorkerError when
        a worker does not start, OSError when a port is taken."""
        check_admin_token(self.admin_token())
        self._reserved = _reserve(self.plan.host, self.plan.port)
        self.port = self._reserved.getsockname()[1]
        self._dir = tempfile.mkdtemp(prefix="gateway-workers-")
        app = web.Application()
        app.router.add_routes(supervisor_routes(self, loopback=is_loopback(self.plan.admin_host)))
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=ADMIN_SHUTDOWN_S)
        try:
            await self._runner.setup()
            site = web.TCPSite(
                self._runner, self.plan.admin_host, self.plan.admin_port, reuse_address=True
            )
            await site.start()
            admin = site._server.sockets[0].getsockname()  # type: ignore[union-attr]
            started = await asyncio.gather(
                *(self._spawn(slot) for slot in self.slots), return_exceptions=True
            )
            for outcome in started:
                if isinstance(outcome, BaseException):
                    raise outcome
        except (WorkerError, OSError):
            self.draining = True
            await self._stop_workers(0)
            await self._runner.cleanup()
            self._cleanup()
            raise
        loop = asyncio.get_running_loop()
        self._keepers = [loop.create_task(self._keep(slot)) for slot in self.slots]
        return _url(self.plan.host, self.port), _url(admin[0], admin[1])

    async def _spawn(self, slot: Slot) -> None:
        assert self._dir is not None
        self._spawned += 1
        path = os.path.join(self._dir, f"worker-{slot.index}-{self._spawned}.sock")
        args = (*self.plan.worker_args, "--port", str(self.port))
        slot.worker = None
        slot.worker = worker = await Worker.spawn(slot.index, args, path)
        await worker.listening(STARTUP_TIMEOUT_S)
        if slot.hup_pending:
            slot.hup_pending = False
            worker.signal(signal.SIGHUP)

    async def _keep(self, slot: Slot) -> None:
        """Start the slot's worker again whenever it exits, after its back-off."""
        while not self.draining:
            worker = slot.worker
            lived_s = 0.0
            if worker is not None:
                code = await worker.wait()
                lived_s = worker.lived_s()
                self.retired.add(worker.last)
                await worker.aclose()
                slot.worker = None
                if self.draining:
                    return
                log.warning(
                    "worker %d (pid %d) exited with %s after %.1f s",
                    slot.index,
                    worker.pid,
                    code,
                    lived_s,
                )
            delay_s = slot.backoff.delay_s(lived_s)
            log.info("starting worker %d again in %g s", slot.index, delay_s)
            await asyncio.sleep(delay_s)
            slot.restarts += 1
            self.metrics.worker_restarts.inc()
            try:
                await self._spawn(slot)
            except WorkerError as exc:
                if slot.worker is None:  # no process; one that exited is logged above
                    log.error("%s", exc)

    # -- what the admin port asks -----------------------------------------------------------
    def running(self) -> int:
        """Workers running and listening."""
        return sum(1 for s in self.slots if s.worker is not None and s.worker.running)

    def _running(self) -> list[Worker]:
        return [s.worker for s in self.slots if s.worker is not None and s.worker.running]

    async def readiness(self) -> str | None:
        if self.draining:
            return "shutting down"
        for slot in self.slots:
            if slot.worker is None or not slot.worker.running:
                return f"worker {slot.index} is not running"
        ready = await asyncio.gather(*(w.ready() for w in self._running()))
        for worker, ok in zip(self._running(), ready, strict=False):
            if not ok:
                return f"worker {worker.index} is not ready (warming up)"
        return None

    async def exposition(self) -> bytes:
        """The merged ``/metrics``; a worker that does not answer in time counts with what
        it showed last, so that no total goes down for a scrape."""
        workers = self._running()
        gathered = await asyncio.gather(*(w.metrics() for w in workers), return_exceptions=True)
        live = [
            g if isinstance(g, list) else w.last for w, g in zip(workers, gathered, strict=True)
        ]
        policy = self.policy()
        own = self.metrics.families(policy.metrics.const_labels)
        shared = policy.cache.store == "redis"
        return render(merge([*live, self.retired.families(), own], shared_store=shared))

    async def describe(self) -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(self._describe(slot) for slot in self.slots)))

    async def _describe(self, slot: Slot) -> dict[str, Any]:
        worker = slot.worker
        shown: dict[str, Any] = {
            "index": slot.index,
            "pid": worker.pid if worker is not None else None,
            "state": worker.state if worker is not None else "restarting",
            "restarts": slot.restarts,
        }
        if worker is not None and worker.running:
            shown["ready"] = await worker.ready()
            with contextlib.suppress(WorkerError):
                shown.update(_policy_of(await worker.metrics()))
        return shown

    async def forward(
        self, method: str, path: str, body: bytes, headers: dict[str, str], *, first: bool = False
    ) -> list[Answer]:
        workers = self._running()[:1] if first else self._running()
        return list(await asyncio.gather(*(_ask(w, method, path, body, headers) for w in workers)))

    async def reload(self, headers: dict[str, str]) -> list[Answer]:
        self.policy()
        self._pend_reload()
        return await self.forward("POST", "/reload", b"", headers)

    def hangup(self) -> None:
        """SIGHUP: to every worker listening; one starting gets it once it listens."""
        self.policy()
        self._pend_reload()
        for worker in self._running():
            worker.signal(signal.SIGHUP)

    def _pend_reload(self) -> None:
        for slot in self.slots:
            if slot.worker is not None and slot.worker.state == "starting":
                slot.hup_pending = True

    # -- shutdown ---------------------------------------------------------------------------
    async def shutdown(self) -> None:
        """Unready at once; every worker drains within the grace (plus about a second),
        then the admin port closes."""
        self.draining = True
        for task in self._keepers:
            task.cancel()
        await asyncio.gather(*self._keepers, return_exceptions=True)
        await self._stop_workers(self.policy().server.shutdown_grace_s)
        if self._runner is not None:
            await self._runner.cleanup()
        self._cleanup()

    async def _stop_workers(self, grace_s: float) -> None:
        workers = [s.worker for s in self.slots if s.worker is not None]
        for worker in workers:
            worker.signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            async with asyncio.timeout(grace_s + DRAIN_MARGIN_S):
                await asyncio.gather(*(w.wait() for w in workers))
        except TimeoutError:
            left = [w for w in workers if w.proc.returncode is None]
            log.warning("%d workers still running after the grace; killed", len(left))
            for worker in left:
                worker.kill()
            await asyncio.gather(*(w.wait() for w in left))
        for worker in workers:
            await worker.aclose()

    def _cleanup(self) -> None:
        if self._reserved is not None:
            self._reserved.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)

    def __repr__(self) -> str:
        return (
            f"<Supervisor port={self.port} workers={self.running()}/{len(self.slots)} "
            f"restarts={sum(s.restarts for s in self.slots)} draining={self.draining}>"
        )


async def supervise(plan: Plan, source: PolicySource) -> int:
    """``gateway serve --workers N`` until SIGTERM; its exit status."""
    supervisor = Supervisor(plan, source)
    stop = asyncio.Event()

    def stopping() -> None:  # unready, and no worker started again, from this moment
        supervisor.draining = True
        stop.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping)
    loop.add_signal_handler(signal.SIGINT, stopping)
    loop.add_signal_handler(signal.SIGHUP, supervisor.hangup)
    try:
        data_url, admin_url = await supervisor.start()
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 1
    except (WorkerError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"gateway listening on {data_url} (admin {admin_url}), {plan.workers} workers", flush=True
    )
    await stop.wait()
    grace_s = supervisor.policy().server.shutdown_grace_s
    log.info("SIGTERM: draining %d workers for up to %.0f s", plan.workers, grace_s)
    await supervisor.shutdown()
    log.info("stopped")
    return 0


async def _ask(worker: Worker, method: str, path: str, body: bytes, headers: Any) -> Answer:
    try:
        status, answer = await worker.call(method, path, body=body, headers=headers)
    except WorkerError as exc:
        status, answer = 502, json.dumps({"error": str(exc)}).encode()
    return Answer(worker.index, worker.pid, status, answer)


def _policy_of(families: list[Any]) -> dict[str, Any]:
    """A worker's policy generation and hash, from its metrics."""
    found: dict[str, Any] = {}
    for family in families:
        for sample in family.samples:
            if sample.name == "gateway_policy_generation":
                found["generation"] = int(sample.value)
            elif sample.name == "gateway_policy_info" and sample.value:
                found["hash"] = sample.labels.get("hash")
    return found


def _reserve(host: str, port: int) -> socket.socket:
    """The data port, bound with SO_REUSEPORT but not listening: taken by no connection."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
