"""The supervisor's admin port (``gateway serve --workers N``): the endpoints of a single
gateway's, answered for all its workers, and ``GET /workers``.

- ``/healthz``: the supervisor serves.
- ``/readyz``: 200 only while every worker runs and is ready itself, 503 from SIGTERM on.
- ``/metrics``: one view across the workers (``metrics.merged``), with the supervisor's
  ``gateway_workers`` and ``gateway_worker_restarts_total``.
- ``/workers``: each worker's index, pid, state, restarts, readiness, policy generation and
  hash.
- ``/tenants``: each running worker's (with ``store: memory`` each counts for itself; with
  ``redis`` they all tell Redis's count).
- ``/policy``: the first running worker's; ``POST /reload`` and ``POST /cache/purge``: sent
  to every running worker, the answers combined (a purge's counts added: with the memory
  store each worker holds a cache of its own).

The access rules are a single gateway's (``admin_access``), applied here; the caller's
``Authorization`` goes on to the workers, which apply them too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.admin.access import guarded, shown

FORWARDED_HEADERS = ("Authorization", "Content-Type")


@dataclass(frozen=True, slots=True)
class Answer:
    """One worker's answer to a forwarded admin request."""

    index: int
    pid: int
    status: int
    body: bytes

    def data(self) -> Any:
        try:
            return json.loads(self.body)
        except ValueError:
            return {"error": self.body.decode(errors="replace")}


class Supervised(Protocol):
    """What the supervisor's admin port reads and drives."""

    def admin_token(self) -> str | None: ...

    async def readiness(self) -> str | None:
        """None when ready, else why not."""

    async def exposition(self) -> bytes: ...

    async def describe(self) -> list[dict[str, Any]]: ...

    async def forward(
        self, method: str, path: str, body: bytes, headers: dict[str, str], *, first: bool = False
    ) -> list[Answer]: ...

    async def reload(self, headers: dict[str, str]) -> list[Answer]: ...


def supervisor_routes(supervisor: Supervised, *, loopback: bool) -> list[web.RouteDef]:
    """The supervisor's admin routes, bound to ``supervisor``."""
    token = supervisor.admin_token

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        reason = await supervisor.readiness()
        if reason is None:
            return web.json_response({"ready": True})
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=await supervisor.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def workers(_: web.Request) -> web.Response:
        return _json({"workers": await supervisor.describe()})

    async def policy(request: web.Request) -> web.Response:
        answers = await supervisor.forward("GET", "/policy", b"", _headers(request), first=True)
        if not answers:
            return _json({"error": "no worker is running"}, 503)
        return web.Response(
            status=answers[0].status,
            body=answers[0].body,
            headers={"Content-Type": "application/json"},
        )

    async def tenants(request: web.Request) -> web.Response:
        answers = await supervisor.forward("GET", "/tenants", b"", _headers(request))
        if not answers:
            return _json({"error": "no worker is running"}, 503)
        failed = next((a for a in answers if a.status != 200), None)
        if failed is not None:
            return _json({"worker": failed.index, **failed.data()}, failed.status)
        return _json({"workers": [{"worker": a.index, "pid": a.pid, **a.data()} for a in answers]})

    async def reload(request: web.Request) -> web.Response:
        answers = await supervisor.reload(_headers(request))
        each = [{"worker": a.index, "pid": a.pid, **a.data()} for a in answers]
        failed = next((a for a in answers if a.status != 200), None)
        combined = {
            "reloaded": any(e.get("reloaded") for e in each),
            "generation": max((e.get("generation", 0) for e in each), default=0),
            "workers": each,
        }
        return _json(combined, 200 if failed is None else failed.status)

    async def cache_purge(request: web.Request) -> web.Response:
        path = request.path_qs
        answers = await supervisor.forward("POST", path, await request.read(), _headers(request))
        failed = next((a for a in answers if a.status != 200), None)
        if failed is not None:
            return _json({"worker": failed.index, **failed.data()}, failed.status)
        each = [a.data() for a in answers]
        purged = sum(int(e.get("purged", 0)) for e in each)
        return _json({**(each[0] if each else {}), "purged": purged, "workers": len(each)})

    return [
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/workers", shown(workers, token, loopback)),
        web.get("/policy", shown(policy, token, loopback)),
        web.get("/tenants", shown(tenants, token, loopback)),
        web.post("/reload", guarded(reload, token, loopback)),
        web.post("/cache/purge", guarded(cache_purge, token, loopback)),
    ]


def _headers(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, dumps=lambda d: json.dumps(d, indent=2))
