"""Warm-up: requests sent to each backend before the gateway reports ready, so the first
user request never pays a cold start (the case study's first request timed out).  A
backend of several ``endpoints`` is warmed on each of them: a replica left cold would make
whichever request is picked for it pay.  Endpoints ``discovery`` finds are each warmed as
they join, before they take calls (``joining.py``)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Sequence

from gateway.errors import UpstreamError
from gateway.policy.model import Backend
from gateway.transport.upstream import Transport

log = logging.getLogger("gateway.transport.warmup")
RETRY_DELAY_S = 1.0


async def warm_up(transport: Transport, backends: Sequence[Backend]) -> None:
    """Send every backend's warm-up requests, retrying while a backend is still starting."""
    await asyncio.gather(*(_warm_backend(transport, i) for b in backends for i in instances(b)))


def instances(backend: Backend) -> list[Backend]:
    """The backend once per endpoint to warm (each a one-``url`` backend), or as it is: with
    a ``pool``, its ``core`` endpoints (standby ones are warmed when brought in)."""
    if len(backend.endpoints) < 2:
        return [backend]
    urls = backend.endpoints[: backend.pool.core] if backend.pool else backend.endpoints
    return [dataclasses.replace(backend, url=u, endpoints=(), pool=None) for u in urls]


async def _warm_backend(transport: Transport, backend: Backend) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + backend.warmup_timeout_s
    for request in backend.warmup:
        body = json.dumps(request.body).encode() if request.body is not None else b""
        headers = [("Content-Type", "application/json")] if body else []
        headers.extend(backend.headers)
        while True:
            try:
                reply = await transport.send(
                    backend, request.method, request.path, headers, body, streaming=False
                )
                if reply.close is not None:
                    await reply.close()
                if reply.status < 500:
                    log.info("warmed %s %s: %d", backend.name, request.path, reply.status)
                    break
                reason = f"status {reply.status}"
            except UpstreamError as exc:
                reason = str(exc)
            if loop.time() >= deadline:
                log.error(
                    "warm-up of %s %s gave up after %.0f s: %s",
                    backend.name,
                    request.path,
                    backend.warmup_timeout_s,
                    reason,
                )
                break
            log.info(
                "warm-up of %s %s: %s; retrying in %g s",
                backend.name,
                request.path,
                reason,
                RETRY_DELAY_S,
            )
            await asyncio.sleep(RETRY_DELAY_S)
