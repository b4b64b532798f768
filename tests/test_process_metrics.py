"""The gateway's metrics of itself: its version, the process (memory, CPU, descriptors, GC)
on the app's own registry, and the event-loop lag sampled while the app runs."""

from __future__ import annotations

import asyncio
from importlib.metadata import version

import pytest
from prometheus_client import CollectorRegistry, Histogram

from gateway import __version__
from gateway.metrics import LAG_BUCKETS, Metrics
from gateway.metrics.loop_lag import LoopLag
from gateway.testing.harness import Pipeline
from tests.helpers import until

POLICY = """
backends: {main: {url: "http://main.test"}}
routes: [{name: chat, match: {path: "/v1/*"}, backend: main}]
"""


def lag_histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("lag_seconds", "lag", buckets=LAG_BUCKETS, registry=registry)


def test_build_info_labels_the_installed_version():
    text = Metrics().exposition().decode()
    assert __version__ == version("sidecar-gateway")
    assert f'gateway_build_info{{version="{__version__}"}} 1.0' in text


def test_process_metrics_are_on_the_apps_own_registry():
    """Each app's registry has the process collectors, so two apps in one process (a test
    per app) neither collide on the default registry nor lack them."""
    first, second = Metrics(), Metrics()
    for metrics in (first, second):
        assert (metrics.registry.get_sample_value("process_resident_memory_bytes") or 0) > 0
        assert metrics.registry.get_sample_value("process_open_fds") is not None
        assert (
            metrics.registry.get_sample_value("python_gc_collections_total", {"generation": "0"})
            is not None
        )
    assert "python_info{" in first.exposition().decode()


def test_the_lag_is_how_late_the_timer_ran_and_never_negative():
    registry, histogram = lag_histogram()
    lag = LoopLag(histogram)
    assert lag.observe(due=10.0, ran=10.003) == pytest.approx(0.003)
    assert lag.observe(due=10.0, ran=9.9999) == 0.0  # a clock tick early is no lag
    assert registry.get_sample_value("lag_seconds_count") == 2
    assert registry.get_sample_value("lag_seconds_bucket", {"le": "0.0025"}) == 1
    assert registry.get_sample_value("lag_seconds_bucket", {"le": "0.005"}) == 2
    assert repr(lag) == "<LoopLag every=0.25s stopped samples=2 last=0.0ms>"


async def test_a_loop_held_past_the_timer_shows_as_lag(monkeypatch):
    """On the loop's own clock (patched, as aiolimiter's tests do): the timer was due at
    t + 0.25 and the loop came back to it at t + 0.29, so 40 ms of lag."""
    loop = asyncio.get_running_loop()
    now = [loop.time()]
    monkeypatch.setattr(loop, "time", lambda: now[0])
    registry, histogram = lag_histogram()
    lag = LoopLag(histogram)
    lag.start()
    try:
        await asyncio.sleep(0)  # the sampler reads the clock and sets its timer
        now[0] += 0.29
        for _ in range(100):
            if lag.samples:
                break
            await asyncio.sleep(0)
        assert lag.samples == 1 and lag.last_s == pytest.approx(0.04)
        assert registry.get_sample_value("lag_seconds_bucket", {"le": "0.025"}) == 0
        assert registry.get_sample_value("lag_seconds_bucket", {"le": "0.05"}) == 1
        assert repr(lag) == "<LoopLag every=0.25s running samples=1 last=40.0ms>"
    finally:
        await lag.aclose()
    assert not lag.running


async def test_the_app_samples_the_lag_while_it_runs_and_stops_at_shutdown():
    async with Pipeline(POLICY, {}) as gw:
        assert gw.gateway.loop_lag.running
        await until(lambda: (gw.metric("gateway_event_loop_lag_seconds_count") or 0) >= 1)
    assert not gw.gateway.loop_lag.running
    assert gw.metric("gateway_event_loop_lag_seconds_count") == gw.gateway.loop_lag.samples


async def test_the_collectors_pauses_are_timed_by_generation_while_the_app_runs():
    """A full collection holds the loop: ``gateway_gc_pause_seconds{generation="2"}`` counts
    it, recorded at the sampler's next tick (the hook itself takes no lock); once the app
    has stopped its hook is gone from ``gc.callbacks``."""
    import gc

    async with Pipeline(POLICY, {}) as gw:
        hook = gw.gateway.loop_lag._on_gc
        assert hook in gc.callbacks
        gc.collect()
        await until(lambda: (gw.metric("gateway_gc_pause_seconds_count", generation="2") or 0) >= 1)
    assert hook not in gc.callbacks


async def test_serve_freezes_the_ready_heap_out_of_the_collectors_scans(monkeypatch):
    """``gateway serve`` freezes what it holds once ready (``settle_heap``), so a full
    collection scans only what came after; ``GATEWAY_GC_FREEZE=0`` leaves the heap as it
    is.  (The test process's heap is unfrozen again after.)"""
    import gc
    from types import SimpleNamespace

    from gateway.serve import settle_heap

    gateway = SimpleNamespace(warmed=asyncio.Event())
    monkeypatch.setenv("GATEWAY_GC_FREEZE", "0")
    assert await settle_heap(gateway, (0.0,)) == 0 and gc.get_freeze_count() == 0
    monkeypatch.delenv("GATEWAY_GC_FREEZE")
    settling = asyncio.ensure_future(settle_heap(gateway, (0.0,)))
    try:
        await asyncio.sleep(0.2)
        assert not settling.done()  # not before it is ready
        gateway.warmed.set()
        frozen = await settling
        assert frozen > 1000 and gc.get_freeze_count() > 1000  # (less what was freed since)
    finally:
        gc.unfreeze()
