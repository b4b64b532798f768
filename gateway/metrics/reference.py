"""docs/metrics.md from the registry: every metric family's name, type, labels and meaning.

The names, types and help texts come from ``registry.collect()``; the label names of a
labelled metric that has no series yet come from the metric objects ``Metrics`` holds (a
collector's own families carry theirs).  ``NOTES`` adds what a help text should not carry
(links, policy keys, caveats), so nothing written for people is lost when the page is
generated: ``gateway metrics --markdown > docs/metrics.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import Metrics
from gateway.metrics.merged import SupervisorMetrics, supervisor_names

SUFFIXES = {"counter": "_total", "info": "_info"}
"""What the text format appends to a family's name, by type."""

HEADER = """\
# Metrics

Generated from the gateway's registry by `gateway metrics --markdown` (`gateway metrics`
prints the same as JSON); `tests/test_metrics_reference.py` fails when this page and the
code disagree.

Served on the admin port at `/metrics` (Prometheus text format), from a registry of the
gateway's own. These names are public surface: dashboards and alerts depend on them, and
`tests/test_admin.py::test_metric_names_are_the_public_contract` pins them. Constant
labels from the policy (`metrics.const_labels`, e.g. `gpu_type`, `model_version`) are added
to every series. Labels are low-cardinality: `route` is the route's name (set it, or it
defaults to its match), `backend` the backend's name.

A counter is exposed with `_total` (and its `_created` time); a histogram `x` as
`x_bucket{le}`, `x_sum` and `x_count`. A dashboard over these names:
[deploy/grafana/gateway.json](../deploy/grafana/gateway.json).

With `gateway serve --workers N` the supervisor's admin port serves one view across the
workers, the same names merged (counters and histograms summed, each gauge by its own rule:
[observability.md](observability.md#workers)), plus the supervisor's own, last below.
"""

SECTIONS = (
    ("The gateway", "gateway_", ""),
    (
        "The process",
        "",
        "prometheus_client's own collectors, as on its default registry: memory, CPU and file "
        "descriptors (`process_*`, Linux only), the interpreter (`python_info`) and its "
        "garbage collector (`python_gc_*`).",
    ),
)
"""Each table: its title, the name prefix of its families (the last takes the rest), an
introduction."""
SUPERVISOR = (
    "The supervisor",
    "Only with `gateway serve --workers N`, on the supervisor's admin port.",
)

