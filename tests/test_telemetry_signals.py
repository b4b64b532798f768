"""The per-backend Telemetry holder: unknown before a sample, fresh, stale after 3 intervals."""

from __future__ import annotations

import pytest

from gateway.telemetry import SIGNALS, STALE_INTERVALS, Sample, Telemetry
from gateway.testing import FakeClock


def test_every_signal_is_unknown_before_the_first_sample() -> None:
    telemetry = Telemetry("main", 1000, clock=FakeClock())
    assert telemetry.age_s is None
    assert telemetry.stale
    assert all(telemetry.value(s) is None for s in SIGNALS)
    assert repr(telemetry) == "<Telemetry main age=never stale samples=0>"


def test_a_fresh_sample_answers_and_an_unread_signal_stays_unknown() -> None:
    clock = FakeClock()
    telemetry = Telemetry("main", 1000, clock=clock)
    telemetry.update(Sample(at=clock.now(), gpu_temperature_c=71.0))
    clock.advance(0.5)
    assert telemetry.value("gpu_temperature_c") == 71.0
    assert telemetry.value("kv_cache_usage") is None
    assert telemetry.age_s == pytest.approx(0.5)
    assert repr(telemetry) == "<Telemetry main age=0.5s samples=1>"


def test_telemetry_goes_stale_after_three_intervals_without_a_sample() -> None:
    clock = FakeClock()
    telemetry = Telemetry("main", 500, clock=clock)
    telemetry.update(Sample(at=clock.now(), gpu_temperature_c=71.0))
    clock.advance(STALE_INTERVALS * 0.5)
    assert telemetry.value("gpu_temperature_c") == 71.0  # exactly 3 intervals: still fresh
    clock.advance(0.001)
    assert telemetry.stale
    assert telemetry.value("gpu_temperature_c") is None
    assert telemetry.sample is not None  # the last reading is kept for display
    telemetry.update(Sample(at=clock.now(), gpu_temperature_c=72.0))
    assert telemetry.value("gpu_temperature_c") == 72.0


def test_asking_for_an_unknown_signal_name_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown signal"):
        Sample(at=0.0).value("gpu_fan_speed")  # type: ignore[arg-type]


def test_known_lists_only_the_fields_that_were_read() -> None:
    sample = Sample(at=1.0, gpu_temperature_c=60.0, gpu_slowdown_temperature_c=89.0)
    assert sample.known() == {"gpu_temperature_c": 60.0, "gpu_slowdown_temperature_c": 89.0}
