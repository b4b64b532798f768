"""The supervisor's one ``/metrics`` across its workers (``gateway.metrics.merged``), merged
from real ``Metrics`` registries: counters and histograms summed, each gauge by its
family's rule, counters kept from going down when a worker is replaced."""

from __future__ import annotations

from gateway.metrics import Metrics
from gateway.metrics.merged import (
    GAUGES,
    Retired,
    SupervisorMetrics,
    merge,
    parse,
    render,
    rule_of,
    supervisor_names,
)
from tests.helpers import metric


def worker(requests: int, *, generation: int = 1, inflight: int = 0) -> Metrics:
    m = Metrics()
    for _ in range(requests):
        m.count_request("chat", "main", 200)
        m.request_duration.labels("chat", "main").observe(0.02)
    m.inflight.labels("main").set(inflight)
    m.set_policy(generation, f"hash{generation}", ())
    return m


def merged(*workers: Metrics, shared_store: bool = False) -> str:
    sources = [parse(w.exposition().decode()) for w in workers]
    return render(merge(sources, shared_store=shared_store)).decode()


def test_one_worker_merged_alone_is_its_own_exposition():
    one = worker(3, inflight=2)
    text = one.exposition().decode()
    assert render(merge([parse(text)])).decode() == text


def test_counters_and_histograms_are_summed_per_label_set():
    text = merged(worker(2), worker(5))
    assert metric(text, "gateway_requests_total", route="chat", backend="main", status="200") == 7
    duration = "gateway_request_duration_seconds"
    assert metric(text, duration + "_count", route="chat", backend="main") == 7
    assert metric(text, duration + "_bucket", route="chat", backend="main", le="0.025") == 7
    assert metric(text, duration + "_bucket", route="chat", backend="main", le="0.01") == 0


def test_a_counters_start_is_the_earliest_workers():
    early, late = worker(1), worker(1)
    starts = [
        metric(
            m.exposition().decode(),
            "gateway_requests_created",
            route="chat",
            backend="main",
            status="200",
        )
        for m in (early, late)
    ]
    text = merged(late, early)
    shown = metric(text, "gateway_requests_created", route="chat", backend="main", status="200")
    assert shown == min(s for s in starts if s is not None)


def test_amounts_are_summed_states_and_settings_are_not():
    text = merged(worker(0, generation=2, inflight=3), worker(0, generation=3, inflight=4))
    assert metric(text, "gateway_inflight_requests", backend="main") == 7
    assert metric(text, "gateway_policy_generation") == 3
    # two workers on two policies: both hashes show, as two replicas' would
    assert metric(text, "gateway_policy_info", hash="hash2") == 1
    assert metric(text, "gateway_policy_info", hash="hash3") == 1


def test_a_breaker_shows_open_when_any_workers_is_open():
    states = []
    for values in ((0, 2), (2, 1), (0, 0)):
        workers = []
        for value in values:
            m = Metrics()
            m.breaker_state.labels("main").set(value)
            workers.append(m)
        states.append(metric(merged(*workers), "gateway_breaker_state", backend="main"))
    assert states == [2, 1, 0]


def test_the_caches_figures_add_up_with_memory_and_are_the_stores_with_redis():
    workers = []
    for entries in (10, 12):
        m = Metrics()
        m.cache_entries.set(entries)
        m.pool_active_endpoints.labels("main").set(entries // 5)
        workers.append(m)
    assert metric(merged(*workers), "gateway_cache_entries") == 22
    assert metric(merged(*workers, shared_store=True), "gateway_cache_entries") == 12
    assert metric(merged(*workers), "gateway_pool_active_endpoints", backend="main") == 2


def test_every_gauge_the_gateway_and_the_supervisor_export_has_a_merge_rule():
    """A new gauge must say how it merges: summed, or a state whose sum means nothing."""
    gauges = {
        family.name
        for registry in (Metrics().registry, SupervisorMetrics().registry)
        for family in registry.collect()
        if family.type == "gauge"
    }
    assert gauges - set(GAUGES) == set()
    assert set(GAUGES) - gauges == set()  # and no rule for what no longer exists
    every = parse(merged(Metrics()))
    assert {rule_of(f, shared_store=False) for f in every if f.type == "counter"} == {"sum"}


def test_a_replaced_workers_counters_stay_in_the_totals():
    """The counters a worker showed last are kept when it exits, so the merged counters
    never go down when it is replaced (Prometheus would take that for a reset)."""
    a, b = worker(4), worker(6)
    scraped_b = parse(b.exposition().decode())
    before = metric(
        merged(a, b), "gateway_requests_total", route="chat", backend="main", status="200"
    )
    retired = Retired()
    retired.add(scraped_b)
    replacement = worker(1)
    sources = [parse(w.exposition().decode()) for w in (a, replacement)]
    text = render(merge([*sources, retired.families()])).decode()
    after = metric(text, "gateway_requests_total", route="chat", backend="main", status="200")
    assert (before, after) == (10, 11)
    assert metric(text, "gateway_inflight_requests", backend="main") == 0  # gauges not kept
    assert repr(retired) == f"<Retired workers=1 families={len(retired.families())}>"


def test_the_supervisors_own_series_carry_the_policys_constant_labels():
    own = SupervisorMetrics()
    own.workers.set(3)
    text = render(own.families((("gpu_type", "h200"),))).decode()
    assert metric(text, "gateway_workers", gpu_type="h200") == 3
    assert metric(text, "gateway_worker_restarts_total", gpu_type="h200") == 0
    assert supervisor_names() == ["gateway_worker_restarts", "gateway_workers"]
