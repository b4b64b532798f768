"""The ``nvml`` telemetry source: read one GPU through NVML (the ``pynvml`` module).

For a sidecar that shares the GPU's container or node.  NVML calls block (a whole sample took
about 35 us on an H200, the first one, which starts NVML, about 120 ms), so every call runs in
a worker thread, never on the event loop.
The module is injected: the real ``pynvml`` by default, ``gateway.testing.FakeNvml`` in tests.
pynvml's exceptions are translated here, once: a reading the device does not support (memory
temperature on many boards, power limits on some) becomes an unknown signal; any other NVML
error fails the whole sample as ``TelemetryError``.
"""

from __future__ import annotations

import asyncio
from types import ModuleType
from typing import Any

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import TelemetryError
from gateway.telemetry.signals import Sample

THERMAL_REASONS = 0x08 | 0x20 | 0x40
"""Clock-event reason bits that mean heat: HW slowdown, SW thermal slowdown, HW thermal."""

_VALUE_FIELDS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
"""``c_nvmlValue_t`` members, indexed by ``NVML_VALUE_TYPE_*``."""


def _load_pynvml() -> Any:
    try:
        import pynvml
    except ImportError as exc:  # pragma: no cover - nvidia-ml-py is a dependency
        raise TelemetryError("the nvml source needs the nvidia-ml-py package") from exc
    return pynvml


class NvmlSource:
    """Reads GPU ``index`` through NVML; initialises NVML on first read, shuts it on close."""

    def __init__(
        self,
        index: int = 0,
        *,
        nvml: ModuleType | Any = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.index = index
        self._nvml: Any = nvml
        self._clock = clock
        self._handle: Any = None
        self._thresholds: tuple[float | None, float | None] = (None, None)
        self._pending: asyncio.Future[Sample] | None = None
        self.name: str | None = None

    async def read(self) -> Sample:
        """One sample, read in a worker thread.  A read that hangs in the driver cannot be
        stopped; until it returns, further reads fail at once instead of piling up threads."""
        if self._pending is not None and not self._pending.done():
            raise TelemetryError(f"the previous NVML read of GPU {self.index} has not returned")
        pending = self._pending = asyncio.ensure_future(asyncio.to_thread(self._read))
        pending.add_done_callback(_retrieve)
        return await asyncio.shield(pending)

    async def aclose(self) -> None:
        if self._handle is not None:
            self._handle = None
            await asyncio.to_thread(self._shutdown)

    def _shutdown(self) -> None:
        nvml = self._nvml
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass  # shutting down a lost device must not fail the gateway's shutdown

    def _open(self) -> Any:
        if self._nvml is None:
            self._nvml = _load_pynvml()
        nvml = self._nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise TelemetryError(f"NVML could not start: {exc}") from exc
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(self.index)
            name = nvml.nvmlDeviceGetName(handle)
            threshold = nvml.nvmlDeviceGetTemperatureThreshold
            slowdown = self._optional(threshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN)
            shutdown = self._optional(threshold, handle, nvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN)
        except nvml.NVMLError as exc:
            self._shutdown()
            raise TelemetryError(f"NVML cannot open GPU {self.index}: {exc}") from exc
        self.name = name.decode() if isinstance(name, bytes) else str(name)
        self._thresholds = (_float(slowdown), _float(shutdown))
        self._handle = handle
        return handle

    def _read(self) -> Sample:
        handle = self._handle if self._handle is not None else self._open()
        nvml = self._nvml
        opt = self._optional
        try:
            temperature = opt(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
            memory = opt(nvml.nvmlDeviceGetMemoryInfo, handle)
            utilization = opt(nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = opt(nvml.nvmlDeviceGetPowerUsage, handle)
            limit_mw = opt(nvml.nvmlDeviceGetEnforcedPowerLimit, handle)
            reasons = opt(self._clock_reasons_fn(), handle)
            memory_temperature = self._memory_temperature(handle)
        except nvml.NVMLError as exc:
            raise TelemetryError(f"NVML read of GPU {self.index} failed: {exc}") from exc
        slowdown, shutdown = self._thresholds
        return Sample(
            at=self._clock.now(),
            gpu_temperature_c=_float(temperature),
            gpu_memory_temperature_c=memory_temperature,
            gpu_memory_used_ratio=(
                memory.used / memory.total if memory is not None and memory.total else None
            ),
            gpu_utilization=None if utilization is None else utilization.gpu / 100,
            gpu_power_ratio=(power_mw / limit_mw if power_mw is not None and limit_mw else None),
            gpu_thermal_throttling=(
                None if reasons is None else float(bool(int(reasons) & THERMAL_REASONS))
            ),
            gpu_slowdown_temperature_c=slowdown,
            gpu_shutdown_temperature_c=shutdown,
        )

    def _clock_reasons_fn(self) -> Any:
        nvml = self._nvml
        # Renamed from "throttle" to "event" reasons in NVML 12.x; older bindings lack the new name.
        fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        return fn or nvml.nvmlDeviceGetCurrentClocksThrottleReasons

    def _memory_temperature(self, handle: Any) -> float | None:
        nvml = self._nvml
        field = getattr(nvml, "NVML_FI_DEV_MEMORY_TEMP", None)
        if field is None:
            return None
        values = self._optional(nvml.nvmlDeviceGetFieldValues, handle, [field])
        if not values or values[0].nvmlReturn != nvml.NVML_SUCCESS:
            return None
        value = values[0]
        member = _VALUE_FIELDS[value.valueType] if value.valueType < len(_VALUE_FIELDS) else None
        reading = getattr(value.value, member) if member else None
        # Boards without a memory sensor may answer success with 0.
        return float(reading) if reading else None

    def _optional(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or None when the device does not support or permit that reading."""
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError as exc:
            if getattr(exc, "value", None) in (
                nvml.NVML_ERROR_NOT_SUPPORTED,
                nvml.NVML_ERROR_NO_PERMISSION,
            ):
                return None
            raise

    def __repr__(self) -> str:
        state = "open" if self._handle is not None else "closed"
        name = f" {self.name!r}" if self.name else ""
        return f"<NvmlSource gpu={self.index}{name} {state}>"


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _retrieve(future: asyncio.Future[Sample]) -> None:
    """Mark the outcome of a read nobody awaited any more (it timed out) as seen."""
    if not future.cancelled():
        future.exception()
