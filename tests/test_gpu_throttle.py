"""GPU telemetry and throttle rules through a running gateway: each action with hysteresis,
stale telemetry (fail open, or closed when asked), the prometheus source against the sim's
DCGM and vLLM names, NVML through a stand-in ``pynvml``, and the pollers' life cycle.

Telemetry time is a FakeClock; a test takes a sample by polling once itself, so nothing
waits for an interval to pass.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import pytest

from gateway.resilience.gpu import TELEMETRY, TELEMETRY_HTTP
from gateway.resilience.stage import GUARDS
from gateway.sim import SimConfig, start_sim
from gateway.testing import FakeClock, FakeNvml
from tests.backends import Model, post, started
from tests.helpers import INTERVAL_MS, chat, metric, policy, poll, until, write_policy
from tests.upstreams import Exporter

URL = "http://model.test"


async def rig(serve_app, pipeline, rule, *, route=None, backend_extra=None):
    clock = FakeClock()
    main, spare, exporter = Model("main"), Model("spare"), Exporter()
    exporter_url = await serve_app(exporter.app())
    backends = {
        "main": {
            "url": URL,
            "telemetry": {
                "source": "prometheus",
                "url": exporter_url + "/metrics",
                "interval_ms": INTERVAL_MS,
            },
            **(backend_extra or {}),
        },
        "spare": {"url": URL},
    }
    rules = [{"name": "r", "backend": "main", **rule}]
    gw = await pipeline(
        policy(backends, route, throttle=rules), {"main": main, "spare": spare}, clock=clock
    )
    poller = await first_read(gw)
    if not poller.telemetry.samples:  # it outlasted its 200 ms (a busy machine): read again
        await poll(gw)
    return gw, clock, main, spare, exporter


async def first_read(gw):
    """The poller once its read at start has ended, with a sample or an error (the next one
    waits on the FakeClock)."""
    item = gw.gateway.registry.peek(TELEMETRY, "main")
    await until(lambda: item.poller is not None)
    poller = item.poller
    await until(lambda: poller.telemetry.samples + poller.errors >= 1)
    return poller


async def served_by(gw, **kw) -> tuple[int, str, str | None]:
    answer = await post(gw, **kw)
    return (
        answer.status_code,
        answer.headers.get("X-Gateway-Backend", ""),
        answer.headers.get("X-Gateway-Fallback"),
    )


async def test_reroute_fires_above_clears_only_below_clear_below_and_never_flaps(
    serve_app, pipeline
):
    rule = {
        "when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80},
        "action": "reroute",
    }
    gw, _, _main, _spare, exporter = await rig(
        serve_app, pipeline, rule, route={"fallback": ["spare"]}
    )
    sequence = [
        (70, "main"),
        (85, "main"),  # at the threshold, not above it
        (86, "spare"),  # fires
        (84, "spare"),  # between the thresholds: holds
        (81, "spare"),
        (85.5, "spare"),
        (80, "spare"),  # clears only below 80
        (79.9, "main"),  # clears
        (84, "main"),  # between the thresholds: stays clear
        (82, "main"),
        (85.1, "spare"),
    ]
    for temperature, expected in sequence:
        exporter.temperature = temperature
        await poll(gw)
        status, backend, reason = await served_by(gw)
        assert (temperature, status, backend) == (temperature, 200, expected)
        assert reason == ("throttle" if expected == "spare" else None)
    assert gw.metric("gateway_throttle_transitions_total", rule="r", backend="main") == 3
    assert gw.metric("gateway_throttle_active", rule="r", backend="main") == 1
    assert gw.metric("gateway_gpu_temperature_celsius", backend="main") == 85.1
    assert gw.metric("gateway_fallbacks_total", route="chat", reason="throttle") == 6


async def test_reroute_without_a_fallback_serves_on_the_primary(serve_app, pipeline):
    rule = {"when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80}}
    gw, _, _main, _spare, exporter = await rig(serve_app, pipeline, rule)
    exporter.temperature = 95
    await poll(gw)
    assert await served_by(gw) == (200, "main", None)


async def test_shed_refuses_all_but_high_priority_with_retry_after_and_has_hysteresis(
    serve_app, pipeline
):
    # vLLM's KV-cache use, the signal to use for a vLLM backend (VRAM is pre-allocated).
    rule = {
        "when": {"signal": "kv_cache_usage", "above": 0.9, "clear_below": 0.8},
        "action": "shed",
    }
    gw, _, main, _, exporter = await rig(serve_app, pipeline, rule)
    exporter.kv_cache = 0.95
    await poll(gw)
    refused = await post(gw, "normal")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "overloaded"
    assert int(refused.headers["Retry-After"]) >= 1
    low = await post(gw, "low", headers={"X-Priority": "low"})
    assert low.status_code == 503
    high = await post(gw, "high", headers={"X-Priority": "high"})
    assert high.status_code == 200
    exporter.kv_cache = 0.85  # between: still shedding
    await poll(gw)
    assert (await post(gw, "still")).status_code == 503
    exporter.kv_cache = 0.79
    await poll(gw)
    assert (await post(gw, "back")).status_code == 200
    exporter.kv_cache = 0.88  # between: stays clear
    await poll(gw)
    assert (await post(gw, "fine")).status_code == 200
    assert main.arrivals == ["high", "back", "fine"]
    assert gw.metric("gateway_shed_total", backend="main", reason="throttle") == 3
    assert gw.metric("gateway_kv_cache_usage_ratio", backend="main") == 0.88


async def test_shed_with_a_fallback_moves_lower_priorities_there(serve_app, pipeline):
    rule = {
        "when": {"signal": "gpu_memory_used_ratio", "above": 0.9, "clear_below": 0.85},
        "action": "shed",
    }
    gw, _, _main, _spare, exporter = await rig(
        serve_app, pipeline, rule, route={"fallback": ["spare"]}
    )
    exporter.fb_used_mib, exporter.fb_free_mib = 76000, 4000  # 95% of VRAM
    await poll(gw)
    assert await served_by(gw) == (200, "spare", "throttle")
    assert await served_by(gw, headers={"X-Priority": "high"}) == (200, "main", None)


async def test_a_shed_rule_also_sheds_the_lower_priorities_already_queued(serve_app, pipeline):
    rule = {
        "when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80},
        "action": "shed",
    }
    extra = {"max_concurrency": 1, "queue": {"capacity": 10}}
    gw, _, main, _, exporter = await rig(serve_app, pipeline, rule, backend_extra=extra)
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    main.hold()
    busy = started(gw, "busy")
    await until(lambda: main.active == 1)
    low = started(gw, "low", headers={"X-Priority": "low"})
    await until(lambda: admission.depth == 1)
    high = started(gw, "high", headers={"X-Priority": "high"})
    await until(lambda: admission.depth == 2)
    exporter.temperature = 90
    await poll(gw)
    assert (await low).status_code == 503
    assert admission.depth == 1
    main.let(2)
    assert (await busy).status_code == 200 and (await high).status_code == 200
    assert main.arrivals == ["busy", "high"]


async def test_a_limit_rule_caps_concurrency_while_it_holds(serve_app, pipeline):
    rule = {
        "when": {"signal": "gpu_temperature_c", "above": 80, "clear_below": 76},
        "action": "limit",
        "limit": {"max_concurrency": 1},
    }
    gw, _, main, _, exporter = await rig(serve_app, pipeline, rule)
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    main.hold()
    exporter.temperature = 82
    await poll(gw)
    assert admission.limit == 1
    calls = [started(gw, f"hot{i}") for i in range(3)]
    await until(lambda: main.active == 1 and admission.depth == 2)
    exporter.temperature = 78  # between the thresholds: the cap holds
    await poll(gw)
    assert admission.limit == 1 and admission.depth == 2
    exporter.temperature = 70
    await poll(gw)  # cleared: the queue drains at once, uncapped
    await until(lambda: main.active == 3)
    main.let(3)
    assert [c.status_code for c in await asyncio.gather(*calls)] == [200] * 3
    assert admission.limit > 1000
    assert gw.metric("gateway_throttle_active", rule="r", backend="main") == 0


async def test_a_limit_rule_on_rate_refuses_past_it(serve_app, pipeline):
    rule = {
        "when": {"signal": "gpu_temperature_c", "above": 80, "clear_below": 76},
        "action": "limit",
        "limit": {"rps": 2},
    }
    gw, clock, _main, _spare, exporter = await rig(serve_app, pipeline, rule)
    exporter.temperature = 90
    await poll(gw)
    statuses = [(await post(gw)).status_code for _ in range(3)]
    assert statuses == [200, 200, 503]
    clock.advance(0.5)  # one more token; telemetry is still fresh (< 3 intervals)
    await poll(gw)
    assert (await post(gw)).status_code == 200
    refused = await post(gw)
    assert refused.status_code == 503 and "Retry-After" in refused.headers


def test_batch_limit_is_exposed_for_the_batching_stage():
    from gateway.resilience.gpu import batch_limit
    from gateway.state import Registry

    assert batch_limit(Registry(), "main") is None


async def test_a_batch_max_size_limit_reads_through_batch_limit(serve_app, pipeline):
    from gateway.resilience.gpu import batch_limit

    rule = {
        "when": {"signal": "gpu_temperature_c", "above": 80, "clear_below": 76},
        "action": "limit",
        "limit": {"batch_max_size": 4},
    }
    gw, _, _, _, exporter = await rig(serve_app, pipeline, rule)
    registry = gw.gateway.registry
    assert batch_limit(registry, "main") is None
    exporter.temperature = 90
    await poll(gw)
    assert batch_limit(registry, "main") == 4


# -- staleness -----------------------------------------------------------------------------


async def test_stale_telemetry_fails_open_rules_neither_fire_nor_clear(serve_app, pipeline):
    rule = {"when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80}}
    gw, clock, _main, _spare, exporter = await rig(
        serve_app, pipeline, rule, route={"fallback": ["spare"]}
    )
    exporter.temperature = 95
    exporter.broken = True  # the exporter dies before a sample shows the heat
    item = gw.gateway.registry.peek(TELEMETRY, "main")
    assert not await item.poller.poll_once()
    clock.advance(3 * INTERVAL_MS / 1000 + 0.01)  # no fresh sample for 3 intervals
    await until(lambda: item.poller.errors >= 2)  # the poller woke, failed again
    assert item.telemetry.stale
    assert await served_by(gw) == (200, "main", None)
    assert gw.metric("gateway_telemetry_age_seconds", backend="main") > 0.6
    # Back, hot: fires.  Then stale again while hot: the rule holds (does not clear).
    exporter.broken = False
    await poll(gw)
    assert await served_by(gw) == (200, "spare", "throttle")
    exporter.broken = True
    clock.advance(1.0)
    await until(lambda: item.poller.errors >= 3)
    assert item.telemetry.stale
    assert await served_by(gw) == (200, "spare", "throttle")


async def test_fail_closed_treats_unknown_as_firing(pipeline):
    clock = FakeClock()
    main, spare = Model("main"), Model("spare")
    backends: dict[str, dict[str, Any]] = {
        "main": {
            "url": URL,
            "telemetry": {
                "source": "prometheus",
                "url": "http://127.0.0.1:9/metrics",  # nothing listens: never a sample
                "interval_ms": INTERVAL_MS,
                "fail_closed": True,
            },
        },
        "spare": {"url": URL},
    }
    rule = {
        "name": "hot",
        "backend": "main",
        "when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80},
    }
    models = {"main": main, "spare": spare}
    gw = await pipeline(
        policy(backends, {"fallback": ["spare"]}, throttle=[rule]), models, clock=clock
    )
    assert await served_by(gw) == (200, "spare", "throttle")


# -- sources -------------------------------------------------------------------------------


async def test_the_prometheus_source_reads_the_sims_dcgm_and_vllm_names(start_gateway, tmp_path):
    clock = FakeClock()
    sim_clock = FakeClock()
    sim = await start_sim(SimConfig(port=0, base_ms=1, token_ms=0), clock=sim_clock)
    try:
        sim.engine.gpu.started(48)  # a busy GPU: 48 items of a 64-item KV cache running
        sim_clock.advance(300.0)  # five minutes of full load: hot
        backends = {
            "main": {
                "url": sim.url,
                "telemetry": {"source": "prometheus", "url": sim.url + "/metrics"},
            }
        }
        rules = [
            {
                "name": "kv",
                "backend": "main",
                "action": "shed",
                "when": {"signal": "kv_cache_usage", "above": 0.7, "clear_below": 0.5},
            },
        ]
        gw = await start_gateway(
            policy=write_policy(tmp_path, policy(backends, throttle=rules)), clock=clock
        )
        await poll(gw)
        state = sim.state()
        async with httpx.AsyncClient(timeout=10) as client:
            text = (await client.get(gw.admin_url + "/metrics")).text
            shed = await client.post(gw.url + "/v1/chat/completions", json=chat())
    finally:
        await sim.close()
    assert metric(text, "gateway_gpu_temperature_celsius", backend="main") == pytest.approx(
        state["temperature_c"]
    )
    assert state["temperature_c"] > 85
    assert metric(text, "gateway_gpu_memory_used_ratio", backend="main") == pytest.approx(
        state["vram_used_ratio"], abs=1e-3
    )
    assert metric(text, "gateway_gpu_utilization_ratio", backend="main") == pytest.approx(1.0)
    assert metric(text, "gateway_kv_cache_usage_ratio", backend="main") == 0.75
    assert metric(text, "gateway_telemetry_age_seconds", backend="main") == 0
    assert shed.status_code == 503


async def test_nvml_through_a_stand_in_pynvml(pipeline, monkeypatch):
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    clock = FakeClock()
    main, spare = Model("main"), Model("spare")
    backends: dict[str, dict[str, Any]] = {
        "main": {
            "url": URL,
            "telemetry": {"source": "nvml", "index": 0, "interval_ms": INTERVAL_MS},
        },
        "spare": {"url": URL},
    }
    rules = [
        {
            "name": "throttling",
            "backend": "main",
            "when": {"signal": "gpu_thermal_throttling", "above": 0.5, "clear_below": 0.5},
        },
    ]
    models = {"main": main, "spare": spare}
    gw = await pipeline(
        policy(backends, {"fallback": ["spare"]}, throttle=rules), models, clock=clock
    )
    await poll(gw)
    assert await served_by(gw) == (200, "main", None)
    assert gw.metric("gateway_gpu_thermal_throttling", backend="main") == 0
    nvml.gpus[0].clocks_event_reasons = 0x20  # SW thermal slowdown
    nvml.gpus[0].power_mw = 350_000
    await poll(gw)
    assert await served_by(gw) == (200, "spare", "throttle")
    assert gw.metric("gateway_gpu_thermal_throttling", backend="main") == 1
    assert gw.metric("gateway_gpu_temperature_celsius", backend="main") == 45
    assert gw.metric("gateway_gpu_power_ratio", backend="main") == 0.5
    await gw.gateway.shutdown(0.5)
    assert nvml.initialised == 0  # shutdown stopped the poller and closed NVML


# -- life cycle ----------------------------------------------------------------------------


async def test_pollers_start_with_the_gateway_follow_reloads_and_stop_on_shutdown(
    serve_app, pipeline, tmp_path
):
    exporter = Exporter()
    exporter_url = await serve_app(exporter.app())
    main = Model("main")

    def backends(interval_ms: int | None) -> dict:
        b: dict = {"url": URL}
        if interval_ms is not None:
            b["telemetry"] = {
                "source": "prometheus",
                "url": exporter_url + "/metrics",
                "interval_ms": interval_ms,
            }
        return {"main": b}

    clock = FakeClock()
    gw = await pipeline(write_policy(tmp_path, policy(backends(200))), main, clock=clock)
    registry = gw.gateway.registry
    first = registry.peek(TELEMETRY, "main")
    await until(lambda: first.telemetry.samples == 1)
    assert first.poller.running
    write_policy(tmp_path, policy(backends(400)))  # changed: a fresh poller replaces it
    assert gw.gateway.reload()
    second = registry.peek(TELEMETRY, "main")
    assert second is not first and second.poller.running
    await until(lambda: not first.poller.running)
    write_policy(tmp_path, policy(backends(None)))  # removed: stopped, its series gone
    assert gw.gateway.reload()
    assert registry.peek(TELEMETRY, "main") is None
    await until(lambda: not second.poller.running)
    assert gw.metric("gateway_telemetry_age_seconds", backend="main") is None
    write_policy(tmp_path, policy(backends(200)))
    assert gw.gateway.reload()
    third = registry.peek(TELEMETRY, "main")
    assert third.poller.running
    await gw.gateway.shutdown(0.5)
    assert not third.poller.running
    assert registry.peek(TELEMETRY_HTTP) is None


async def test_the_rules_thresholds_are_published_and_follow_reloads(serve_app, pipeline, tmp_path):
    """So a dashboard draws the policy's own lines next to the signal."""
    exporter_url = await serve_app(Exporter().app())
    backends = {"main": {"url": URL, "telemetry": {"source": "prometheus", "url": exporter_url}}}

    def rule(name: str, above: float, clear_below: float) -> dict:
        when = {"signal": "gpu_temperature_c", "above": above, "clear_below": clear_below}
        return {"name": name, "backend": "main", "when": when}

    path = write_policy(tmp_path, policy(backends, throttle=[rule("hot", 85, 80)]))
    gw = await pipeline(path, Model("main"), clock=FakeClock())
    labels = {"rule": "hot", "backend": "main", "signal": "gpu_temperature_c"}
    assert gw.metric("gateway_throttle_threshold", bound="above", **labels) == 85
    assert gw.metric("gateway_throttle_threshold", bound="clear_below", **labels) == 80
    write_policy(tmp_path, policy(backends, throttle=[rule("warm", 80, 76)]))
    assert gw.gateway.reload()
    assert gw.metric("gateway_throttle_threshold", bound="above", **labels) is None
    labels["rule"] = "warm"
    assert gw.metric("gateway_throttle_threshold", bound="above", **labels) == 80
