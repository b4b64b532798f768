"""The admin listener's endpoints: health, readiness, metrics, the effective policy and
reload.  Mutating endpoints need ``Authorization: Bearer <token>``; with no token
configured they answer only on a loopback-bound admin port."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from .edge import error_response
from .errors import GatewayError, PolicyError, Unauthorized
from .policy.show import to_data

if TYPE_CHECKING:
    from .app import Gateway

AdminHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def admin_routes(gateway: Gateway, *, loopback: bool) -> list[web.RouteDef]:
    """The admin app's routes, bound to ``gateway``."""

    def guarded(handler: AdminHandler) -> AdminHandler:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                _authorize(request, gateway.admin_token(), loopback)
            except GatewayError as exc:
                return error_response(exc)
            return await handler(request)

        return run

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        if gateway.ready:
            return web.json_response({"ready": True})
        reason = "shutting down" if gateway.draining else "warming up"
        return web.json_response({"ready": False, "reason": reason}, status=503)

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=gateway.metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def policy(_: web.Request) -> web.Response:
        snap = gateway.snapshot
        return web.json_response(
            {"generation": snap.generation, "hash": snap.digest, "policy": to_data(snap.policy)},
            dumps=lambda d: json.dumps(d, indent=2),
        )

    async def reload(_: web.Request) -> web.Response:
        try:
            changed = gateway.reload(force=True)
        except PolicyError as exc:
            return web.json_response(
                {
                    "reloaded": False,
                    "generation": gateway.snapshot.generation,
                    "errors": [str(p) for p in exc.problems],
                },
                status=422,
            )
        return web.json_response(
            {
                "reloaded": changed,
                "generation": gateway.snapshot.generation,
                "hash": gateway.snapshot.digest,
            }
        )

    return [
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/policy", policy),
        web.post("/reload", guarded(reload)),
    ]


def _authorize(request: web.Request, token: str | None, loopback: bool) -> None:
    if token is None:
        if not loopback:
            raise Unauthorized(
                "no admin token is configured, so mutating admin endpoints "
                "answer only on a loopback-bound admin port"
            )
        return
    given = request.headers.get("Authorization", "")
    expected = f"Bearer {token}"
    if not hmac.compare_digest(given.encode(), expected.encode()):
        raise Unauthorized("missing or wrong admin bearer token")
