"""One ``/metrics`` across the worker processes of ``gateway serve --workers N``: how each
family is merged, the merge itself, the totals of workers gone, and the supervisor's own
series.

The supervisor gathers each worker's exposition and merges it rather than using
prometheus_client's multiprocess mode, which cannot hold the per-app registries, the
collectors and the ``set_function`` gauges the gateway is made of.  Samples are merged per
name and label set:

- counters and histograms (every bucket, ``_sum``, ``_count``) are summed; a ``_created``
  time is the earliest;
- a gauge by its family's rule in ``GAUGES``: summed where it is an amount (requests in
  flight, queue depth, connections, memory), the highest or lowest where it is a state or a
  setting every worker holds for itself (the policy's generation, a breaker, a throttle, a
  threshold), or by the cache store (``STORE``): each worker's own with the memory store
  (summed), the one shared store's with Redis (the highest);
- a worker that exits leaves the counters and histograms it last showed (``Retired``), so
  the merged counters never go down when it is replaced: a restart is no counter reset.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.metrics.collectors import Labelled, register_process_collectors

Rule = Literal["sum", "max", "min", "open_first", "store"]
SUMMED_TYPES = ("counter", "histogram", "summary")

GAUGES: dict[str, Rule] = {
    # amounts: the workers' together
    "gateway_inflight_requests": "sum",
    "gateway_endpoint_inflight": "sum",
    "gateway_queue_depth": "sum",
    "gateway_tenant_in_flight": "sum",  # each process caps its own
    "gateway_client_in_flight": "sum",
    "gateway_mirror_in_flight": "sum",
    "gateway_connections": "sum",
    "gateway_workers": "sum",
    "process_resident_memory_bytes": "sum",
    "process_virtual_memory_bytes": "sum",
    "process_open_fds": "sum",
    "gateway_cache_judge_aliases": "sum",  # each process holds its own
    # one store's figures: each worker's with memory, the shared one's with Redis
    "gateway_cache_entries": "store",
    "gateway_cache_bytes": "store",
    "gateway_cache_embedding_entries": "store",
    "gateway_forecast_requests_per_second": "store",
    "gateway_desired_endpoints": "store",
    # states and settings: the highest (any worker's 1, the newest policy, the hottest GPU)
    "gateway_policy_generation": "max",
    "gateway_policy_info": "max",
    "gateway_backend_model_identity": "max",  # each worker's version in force (mid-change, both)
    "gateway_build_info": "max",
    "python_info": "max",
    "process_max_fds": "max",
    "gateway_endpoint_state": "max",
    "gateway_endpoint_signal": "max",
    "gateway_throttle_active": "max",
    "gateway_throttle_threshold": "max",
    "gateway_hedge_delay_seconds": "max",
    "gateway_telemetry_age_seconds": "max",
    "gateway_gpu_temperature_celsius": "max",
    "gateway_gpu_memory_used_ratio": "max",
    "gateway_gpu_utilization_ratio": "max",
    "gateway_gpu_power_ratio": "max",
    "gateway_gpu_thermal_throttling": "max",
    "gateway_kv_cache_usage_ratio": "max",
    "gateway_gpu_slowdown_temperature_celsius": "max",
    # the lowest: the worker worst off
    "gateway_pool_active_endpoints": "min",
    "gateway_batch_limit": "min",
    "gateway_cache_store_up": "min",
    "gateway_rate_limit_store_up": "min",
    "gateway_redis_up": "min",
    "gateway_throttle_signal_seen": "min",
    "process_start_time_seconds": "min",
    # 0 closed, 1 open, 2 half-open: open if any worker's is, else half-open if any is
    "gateway_breaker_state": "open_first",
}
"""How each gauge family is merged; one not listed (a newer worker's) is summed."""

SampleKey = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str) -> list[Metric]:
    """A worker's exposition as metric families."""
    return list(text_string_to_metric_families(text))


def rule_of(family: Metric, *, shared_store: bool) -> Rule:
    """How the samples of ``family`` are merged (``shared_store``: the cache store is Redis)."""
    if family.type in SUMMED_TYPES:
        return "sum"
    if family.name.endswith("_created"):  # the text format's own gauge of a counter's start
        return "min"
    rule = GAUGES.get(family.name, "sum")
    if rule == "store":
        return "max" if shared_store else "sum"
    return rule


def combine(rule: Rule, values: list[float]) -> float:
    if rule == "sum":
        return sum(values)
    if rule == "max":
        return max(values)
    if rule == "min":
        return min(values)
    if rule == "open_first":
        return 1.0 if 1.0 in values else max(values)
    raise ValueError(f"no merge rule {rule!r}")


def merge(sources: Iterable[Iterable[Metric]], *, shared_store: bool = False) -> list[Metric]:
    """The families of every source merged into one view, in order of first appearance."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[SampleKey, tuple[Sample, list[float]]]] = {}
    for source in sources:
        for family in source:
            if family.name not in families:
                families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            held = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if key in held:
                    held[key][1].append(sample.value)
                else:
                    held[key] = (sample, [sample.value])
    merged = []
    for name, family in families.items():
        rule = rule_of(family, shared_store=shared_store)
        for sample, seen in values[name].values():
            value = combine(_sample_rule(rule, sample.name), seen)
            family.samples.append(Sample(sample.name, sample.labels, value, None, None))
        merged.append(family)
    return merged


def _sample_rule(rule: Rule, sample_name: str) -> Rule:
    return "min" if sample_name.endswith("_created") else rule


def render(families: list[Metric]) -> bytes:
    """The text format of ``families``."""
    return generate_latest(_Families(families))


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


class Retired:
    """The counters and histograms of workers that exited, as each last showed them: merged
    with the live workers', they keep the merged totals from going down at a restart."""

    def __init__(self) -> None:
        self._families: list[Metric] = []
        self.workers = 0

    def add(self, families: list[Metric]) -> None:
        """A worker exited; ``families`` is what it showed last."""
        kept = []
        for family in families:
            if family.type not in SUMMED_TYPES:
                continue
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s for s in family.samples if not s.name.endswith("_created")]
            kept.append(out)
        self._families = merge([self._families, kept])
        self.workers += 1

    def families(self) -> list[Metric]:
        return self._families

    def __repr__(self) -> str:
        return f"<Retired workers={self.workers} families={len(self._families)}>"


class SupervisorMetrics:
    """The supervisor's own series: its workers, their restarts, and its own process (whose
    memory and CPU the merged ``process_*`` figures include)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.workers = Gauge(
            "gateway_workers",
            "Worker processes running and listening on the data port (`gateway serve "
            "--workers N`).",
            registry=self.registry,
        )
        self.worker_restarts = Counter(
            "gateway_worker_restarts",
            "Worker processes started again after one exited (with exponential back-off).",
            registry=self.registry,
        )
        register_process_collectors(self.registry)

    def families(self, const_labels: tuple[tuple[str, str], ...] = ()) -> list[Metric]:
        """Its series with the policy's constant labels, as the workers' carry them, and in
        the shape a parsed exposition has (a counter's ``_created`` a family of its own)."""
        view = Labelled(self.registry, dict(const_labels)) if const_labels else self.registry
        return parse(generate_latest(view).decode())


def supervisor_names() -> list[str]:
    """The families only the supervisor has (its ``process_*`` are every gateway's)."""
    found = {m.name for m in SupervisorMetrics().registry.collect()}
    return sorted(name for name in found if name.startswith("gateway_"))
