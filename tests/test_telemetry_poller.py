"""The telemetry poller: reads on schedule, survives failures, lets telemetry go stale."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from gateway.policy.model import TelemetrySource, ThrottleRule, When
from gateway.resilience.throttle import Throttle
from gateway.telemetry import (
    NvmlSource,
    PrometheusSource,
    Telemetry,
    TelemetryPoller,
    make_source,
    telemetry_for,
)
from gateway.testing import FakeClock, FakeNvml


class Ticks:
    """The poller's sleep: each call advances the fake clock, then waits for the test's go."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.asked: asyncio.Queue[float] = asyncio.Queue()
        self._go = asyncio.Semaphore(0)

    async def __call__(self, seconds: float) -> None:
        await self.asked.put(seconds)
        await self._go.acquire()
        self.clock.advance(seconds)

    async def next(self) -> float:
        """Wait until the poller has finished a tick and asks to sleep; return how long."""
        return await asyncio.wait_for(self.asked.get(), timeout=5)

    def go(self) -> None:
        self._go.release()


def rig(interval_ms: int = 1000) -> tuple[FakeNvml, Telemetry, TelemetryPoller, Ticks]:
    clock = FakeClock()
    nvml = FakeNvml()
    telemetry = Telemetry("main", interval_ms, clock=clock)
    ticks = Ticks(clock)
    poller = TelemetryPoller(
        telemetry, NvmlSource(0, nvml=nvml, clock=clock), clock=clock, sleep=ticks
    )
    return nvml, telemetry, poller, ticks


async def test_it_polls_every_interval_and_keeps_the_latest_sample() -> None:
    nvml, telemetry, poller, ticks = rig(interval_ms=500)
    poller.start()
    assert await ticks.next() == pytest.approx(0.5)
    assert telemetry.value("gpu_temperature_c") == 45
    nvml.gpus[0].temperature_c = 60
    ticks.go()
    assert await ticks.next() == pytest.approx(0.5)
    assert telemetry.value("gpu_temperature_c") == 60
    assert telemetry.samples == 2
    assert "running" in repr(poller)
    await poller.stop()
    assert not poller.running
    assert nvml.initialised == 0  # stopping closed the source


async def test_failed_reads_are_counted_and_the_signals_go_unknown_once_stale() -> None:
    nvml, telemetry, poller, ticks = rig()
    poller.start()
    await ticks.next()
    nvml.fail["nvmlDeviceGetTemperature"] = nvml.NVML_ERROR_GPU_IS_LOST
    for expected_errors in (1, 2, 3):
        ticks.go()
        await ticks.next()
        assert poller.errors == expected_errors
        assert telemetry.value("gpu_temperature_c") == 45  # 3 intervals old: still fresh
    ticks.go()
    await ticks.next()
    assert telemetry.stale and telemetry.value("gpu_temperature_c") is None
    del nvml.fail["nvmlDeviceGetTemperature"]
    ticks.go()
    await ticks.next()
    assert telemetry.value("gpu_temperature_c") == 45
    assert poller.errors == 4 and poller.last_error is None
    await poller.stop()


async def test_a_sample_hook_evaluates_throttle_rules_at_sample_time() -> None:
    nvml, telemetry, poller, _ = rig()
    rule = ThrottleRule("hot", "main", When("gpu_temperature_c", above=85, clear_below=80))
    throttle = Throttle([rule], telemetry={"main": telemetry}, clock=FakeClock())
    poller.on_sample = throttle.on_sample
    nvml.gpus[0].temperature_c = 90
    assert await poller.poll_once()
    assert throttle.is_active("hot", "main")


async def test_configs_build_their_sources() -> None:
    clock = FakeClock()
    nvml_config = TelemetrySource(source="nvml", index=2, interval_ms=250, fail_closed=True)
    assert isinstance(make_source(nvml_config, nvml=FakeNvml(), clock=clock), NvmlSource)
    telemetry = telemetry_for("main", nvml_config, clock)
    assert (telemetry.interval_s, telemetry.fail_closed) == (0.25, True)
    assert make_source(TelemetrySource()) is None
    async with aiohttp.ClientSession() as session:
        prom = make_source(
            TelemetrySource(source="prometheus", url="http://a/m", extra_urls=("http://b/m",)),
            session=session,
        )
    assert isinstance(prom, PrometheusSource) and prom.urls == ("http://a/m", "http://b/m")
