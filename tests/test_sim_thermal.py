"""The sim's GPU model on a fake clock: heating, cooling, utilisation, VRAM and power."""

from __future__ import annotations

import math
from typing import Any

import pytest

from gateway.sim import GpuModel, SimConfig, call_cost_ms
from gateway.testing import FakeClock

TAU_S = 60.0


def make(**overrides: Any) -> tuple[GpuModel, FakeClock]:
    clock = FakeClock()
    config = SimConfig(thermal_tau_s=TAU_S, **overrides)
    return GpuModel(config, clock), clock


def test_idle_gpu_sits_at_ambient() -> None:
    gpu, clock = make()
    clock.advance(3600)
    state = gpu.state()
    assert state.temperature_c == pytest.approx(40.0)
    assert state.utilization == 0.0
    assert state.memory_temperature_c > state.temperature_c


def test_sustained_full_load_heats_past_85c_toward_the_full_load_steady_state() -> None:
    gpu, clock = make()
    gpu.started(1)
    clock.advance(10 * TAU_S)
    state = gpu.state()
    assert state.temperature_c > 85.0
    assert state.temperature_c == pytest.approx(92.0, abs=0.01)
    assert state.utilization == pytest.approx(1.0)
    assert state.memory_temperature_c > state.temperature_c


def test_temperature_is_a_first_order_lag_with_time_constant_tau() -> None:
    """After one time constant the GPU has covered 1 - 1/e of the way to steady state."""
    gpu, clock = make()
    gpu.started(1)
    clock.advance(TAU_S)
    expected = 40.0 + (92.0 - 40.0) * (1 - math.exp(-1))
    assert gpu.state().temperature_c == pytest.approx(expected)


def test_time_scale_speeds_up_heating_by_its_factor() -> None:
    slow, slow_clock = make()
    fast, fast_clock = make(time_scale=10.0)
    slow.started(1)
    fast.started(1)
    slow_clock.advance(TAU_S)
    fast_clock.advance(TAU_S / 10)
    assert fast.state().temperature_c == pytest.approx(slow.state().temperature_c)


def test_gpu_cools_toward_ambient_at_rest_and_remembers_its_peak() -> None:
    gpu, clock = make()
    gpu.started(1)
    clock.advance(10 * TAU_S)
    hot = gpu.state().temperature_c
    gpu.finished(1)
    clock.advance(TAU_S)
    cooling = gpu.state()
    assert 40.0 < cooling.temperature_c < hot
    assert cooling.peak_temperature_c == pytest.approx(hot)
    clock.advance(10 * TAU_S)
    assert gpu.state().temperature_c == pytest.approx(40.0, abs=0.01)


def test_reset_peak_forgets_the_hottest_moment() -> None:
    gpu, clock = make()
    gpu.started(1)
    clock.advance(TAU_S)
    gpu.finished(1)
    clock.advance(10 * TAU_S)
    gpu.reset_peak()
    assert gpu.state().peak_temperature_c == pytest.approx(gpu.state().temperature_c)


def test_half_the_slots_busy_heads_halfway_and_reads_half_utilisation() -> None:
    gpu, clock = make(slots=2)
    gpu.started(1)
    clock.advance(10 * TAU_S)
    state = gpu.state()
    assert state.busy_fraction == 0.5
    assert state.utilization == pytest.approx(0.5)
    assert state.temperature_c == pytest.approx(66.0, abs=0.01)


def test_utilisation_is_averaged_over_the_window_not_instantaneous() -> None:
    gpu, clock = make(util_window_s=1.0)
    gpu.started(1)
    clock.advance(1.0)
    gpu.finished(1)
    assert gpu.state().utilization == pytest.approx(1 - math.exp(-1))
    clock.advance(10.0)
    assert gpu.state().utilization == pytest.approx(0.0, abs=1e-3)


def test_vram_and_kv_cache_rise_with_admitted_items_and_cap_at_full() -> None:
    gpu, _ = make(kv_capacity_items=64, weights_ratio=0.4, kv_pool_ratio=0.5)
    idle = gpu.state()
    assert idle.vram_used_ratio == pytest.approx(0.4)
    gpu.started(8)
    gpu.queued(8)
    loaded = gpu.state()
    assert loaded.kv_cache_usage == pytest.approx(16 / 64)
    assert loaded.vram_used_ratio == pytest.approx(0.4 + 0.5 * 16 / 64)
    assert loaded.vram_used_mib + loaded.vram_free_mib == pytest.approx(81559)
    gpu.started(200)
    assert gpu.state().kv_cache_usage == 1.0
    assert gpu.state().vram_used_ratio == pytest.approx(0.9)


def test_power_follows_utilisation_and_never_exceeds_the_limit() -> None:
    gpu, clock = make(power_idle_w=70, power_max_w=800, power_limit_w=700)
    assert gpu.state().power_w == pytest.approx(70)
    gpu.started(1)
    clock.advance(60)
    assert gpu.state().power_w == pytest.approx(700)


def test_new_config_applies_only_from_the_moment_it_is_set() -> None:
    gpu, clock = make()
    gpu.started(1)
    clock.advance(TAU_S)
    before = gpu.state().temperature_c
    gpu.config = SimConfig(thermal_tau_s=TAU_S, time_scale=1000.0)
    assert gpu.state().temperature_c == pytest.approx(before)
    clock.advance(1.0)
    assert gpu.state().temperature_c == pytest.approx(92.0, abs=0.01)


def test_repr_shows_temperature_utilisation_and_queue() -> None:
    gpu, _ = make()
    gpu.queued(2)
    assert repr(gpu) == "<GpuModel temp=40.0C util=0% running=0 waiting=1>"


def test_call_cost_matches_the_case_study() -> None:
    """One input about 50 ms, eight about 78 ms: batching eight beats eight calls by 5x."""
    config = SimConfig()
    assert call_cost_ms(config, 1) == pytest.approx(50.0)
    assert call_cost_ms(config, 8) == pytest.approx(78.0)
    assert 8 * call_cost_ms(config, 1) > 5 * call_cost_ms(config, 8)
    assert call_cost_ms(config, 1, tokens=10) == pytest.approx(50.0 + 10 * config.token_ms)
