"""The admin listener's endpoints: health, readiness, metrics, the effective policy, reload
and cache purge.

With a token configured (``admin.token`` or ``GATEWAY_ADMIN_TOKEN``), every endpoint but
``/healthz``, ``/readyz`` and ``/metrics`` needs ``Authorization: Bearer <token>``; a missing,
wrong or malformed one is a 401.  With none, the mutating endpoints answer only on a
loopback-bound admin port.  A token still equal to the shipped example Secret's
placeholder is refused at start."""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.cache.embedding.learned import in_force
from gateway.cache.state import CACHE_STATE, CacheState
from gateway.errors import GatewayError, PolicyError, Problem, StoreError, Unauthorized
from gateway.policy.show import to_data
from gateway.resilience.gpu import GPU_CONTROL
from gateway.snapshot import Operated
from gateway.wire import error_body, error_headers

AdminHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
PLACEHOLDER_TOKEN = "REPLACE-with-a-long-random-token"
"""``admin-token`` in ``deploy/k8s/secret.yaml``: a token nobody replaced is no secret."""


def check_admin_token(token: str | None) -> None:
    """Refuse to start with the example Secret's placeholder as the admin token."""
    if token is not None and token.strip() == PLACEHOLDER_TOKEN:
        raise PolicyError(
            [
                Problem(
                    "GATEWAY_ADMIN_TOKEN",
                    "admin.token",
                    None,
                    "the admin token is still the placeholder of deploy/k8s/secret.yaml; "
                    "set a long random one (openssl rand -hex 32)",
                )
            ]
        )


def error_response(exc: GatewayError) -> web.Response:
    """A gateway error as an aiohttp response, in the data plane's OpenAI shape."""
    return web.Response(
        status=exc.status,
        body=error_body(exc),
        headers=dict([*error_headers(exc), *exc.extra_headers]),
    )


def admin_routes(gateway: Operated, *, loopback: bool) -> list[web.RouteDef]:
    """The admin app's routes, bound to ``gateway``."""

    def guarded(handler: AdminHandler) -> AdminHandler:
        async def run(request: web.Request) -> web.StreamResponse:
            try:
                _authorize(request, gateway.admin_token(), loopback)
            except GatewayError as exc:
                return error_response(exc)
            return await handler(request)

        return run

    def shown(handler: AdminHandler) -> AdminHandler:
        """Open without a token configured; with one, it is needed."""

        async def run(request: web.Request) -> web.StreamResponse:
            token = gateway.admin_token()
            if token is not None:
                try:
                    _authorize(request, token, loopback)
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
        control = gateway.registry.peek(GPU_CONTROL)
        shown = {
            "generation": snap.generation,
            "hash": snap.digest,
            "policy": to_data(snap.policy),
            "throttle_signals": control.signal_status() if control is not None else [],
            "cache_operating_points": {
                route.name: in_force(route.cache.semantic)
                for route in snap.policy.routes
                if route.cache is not None and route.cache.semantic.method == "embedding"
            },
        }
        return web.json_response(shown, dumps=lambda d: json.dumps(d, indent=2))

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

    async def cache_purge(request: web.Request) -> web.Response:
        state = gateway.registry.peek(CACHE_STATE)
        if state is None:
            return web.json_response(
                {"purged": 0, "error": "no route in the policy caches, so there is no cache"},
                status=409,
            )
        try:
            filters = await _purge_filters(request, state)
        except ValueError as exc:
            return web.json_response({"purged": 0, "error": str(exc)}, status=400)
        try:
            purged = await state.purge(**filters)
        except StoreError as exc:
            return web.json_response({"purged": 0, "error": str(exc)}, status=503)
        return web.json_response({"purged": purged, "store": state.kind, "filters": filters})

    return [
        web.get("/healthz", healthz),
        web.get("/readyz", readyz),
        web.get("/metrics", metrics),
        web.get("/policy", shown(policy)),
        web.post("/reload", guarded(reload)),
        web.post("/cache/purge", guarded(cache_purge)),
    ]


PURGE_FILTERS = ("backend", "model_version", "tenant", "scope")


async def _purge_filters(request: web.Request, state: CacheState) -> dict[str, str]:
    """The purge filters from a JSON body or the query string: ``backend``,
    ``model_version``, and the tenant as ``tenant`` (its raw scope header value, or an
    object of header: value) or ``scope`` (the scope hash); none means everything."""
    given: dict[str, object] = dict(request.query)
    if request.can_read_body:
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            raise ValueError(f"body is not JSON: {exc}") from exc
        if body is not None and not isinstance(body, dict):
            raise ValueError("body must be a JSON object of filters")
        given.update(body or {})
    unknown = sorted(set(given) - set(PURGE_FILTERS))
    if unknown:
        raise ValueError(f"unknown filters {unknown}; use {list(PURGE_FILTERS)}")
    if "tenant" in given and "scope" in given:
        raise ValueError("give `tenant` or `scope`, not both")
    filters: dict[str, str] = {}
    for name in ("backend", "model_version", "scope"):
        value = given.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"`{name}` must be a string")
            filters[name] = value
    tenant = given.get("tenant")
    if tenant is not None:
        if isinstance(tenant, dict) and all(isinstance(v, str) for v in tenant.values()):
            filters["scope"] = state.tenant_scope({str(k): v for k, v in tenant.items()})
        elif isinstance(tenant, str):
            filters["scope"] = state.tenant_scope(tenant)
        else:
            raise ValueError("`tenant` must be a string or an object of header: value")
    return filters


def _authorize(request: web.Request, token: str | None, loopback: bool) -> None:
    if token is None:
        if not loopback:
            raise Unauthorized(
                "no admin token is configured, so mutating admin endpoints "
                "answer only on a loopback-bound admin port"
            )
        return
    given = request.headers.get("Authorization", "")
    scheme, _, credential = given.strip().partition(" ")
    expected = token.encode("utf-8", "surrogateescape")
    offered = credential.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() != "bearer" or not hmac.compare_digest(offered, expected):
        raise Unauthorized("missing or wrong admin bearer token")
