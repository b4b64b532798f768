"""``gateway serve`` as a process: one gateway until SIGTERM, reloading on SIGHUP.  ``cli``
parses the command line into ``ServeOptions``."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from typing import Any

from gateway.errors import PolicyError
from gateway.policy.watch import PolicySource

log = logging.getLogger("gateway")


@dataclass(frozen=True, slots=True)
class ServeOptions:
    """``gateway serve``'s flags."""

    host: str = "127.0.0.1"
    port: int = 8080
    admin_host: str | None = None
    admin_port: int = 9090
    access_log: bool = False


async def serve(options: ServeOptions, source: PolicySource) -> int:
    """Serve until SIGTERM (or SIGINT); the exit status."""
    from gateway.app import Gateway

    gateway = Gateway(source, access_log=options.access_log)
    try:
        data_url, admin_url = await gateway.start(
            options.host, options.port, options.admin_host, options.admin_port
        )
    except PolicyError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        await gateway.shutdown(0)
        return 1
    print(f"gateway listening on {data_url} (admin {admin_url})", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, _reload_on_signal, gateway)
    await stop.wait()
    grace = gateway.snapshot.policy.server.shutdown_grace_s
    log.info("SIGTERM: draining for up to %.0f s", grace)
    await gateway.shutdown(grace)
    log.info("stopped")
    return 0


def _reload_on_signal(gateway: Any) -> None:
    try:
        gateway.reload(force=True)
    except PolicyError:
        pass  # logged and counted by the gateway
