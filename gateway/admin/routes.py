"""The admin listener's endpoints: health, readiness, metrics, the effective policy, the
named tenants' standing in their limits and budgets, reload and cache purge; who may call
which is ``admin_access``'s."""

from __future__ import annotations

import json

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.admin.access import guarded, shown
from gateway.errors import PolicyError, StoreError
from gateway.policy.show import to_data
from gateway.snapshot import (
    CACHE,
    CACHE_OPERATING_POINTS,
    TENANT_STANDINGS,
    THROTTLE,
    CachePurge,
    Operated,
)


def admin_routes(gateway: Operated, *, loopback: bool) -> list[web.RouteDef]:
    """The admin app's routes, bound to ``gateway``."""
    token = gateway.admin_token

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
        control = gateway.registry.peek(THROTTLE)
        points = gateway.registry.peek(CACHE_OPERATING_POINTS)
        data = {
            "generation": snap.generation,
            "hash": snap.digest,
            "policy": to_data(snap.policy),
            "throttle_signals": control.signal_status() if control is not None else [],
            "cache_operating_points": points.in_force(snap.policy) if points is not None else {},
            "model_versions": {  # model_version: auto, as the servers said (what purge takes)
                b.name: gateway.model_identity(b.name)
                for b in snap.policy.backends
                if b.model_version == "auto"
            },
        }
        return web.json_response(data, dumps=lambda d: json.dumps(d, indent=2))

    async def tenants(_: web.Request) -> web.Response:
        standings = gateway.registry.peek(TENANT_STANDINGS)
        policy = gateway.snapshot.policy
        if standings is not None:
            told = await standings.told(policy)
        else:  # no rate limit in the policy: nothing to stand in
            names = dict.fromkeys(key.name for key in policy.tenants.keys)
            told = [{"name": name, "own": None, "routes": {}} for name in names]
        data = {"tenants": told}
        return web.json_response(data, dumps=lambda d: json.dumps(d, indent=2))

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
        state = gateway.registry.peek(CACHE)
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
        web.get("/policy", shown(policy, token, loopback)),
        web.get("/tenants", shown(tenants, token, loopback)),
        web.post("/reload", guarded(reload, token, loopback)),
        web.post("/cache/purge", guarded(cache_purge, token, loopback)),
    ]


PURGE_FILTERS = ("backend", "model_version", "tenant", "scope")


async def _purge_filters(request: web.Request, state: CachePurge) -> dict[str, str]:
    """The purge filters from a JSON body or the query string: ``backend``,
    ``model_version``, and the tenant as ``tenant`` (its raw scope header value, or an
    object of header: value) or ``scope`` (the scope hash); none means everything."""
    given: dict[str, object] = dict(request.query)
    if request.can_read_body:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nested past its depth
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
