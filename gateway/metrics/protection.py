"""The protection's series: GPU telemetry, throttle rules, breakers, fallback, admission,
rate limits and the shared Redis."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metrics.buckets import LATENCY_BUCKETS
from gateway.metrics.collectors import RateLimitCollector, RedisCollector


class ProtectionFamilies:
    """The series of telemetry, throttling, breakers, admission and limits."""

    def _register_protection(self, r: CollectorRegistry) -> None:
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
        self.backend_failures = Counter(
            "gateway_backend_failures",
            "Calls counted against a guarded backend's health, by reason: status_5xx, timeout, "
            "unavailable, not_json, error_event, unfinished, malformed_event, "
            "unexpected_stream, broken_stream; and batch_input, a merged call's 5xx that "
            "bisection pinned on a caller's input (not counted against the backend).",
            ["backend", "reason"],
            registry=r,
        )
        self.fallbacks = Counter(
            "gateway_fallbacks",
            "Requests served by a fallback backend, by why.",
            ["route", "reason"],
            registry=r,
        )
        self.shed = Counter(
            "gateway_shed",
            "Requests refused to protect a backend, by why: queue_full, queue_share (a full "
            "queue shed one tenant's newest waiter for another tenant), queue_timeout, "
            "throttle, circuit_open, shutdown.",
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
        self.tenant_queue_wait = Histogram(
            "gateway_tenant_queue_wait_seconds",
            "Time a named tenant's calls waited for admission to a backend (0 for a call "
            "admitted at once): the fair queue's turns, seen per tenant.",
            ["tenant"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tenant_in_flight = Gauge(
            "gateway_tenant_in_flight",
            "A named tenant's requests in flight to backends, for each tenant with a "
            "`max_concurrency` (in this process).",
            ["tenant"],
            registry=r,
        )
        self.tenant_concurrency_limited = Counter(
            "gateway_tenant_concurrency_limited",
            "Requests refused because their named tenant already had its `max_concurrency` "
            "in flight.",
            ["tenant"],
            registry=r,
        )
        self.client_in_flight = Gauge(
            "gateway_client_in_flight",
            "Requests in flight to backends from clients offering no listed key, when "
            "`tenants.max_concurrency` caps them (in this process; all addresses together).",
            registry=r,
        )
        self.client_concurrency_limited = Counter(
            "gateway_client_concurrency_limited",
            "Requests refused because their client (offering no listed key) already had "
            "`tenants.max_concurrency` in flight.",
            registry=r,
        )
        self.concurrency_decisions = Counter(
            "gateway_concurrency_decisions",
            "Decisions on a call's place under a `max_concurrency` cap with "
            "`tenants.concurrency_store: redis`, by where they were made: `redis` (across "
            "every process) or `local` (this process's share, while Redis could not decide).",
            ["store"],
            registry=r,
        )
        self.rate_limited = Counter(
            "gateway_rate_limited",
            "Requests refused by a route's per-tenant rate limit.",
            ["route"],
            registry=r,
        )
        self.spend_refused = Counter(
            "gateway_spend_refused",
            "Of gateway_rate_limited, the requests refused because their tenant's spend "
            "budget (rate_limit.cost_per_day, cost_per_month) was spent: 429 "
            "insufficient_quota.",
            ["route"],
            registry=r,
        )
        self.rate_limits = RateLimitCollector(registry=r)
        self.redis = RedisCollector(registry=r)
