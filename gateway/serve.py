"""``gateway serve`` as a process: one gateway until SIGTERM, reloading on SIGHUP; the same
as a worker of a supervisor (``--worker``: the data port shared, the admin app on the
supervisor's socket, and an exit once the supervisor is gone); or, with ``--workers N``,
that supervisor (``workers.supervisor``).  ``cli`` parses the command line into
``ServeOptions``."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import Any

from gateway.errors import PolicyError
from gateway.policy.watch import PolicySource

log = logging.getLogger("gateway")

HEAP_SETTLED_S = (0.0, 60.0)
"""When the heap is frozen (``settle_heap``): once ready, and again a minute later, when what
the first requests import (a cache's normaliser, a tier's model) is there too."""


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """``gateway serve``'s flags."""

    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str | None = None
    admin_port: int = 9090
    access_log: bool = False
    workers: int = 1
    worker_args: tuple[str, ...] = ()
    """A worker's ``gateway`` arguments but ``--port`` and ``--worker`` (with ``workers``)."""
    worker_socket: str | None = None
    """``--worker``: this process is a supervisor's worker, its admin app on this socket."""


async def serve(options: ServeOptions, source: PolicySource) -> int:
    """Serve until SIGTERM (or SIGINT); the exit status."""
    if options.workers > 1 and options.worker_socket is None:
        from gateway.workers.supervisor import Plan, supervise

        plan = Plan(
            options.workers,
            options.worker_args,
            options.host,
            options.port,
            options.admin_host or options.host,
            options.admin_port,
        )
        return await supervise(plan, source)
    from gateway.app import Gateway

    gateway = Gateway(source, access_log=options.access_log)
    try:
        data_url, admin_url = await gateway.start(
            options.host,
            options.port,
            options.admin_host,
            options.admin_port,
            reuse_port=options.worker_socket is not None,
            admin_socket=options.worker_socket,
        )
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        await gateway.shutdown(0)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload_on_signal, gateway)
    if options.worker_socket is not None:
        loop.add_reader(sys.stdin.fileno(), _on_supervisor_pipe, loop, stop)
    print(f"gateway listening on {data_url} (admin {admin_url})", flush=True)
    settling = loop.create_task(settle_heap(gateway))
    await stop.wait()
    settling.cancel()
    grace = gateway.snapshot.policy.server.shutdown_grace_s
    log.info("SIGTERM: draining for up to %.0f s", grace)
    await gateway.shutdown(grace)
    log.info("stopped")
    return 0


async def settle_heap(gateway: Any, after_s: tuple[float, ...] = HEAP_SETTLED_S) -> int:
    """Freeze what the process holds once it is ready (``gc.freeze``), and again after each
    of ``after_s``; the objects frozen.  A full collection scans every object the collector
    tracks, with the event loop held: a served gateway holds about 100,000 (its modules'
    functions, types and tables), which took 25-55 ms a collection on a 2-core VM.  Frozen,
    they are never scanned again; what comes after still is, and a frozen object is still
    freed when nothing refers to it.  What a frozen cycle of objects holds is kept (the
    first policy generation's, if a reload drops it): bounded, once.  ``GATEWAY_GC_FREEZE=0``
    turns it off."""
    if os.environ.get("GATEWAY_GC_FREEZE", "1") == "0":
        return 0
    await gateway.warmed.wait()
    for delay in after_s:
        await asyncio.sleep(delay)
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("heap settled: %d objects frozen out of the collector's scans", frozen)
    return frozen


def _on_supervisor_pipe(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """The supervisor's end of stdin closed: it is gone, so drain and exit as on SIGTERM."""
    if not os.read(sys.stdin.fileno(), 4096):
        loop.remove_reader(sys.stdin.fileno())
        stop.set()


def _reload_on_signal(gateway: Any) -> None:
    try:
        gateway.reload(force=True)
    except PolicyError:
        pass  # logged and counted by the gateway
