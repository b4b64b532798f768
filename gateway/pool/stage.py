"""The pool stage: counts each request of a route with ``prewarm``, and exports the
route's rate forecast and the endpoints its backend will need (for autoscalers: a KEDA
``ScaledObject`` or an HPA on ``gateway_desired_endpoints`` scales the model Deployment
before the peak; ``deploy/k8s/`` has both).

The desired count also reaches the backend's ``pool`` sizing (``Runtime.demand``): standby
endpoints are warmed and brought in while fewer are in rotation than the forecast calls
for.

``gateway_forecast_requests_per_second{route}`` is the forecast mean rate over the
horizon; ``gateway_desired_endpoints{backend}`` is ``ceil(forecast x headroom /
per-endpoint rate)``, the per-endpoint rate being ``prewarm.endpoint_rps`` or the best
minute the route has served divided by its backend's listed endpoints (at least 1, and
never below what the backend lists while it has no history).  Both are computed at scrape
time, at most once a minute per route.

With the cache store ``redis``, the history is the fleet's (``shared.py``): every replica
adds its counts to one hash per route and forecasts from the sum.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Backend, Policy, Prewarm
from gateway.pool.forecast import RateHistory, RouteRate
from gateway.pool.shared import SharedHistory
from gateway.redis import RedisLink, shared_link
from gateway.runtime import Runtime
from gateway.state import Kind

HISTORIES: Kind[RouteRate] = Kind("rate-history")
SHARED_HISTORIES: Kind[SharedHistory] = Kind("shared-rate-history")


def desired_endpoints(rate: RouteRate, prewarm: Prewarm, backend: Backend) -> int:
    """Endpoints the forecast calls for (see the module docstring)."""
    listed = max(1, len(backend.endpoints))
    per_endpoint = prewarm.endpoint_rps or rate.best_rps() / listed
    if per_endpoint <= 0:
        return listed
    needed = rate.forecast(prewarm.horizon_s).requests_per_s * prewarm.headroom / per_endpoint
    return max(1, math.ceil(needed))


def _rate_of(rate: RouteRate, prewarm: Prewarm) -> Callable[[], float]:
    return lambda: rate.forecast(prewarm.horizon_s).requests_per_s


def _count_of(rate: RouteRate, prewarm: Prewarm, backend: Backend) -> Callable[[], int]:
    return lambda: desired_endpoints(rate, prewarm, backend)


def _shared(
    route: str, rate: RouteRate, link: RedisLink, runtime: Runtime
) -> Callable[[], SharedHistory]:
    return lambda: SharedHistory(route, rate, link, clock=runtime.clock)


class RecordStage:
    """Counts each call of a route that forecasts its rate."""

    def __init__(self, rates: dict[str, RouteRate]) -> None:
        self._rates = rates

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        rate = self._rates.get(call.route.name)
        if rate is not None:
            rate.history.record()
        return await call_next(call)

    def __repr__(self) -> str:
        return f"<RecordStage routes={sorted(self._rates)}>"


def build(policy: Policy, runtime: Runtime) -> list[Stage]:
    """A ``RecordStage`` when a route has ``prewarm`` (its history survives reloads), and
    the forecast gauges of those routes."""
    rates: dict[str, RouteRate] = {}
    metrics = runtime.metrics
    for route in policy.routes:
        prewarm = route.prewarm
        if prewarm is None:
            continue
        rate = runtime.registry.get(
            HISTORIES, route.name, (), lambda: RouteRate(RateHistory(runtime.clock))
        )
        rates[route.name] = rate
        if policy.cache.store == "redis":  # the fleet's history: every replica's traffic
            link = shared_link(runtime.registry, policy.redis, runtime.clock, metrics)
            runtime.registry.get(
                SHARED_HISTORIES, route.name, policy.redis, _shared(route.name, rate, link, runtime)
            )
        backend = policy.backend(route.backend)
        metrics.forecast_rps.labels(route.name).set_function(_rate_of(rate, prewarm))
        desired = _count_of(rate, prewarm, backend)
        metrics.desired_endpoints.labels(backend.name).set_function(desired)
        # a backend with a `pool` warms standby endpoints up to this, ahead of the peak
        runtime.demand[backend.name] = desired
    return [RecordStage(rates)] if rates else []
