"""The gateway's Prometheus metrics: one registry per app, names that are public surface.

Dashboards and alerts depend on these names;
``tests/test_admin.py::test_metric_names_are_the_public_contract`` snapshots them.
Constant labels from the policy (``metrics.const_labels``) are added at exposition time, so
a reload can change them without re-registering anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from gateway import __version__
from gateway.collectors import (
    ConnectionCollector,
    EmbeddingCollector,
    EmbeddingFigures,
    Labelled,
    RateLimitCollector,
    RedisCollector,
    register_process_collectors,
)

__all__ = ["LAG_BUCKETS", "LATENCY_BUCKETS", "EmbeddingFigures", "Metrics", "names"]

# Seconds; dense below 10 ms where the gateway's own overhead lives, up to long generations.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
LATENCY_BUCKETS += (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
"""Seconds an event-loop wake-up comes late: 0.1 ms (idle) to 1 s (a blocked loop)."""


class Metrics:
    """Every gateway series, registered on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.const_labels: tuple[tuple[str, str], ...] = ()
        r = self.registry
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by route, backend and HTTP status.",
            ["route", "backend", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from request received to response complete.",
            ["route", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "gateway_upstream_duration_seconds",
            "Time from sending upstream to the upstream's response headers.",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stream_first_byte = Histogram(
            "gateway_stream_first_byte_seconds",
            "Time from request received to the first "
            "byte of a streamed response written to the client.",
            ["route", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inflight = Gauge(
            "gateway_inflight_requests", "Upstream requests in flight.", ["backend"], registry=r
        )
        self.endpoint_inflight = Gauge(
            "gateway_endpoint_inflight",
            "Upstream requests in flight per endpoint (instance) of a backend.",
            ["backend", "endpoint"],
            registry=r,
        )
        self.endpoint_requests = Counter(
            "gateway_endpoint_requests",
            "Upstream requests per endpoint, by outcome (the status class, or error).",
            ["backend", "endpoint", "status"],
            registry=r,
        )
        self.endpoint_state = Gauge(
            "gateway_endpoint_state",
            "1 for an endpoint's current state (active, standby, warming, ejected, "
            "throttled), 0 for the others.",
            ["backend", "endpoint", "state"],
            registry=r,
        )
        self.endpoint_signal = Gauge(
            "gateway_endpoint_signal",
            "An endpoint's own telemetry (kv_aware or a {host}/{port} telemetry.url).",
            ["backend", "endpoint", "signal"],
            registry=r,
        )
        self.pool_active_endpoints = Gauge(
            "gateway_pool_active_endpoints",
            "Endpoints of a backend taking traffic (not ejected).",
            ["backend"],
            registry=r,
        )
        self.forecast_rps = Gauge(
            "gateway_forecast_requests_per_second",
            "A route's forecast mean request rate over its prewarm horizon.",
            ["route"],
            registry=r,
        )
        self.desired_endpoints = Gauge(
            "gateway_desired_endpoints",
            "Endpoints a backend will need over the horizon: the forecast times the "
            "headroom over one endpoint's best rate (for autoscalers).",
            ["backend"],
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens reported by upstream `usage`, by kind (prompt, completion).",
            ["backend", "kind"],
            registry=r,
        )
        self.policy_generation = Gauge(
            "gateway_policy_generation",
            "Generation of the loaded policy (1 for the first, +1 per reload).",
            registry=r,
        )
        self.policy_info = Gauge(
            "gateway_policy_info",
            "Always 1; `hash` labels the loaded policy's content hash.",
            ["hash"],
            registry=r,
        )
        self.reload_failures = Counter(
            "gateway_policy_reload_failures",
            "Policy reloads rejected as invalid (the last good policy stays).",
            registry=r,
        )
        self.upstream_retries = Counter(
            "gateway_upstream_stale_retries",
            "Requests retried once on a fresh connection after a stale pooled one closed.",
            ["backend"],
            registry=r,
        )
        # -- caching (issue 4) --
        self.cache_lookups = Counter(
            "gateway_cache_lookups",
            "Cache lookups by route, result (hit, miss, bypass) and "
            "match (exact, simhash, embedding, judged, none).",
            ["route", "result", "match"],
            registry=r,
        )
        self.cache_lookup_seconds = Histogram(
            "gateway_cache_lookup_seconds",
            "Time to look a request up in the cache.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_entries = Gauge(
            "gateway_cache_entries",
            "Entries in the cache store (with Redis: every replica's, refreshed every 10 s).",
            registry=r,
        )
        self.cache_bytes = Gauge("gateway_cache_bytes", "Bytes in the cache store.", registry=r)
        self.cache_not_stored = Counter(
            "gateway_cache_not_stored",
            "Answers not stored because the backend's Cache-Control or Vary said so, by reason.",
            ["route", "reason"],
            registry=r,
        )
        self.cache_store_errors = Counter(
            "gateway_cache_store_errors",
            "Cache store operations that failed (answered as misses).",
            registry=r,
        )
        self.cache_store_up = Gauge(
            "gateway_cache_store_up",
            "1 while the cache store is up (always, for memory); 0 while Redis is taken for "
            "down (requests are answered as misses), by evidence: several failures in a row "
            "or most commands of the last second failing to reach it.",
            registry=r,
        )
        self.cache_store_transitions = Counter(
            "gateway_cache_store_transitions",
            "The cache store going down or up again, by `to`.",
            ["to"],
            registry=r,
        )
        self.embedding = EmbeddingCollector()
        r.register(self.embedding)
        # -- single flight and batching (issue 5) --
        self.coalesced = Counter(
            "gateway_coalesced_requests",
            "Requests that joined an identical call already in flight.",
            ["route"],
            registry=r,
        )
        self.batch_size = Histogram(
            "gateway_batch_size",
            "Items per batched upstream call.",
            ["route"],
            buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256),
            registry=r,
        )
        self.batch_wait = Histogram(
            "gateway_batch_wait_seconds",
            "Time a request waited for its batch to go.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_limit = Gauge(
            "gateway_batch_limit",
            "Current batch size limit (moves with adaptive sizing and OOM back-off).",
            ["route"],
            registry=r,
        )
        self.batch_splits = Counter(
            "gateway_batch_splits",
            "Batches split in halves to isolate a bad input, by what the merged call got: "
            "4xx, 5xx (not 503, not out of memory), or an answer that could not be split.",
            ["route", "reason"],
            registry=r,
        )
        self.batch_oom_backoffs = Counter(
            "gateway_batch_oom_backoffs",
            "Batch size halvings after the backend ran out of memory.",
            ["route"],
            registry=r,
        )
        # -- GPU telemetry, throttling, admission, breakers, fallback (issue 6) --
        self.gpu_temperature = Gauge(
            "gateway_gpu_temperature_celsius", "GPU temperature.", ["backend"], registry=r
        )
        self.gpu_slowdown_temperature = Gauge(
            "gateway_gpu_slowdown_temperature_celsius",
            "The GPU's own slowdown temperature (NVML): its clocks drop past it.",
            ["backend"],
            registry=r,
        )
        self.gpu_memory_used = Gauge(
            "gateway_gpu_memory_used_ratio", "VRAM used / total.", ["backend"], registry=r
        )
        self.gpu_utilization = Gauge(
            "gateway_gpu_utilization_ratio", "GPU utilisation 0..1.", ["backend"], registry=r
        )
        self.gpu_power = Gauge(
            "gateway_gpu_power_ratio", "Power draw / enforced limit.", ["backend"], registry=r
        )
        self.gpu_thermal_throttling = Gauge(
            "gateway_gpu_thermal_throttling",
            "1 while the GPU slows its clocks for heat (a thermal clock-event reason), else 0.",
            ["backend"],
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "gateway_kv_cache_usage_ratio",
            "Model server KV-cache use 0..1.",
            ["backend"],
            registry=r,
        )
        self.telemetry_age = Gauge(
            "gateway_telemetry_age_seconds",
            "Age of the newest telemetry sample.",
            ["backend"],
            registry=r,
        )
        self.throttle_active = Gauge(
            "gateway_throttle_active",
            "1 while a throttle rule holds.",
            ["rule", "backend"],
            registry=r,
        )
        self.throttle_signal_seen = Gauge(
            "gateway_throttle_signal_seen",
            "1 once a throttle rule's signal has been read from its backend's telemetry; 0 "
            "when, after a few samples, it never has (the rule cannot fire: e.g. the stock "
            "dcgm-exporter counters lack the power limit and clock-event reasons).",
            ["rule", "backend"],
            registry=r,
        )
        self.throttle_threshold = Gauge(
            "gateway_throttle_threshold",
            "A throttle rule's thresholds as the policy sets them, in its signal's unit: "
            "`bound` above (it fires over this) or clear_below (it clears under this).",
            ["rule", "backend", "signal", "bound"],
            registry=r,
        )
        self.throttle_transitions = Counter(
            "gateway_throttle_transitions",
            "Throttle rules firing or clearing.",
            ["rule", "backend"],
            registry=r,
        )
        self.breaker_state = Gauge(
            "gateway_breaker_state",
            "Circuit breaker: 0 closed, 1 open, 2 half-open.",
            ["backend"],
            registry=r,
        )
        self.breaker_transitions = Counter(
            "gateway_breaker_transitions", "Breaker state changes.", ["backend", "to"], registry=r
        )
        self.fallbacks = Counter(
            "gateway_fallbacks",
            "Requests served by a fallback backend, by why.",
            ["route", "reason"],
            registry=r,
        )
        self.shed = Counter(
            "gateway_shed",
            "Requests refused to protect a backend, by why.",
            ["backend", "reason"],
            registry=r,
        )
        self.queue_depth = Gauge(
            "gateway_queue_depth", "Requests waiting for admission.", ["backend"], registry=r
        )
        self.queue_wait = Histogram(
            "gateway_queue_wait_seconds",
            "Time waited for admission.",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rate_limited = Counter(
            "gateway_rate_limited",
            "Requests refused by a route's per-tenant rate limit.",
            ["route"],
            registry=r,
        )
        self.rate_limits = RateLimitCollector(registry=r)
        self.redis = RedisCollector(registry=r)
        # -- the client side of the data plane (issue 11) --
        self.client_timeouts = Counter(
            "gateway_client_timeouts",
            "Client connections closed at a timeout, by phase: head (the request head took "
            "too long), body (silence inside a body), idle (keep-alive), send (the client "
            "stopped reading its answer).",
            ["phase"],
            registry=r,
        )
        self.refused_connections = Counter(
            "gateway_refused_connections",
            "Client connections closed at once on arrival, by reason (max_connections).",
            ["reason"],
            registry=r,
        )
        self.connections = ConnectionCollector()
        r.register(self.connections)
        # -- the process itself (issue 16) --
        self.build_info = Gauge(
            "gateway_build_info",
            "Always 1; `version` labels the gateway's version.",
            ["version"],
            registry=r,
        )
        self.build_info.labels(__version__).set(1)
        self.event_loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 0.25 s: time other work held the "
            "loop, which every request on it waited too.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        register_process_collectors(r)
        self._route_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._request_children: dict[tuple[str, str, int], Any] = {}
        self._token_children: dict[str, tuple[Any, Any]] = {}

    def count_request(self, route: str, backend: str, status: int) -> None:
        key = (route, backend, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, backend, str(status))
        child.inc()

    def count_tokens(self, backend: str, prompt: int, completion: int) -> None:
        children = self._token_children.get(backend)
        if children is None:
            children = self._token_children[backend] = (
                self.tokens.labels(backend, "prompt"),
                self.tokens.labels(backend, "completion"),
            )
        children[0].inc(prompt)
        children[1].inc(completion)

    def route_series(self, route: str, backend: str) -> tuple[Any, Any]:
        """(request_duration, stream_first_byte) children, cached: labels() is slow."""
        key = (route, backend)
        found = self._route_children.get(key)
        if found is None:
            found = (
                self.request_duration.labels(route, backend),
                self.stream_first_byte.labels(route, backend),
            )
            self._route_children[key] = found
        return found

    def set_policy(
        self, generation: int, digest: str, const_labels: tuple[tuple[str, str], ...]
    ) -> None:
        """Publish the loaded policy's generation, hash and constant labels."""
        self.policy_generation.set(generation)
        self.policy_info.clear()
        self.policy_info.labels(digest).set(1)
        self.const_labels = const_labels

    def exposition(self) -> bytes:
        """The text format of every series, constant labels added."""
        labelled = self.const_labels and Labelled(self.registry, dict(self.const_labels))
        return generate_latest(labelled or self.registry)


def names(metrics: Metrics) -> Iterable[str]:
    """The metric family names registered (for the snapshot test)."""
    return sorted({m.name for m in metrics.registry.collect()})
