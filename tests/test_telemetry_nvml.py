"""The nvml telemetry source, through the stand-in pynvml module (and once through a real GPU)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from gateway.errors import TelemetryError
from gateway.telemetry import NvmlSource
from gateway.testing import FakeClock, FakeNvml


async def test_readings_become_normalised_signals() -> None:
    nvml = FakeNvml(gpus=2)
    gpu = nvml.gpus[1]
    gpu.temperature_c, gpu.memory_temperature_c = 83, 88
    gpu.memory_used_bytes, gpu.memory_total_bytes = 72 * 2**30, 80 * 2**30
    gpu.utilization_pct, gpu.power_mw, gpu.power_limit_mw = 97, 350_000, 700_000
    clock = FakeClock()
    source = NvmlSource(1, nvml=nvml, clock=clock)
    sample = await source.read()
    assert sample.at == clock.now()
    assert sample.gpu_temperature_c == 83
    assert sample.gpu_memory_temperature_c == 88
    assert sample.gpu_memory_used_ratio == pytest.approx(0.9)
    assert sample.gpu_utilization == pytest.approx(0.97)
    assert sample.gpu_power_ratio == pytest.approx(0.5)
    assert sample.gpu_thermal_throttling == 0.0
    assert (sample.gpu_slowdown_temperature_c, sample.gpu_shutdown_temperature_c) == (89, 92)
    assert repr(source) == "<NvmlSource gpu=1 'Fake GPU 80GB' open>"


@pytest.mark.parametrize(
    ("reasons", "throttling"),
    [(0x20, 1.0), (0x40, 1.0), (0x08, 1.0), (0x04, 0.0), (0x80, 0.0), (0x24, 1.0)],
)
async def test_thermal_clock_event_reasons_mean_thermal_throttling(
    reasons: int, throttling: float
) -> None:
    nvml = FakeNvml()
    nvml.gpus[0].clocks_event_reasons = reasons
    sample = await NvmlSource(0, nvml=nvml).read()
    assert sample.gpu_thermal_throttling == throttling


async def test_readings_the_device_does_not_support_are_unknown_not_errors() -> None:
    nvml = FakeNvml()
    gpu = nvml.gpus[0]
    gpu.memory_temperature_c = None
    gpu.power_limit_mw = None
    gpu.slowdown_c = None
    nvml.fail["nvmlDeviceGetCurrentClocksEventReasons"] = nvml.NVML_ERROR_NO_PERMISSION
    sample = await NvmlSource(0, nvml=nvml).read()
    assert sample.gpu_temperature_c == 45
    assert sample.gpu_memory_temperature_c is None
    assert sample.gpu_power_ratio is None
    assert sample.gpu_thermal_throttling is None
    assert sample.gpu_slowdown_temperature_c is None


async def test_nvml_errors_are_translated_into_telemetry_errors() -> None:
    nvml = FakeNvml()
    nvml.fail["nvmlInit"] = nvml.NVML_ERROR_DRIVER_NOT_LOADED
    source = NvmlSource(0, nvml=nvml)
    with pytest.raises(TelemetryError, match="could not start") as caught:
        await source.read()
    assert isinstance(caught.value.__cause__, nvml.NVMLError)
    del nvml.fail["nvmlInit"]
    await source.read()  # NVML came back: the next read opens it
    nvml.fail["nvmlDeviceGetTemperature"] = nvml.NVML_ERROR_GPU_IS_LOST
    with pytest.raises(TelemetryError, match="read of GPU 0 failed"):
        await source.read()


async def test_a_missing_gpu_index_fails_and_releases_nvml() -> None:
    nvml = FakeNvml(gpus=1)
    with pytest.raises(TelemetryError, match="cannot open GPU 3"):
        await NvmlSource(3, nvml=nvml).read()
    assert nvml.initialised == 0


async def test_nvml_is_called_off_the_event_loop_and_shut_down_on_close() -> None:
    nvml = FakeNvml()
    source = NvmlSource(0, nvml=nvml)
    await source.read()
    assert nvml.initialised == 1
    assert threading.get_ident() not in nvml.threads
    await source.aclose()
    assert nvml.initialised == 0
    assert repr(source) == "<NvmlSource gpu=0 'Fake GPU 80GB' closed>"


@pytest.mark.gpu
async def test_a_real_gpu_reads_through_real_nvml() -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"NVML finds no device here: {exc}")
    try:
        source = NvmlSource(0)
        sample = await source.read()
        await source.aclose()
    finally:
        pynvml.nvmlShutdown()
    print(sample)
    assert sample.gpu_temperature_c is not None and 5 <= sample.gpu_temperature_c <= 110
    assert sample.gpu_memory_used_ratio is not None and 0 < sample.gpu_memory_used_ratio <= 1
    assert sample.gpu_utilization is not None and 0 <= sample.gpu_utilization <= 1
    if sample.gpu_power_ratio is not None:
        assert 0 < sample.gpu_power_ratio < 1.5
    if sample.gpu_slowdown_temperature_c is not None:
        assert 60 <= sample.gpu_slowdown_temperature_c <= 110
    assert sample.gpu_thermal_throttling in (0.0, 1.0, None)


async def test_a_read_hung_in_the_driver_blocks_further_reads_instead_of_piling_threads() -> None:
    nvml = FakeNvml()
    source = NvmlSource(0, nvml=nvml)
    await source.read()
    nvml.gate = threading.Event()
    first = asyncio.create_task(source.read())
    await asyncio.sleep(0)
    first.cancel()  # the poller gave up on it; its thread is still inside NVML
    with contextlib.suppress(asyncio.CancelledError):
        await first
    with pytest.raises(TelemetryError, match="has not returned"):
        await source.read()
    nvml.gate.set()
    for _ in range(5000):  # wait for the worker thread to come back out of the fake driver
        with contextlib.suppress(TelemetryError):
            assert (await source.read()).gpu_temperature_c == 45
            break
        await asyncio.sleep(0.001)
    else:
        pytest.fail("the hung read never returned")