NOTES = {
    "gateway_requests": "Status 499 when the client left before its answer was complete "
    "(also a stream it dropped after it started: the access log has the `bytes_sent`); "
    "`route` and `backend` are empty for a request refused before routing (unreadable, a "
    "limit, a path that cannot be served).",
    "gateway_endpoint_requests": "Outcomes `2xx`..`5xx` or `error`.",
    "gateway_pool_active_endpoints": "At most 64 endpoints per backend.",
    "gateway_forecast_requests_per_second": "Only `prewarm` routes; Holt-Winters with a "
    "weekday factor ([pool](pool.md)).",
    "gateway_desired_endpoints": "KEDA and HPA examples: `deploy/autoscaling/`.",
    "gateway_tokens": "Also from stream usage chunks.",
    "gateway_upstream_stale_retries": "Only requests that may be repeated "
    "([security](security.md#retries)).",
    "gateway_client_timeouts": "The policy's `header_timeout_s`, `body_timeout_s`, "
    "`keepalive_timeout_s`, `client_send_timeout_s`.",
    "gateway_refused_connections": "`max_connections`: none idle to make room.",
    "gateway_cache_entries": "Unexpired entries ([caching](caching.md#stores)).",
    "gateway_cache_bytes": "Serialised entries plus a per-entry overhead estimate (memory "
    "1200 B, Redis 2400 B).",
    "gateway_cache_store_up": "See [caching](caching.md#stores).",
    "gateway_cache_embedding_shared": "See [caching](caching.md#the-embedding-index-with-redis).",
    "gateway_cache_judge": "Only routes with `cache.semantic.judge.enabled`; a hit through "
    'an alias has `match="judged"` in `gateway_cache_lookups_total` '
    "([caching](caching.md#the-backend-as-judge)).",
    "gateway_batch_splits": "`5xx` because MLServer and KServe answer 500 to a malformed "
    "row; at most 2 ceil(log2 n) extra calls a batch.",
    "gateway_gpu_memory_used_ratio": "Meaningless for vLLM, which pre-allocates ~90%: watch "
    "the KV cache.",
    "gateway_throttle_signal_seen": "A few: 3 ([gpu](gpu.md#telemetry)).",
    "gateway_throttle_threshold": "Draw it next to the signal's gauge: "
    "`gateway_gpu_temperature_celsius` for `gpu_temperature_c`, and so on.",
    "gateway_rate_limit_store_up": "Down for 1 s after a refused or broken connection, an "
    "error Redis answered with, or 3 answers in a row later than 25 ms; then probed in the "
    "background ([gpu](gpu.md#rate-limits-across-replicas)).",
    "gateway_rate_limit_decisions": "A limit with nothing to count (tokens only, none "
    "estimated) makes no decision; refusals are also in `gateway_rate_limited_total`.",
    "gateway_event_loop_lag_seconds": "A stall here is a stall in every request's latency; "
    "1 ms steps under uvloop (`gateway serve`'s loop).",
    "gateway_gc_pause_seconds": "`gateway serve` freezes the objects it holds once it is "
    "ready and a minute later (`gc.freeze`), so a full collection scans only what came after; "
    "`GATEWAY_GC_FREEZE=0` turns that off ([architecture](architecture.md#garbage-collection)).",
}
"""What a family's help text should not carry, by family name."""


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family as the exposition shows it."""

    name: str
    exposed: str
    type: str
    labels: tuple[str, ...]
    help: str


def families(metrics: Metrics | SupervisorMetrics | None = None) -> list[Family]:
    """Every family of ``metrics`` (a fresh ``Metrics`` by default), in registration order."""
    metrics = metrics if metrics is not None else Metrics()
    declared = {
        m._name: tuple(m._labelnames)
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase)
    }
    found = []
    for family in metrics.registry.collect():
        labels = declared.get(family.name)
        if labels is None:
            labels = tuple(getattr(family, "_labelnames", None) or _sample_labels(family))
        exposed = family.name + SUFFIXES.get(family.type, "")
        found.append(Family(family.name, exposed, family.type, labels, family.documentation))
    return found


def _sample_labels(family: object) -> list[str]:
    seen: dict[str, None] = {}
    for sample in getattr(family, "samples", ()):
        seen.update(dict.fromkeys(k for k in sample.labels if k not in ("le", "quantile")))
    return list(seen)


def reference_markdown(metrics: Metrics | None = None) -> str:
    """docs/metrics.md: a table per section of every family."""
    rest = families(metrics)
    lines = [HEADER]
    for title, prefix, intro in SECTIONS:
        group = [f for f in rest if f.name.startswith(prefix)]
        rest = [f for f in rest if f not in group]
        lines += [f"## {title}", ""]
        if intro:
            lines += [intro, ""]
        lines += [*_table(group), ""]
    title, intro = SUPERVISOR
    lines += [f"## {title}", "", intro, "", *_table(supervisor_families()), ""]
    return "\n".join(lines)


def supervisor_families() -> list[Family]:
    """The families only the supervisor of ``--workers N`` has."""
    only = set(supervisor_names())
    return [f for f in families(SupervisorMetrics()) if f.name in only]


def _table(group: list[Family]) -> list[str]:
    lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for f in group:
        meaning = " ".join(filter(None, (f.help.strip(), NOTES.get(f.name, ""))))
        lines.append(f"| `{f.exposed}` | {f.type} | {', '.join(f.labels)} | {_cell(meaning)} |")
    return lines


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
