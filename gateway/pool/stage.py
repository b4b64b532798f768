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
"""

from __future__ import annotations

import math
from collections.abc import Callable

from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Backend, Policy, Prewarm
from gateway.pool.forecast import MINUTE_S, Forecast, RateHistory, forecast
from gateway.runtime import Runtime
from gateway.state import Kind

HISTORIES: Kind[RouteRate] = Kind("rate-history")


class RouteRate:
    """A route's request history, and its forecast and best minute, each computed at most
    once a minute (the pool sizing asks on every pick; the history is a week long)."""

    def __init__(self, history: RateHistory) -> None:
        self.history = history
        self._forecast: tuple[int, float, Forecast] | None = None
        self._best: tuple[int, float] | None = None

    def forecast(self, horizon_s: float) -> Forecast:
        minute = self.history.minute()
        if self._forecast is None or self._forecast[:2] != (minute, horizon_s):
            counts, first = self.history.complete()
            self._forecast = (minute, horizon_s, forecast(counts, first, horizon_s))
        return self._forecast[2]

    def best_rps(self) -> float:
        minute = self.history.minute()
        if self._best is None or self._best[0] != minute:
            counts, _ = self.history.complete()
            self._best = (minute, max(counts, default=0) / MINUTE_S)
        return self._best[1]


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
        backend = policy.backend(route.backend)
        metrics.forecast_rps.labels(route.name).set_function(_rate_of(rate, prewarm))
        desired = _count_of(rate, prewarm, backend)
        metrics.desired_endpoints.labels(backend.name).set_function(desired)
        # a backend with a `pool` warms standby endpoints up to this, ahead of the peak
        runtime.demand[backend.name] = desired
    return [RecordStage(rates)] if rates else []
