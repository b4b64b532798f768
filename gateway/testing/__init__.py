"""Fakes of the gateway's boundaries, shared by its tests and by its users' tests.

Each boundary (clock, upstream transport, DNS, socket, cache store, NVML) has one real
implementation in the package and one fake here (the transport's and DNS's in
``gateway.testing.transport``, re-exported).  Nothing in this module fakes the
gateway's own logic.  ``Pipeline`` (``gateway.testing.harness``, exported here and loaded on
first use) runs a whole gateway, its edge and stages as they are, over a ``FakeTransport``
and without sockets.  The gateway's own code never imports this package
(``tests/test_layout.py``).
"""

from __future__ import annotations

from typing import Any

from gateway.lazy import exports
from gateway.testing.transport import (
    FakeResolver,
    FakeTransport,
    Respond,
    Sent,
    json_reply,
    stream_reply,
)

__all__ = [
    "FakeClock",
    "FakeGpu",
    "FakeNvml",
    "FakeNvmlError",
    "FakeResolver",
    "FakeSocket",
    "FakeTransport",
    "FlakyStore",
    "Pipeline",
    "Respond",
    "Sent",
    "json_reply",
    "stream_reply",
]


class FakeClock:
    """A clock that moves only when told: ``advance(seconds)``."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start
        self._sleepers: list[tuple[float, Any]] = []

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time only moves forward")
        self._now += seconds
        self._wake_sleepers()

    async def sleep(self, seconds: float) -> None:
        """Like ``asyncio.sleep``, but returns only once ``advance`` moved time that far."""
        import asyncio

        deadline = self._now + max(0.0, seconds)
        if deadline <= self._now:
            await asyncio.sleep(0)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((deadline, waiter))
        try:
            await waiter
        finally:
            self._sleepers = [(d, w) for d, w in self._sleepers if w is not waiter]

    @property
    def sleepers(self) -> int:
        """How many ``sleep`` calls are waiting for time to move."""
        return sum(1 for _, w in self._sleepers if not w.done())

    def _wake_sleepers(self) -> None:
        for deadline, waiter in self._sleepers:
            if deadline <= self._now and not waiter.done():
                waiter.set_result(None)

    def __repr__(self) -> str:
        return f"<FakeClock now={self._now:.3f}>"


class FakeNvmlError(Exception):
    """What ``FakeNvml`` raises: like ``pynvml.NVMLError``, the NVML code is in ``value``."""

    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeGpu:
    """One fake device's readings; set any attribute between reads.  None means unsupported."""

    def __init__(self, index: int = 0, name: str = "Fake GPU 80GB") -> None:
        self.index = index
        self.name = name
        self.temperature_c: int | None = 45
        self.memory_temperature_c: int | None = 50
        self.memory_used_bytes = 10 * 2**30
        self.memory_total_bytes: int | None = 80 * 2**30
        self.utilization_pct: int | None = 30
        self.power_mw: int | None = 150_000
        self.power_limit_mw: int | None = 700_000
        self.clocks_event_reasons: int | None = 0
        self.slowdown_c: int | None = 89
        self.shutdown_c: int | None = 92

    def __repr__(self) -> str:
        return f"<FakeGpu {self.index} temp={self.temperature_c}C util={self.utilization_pct}%>"


class FakeNvml:
    """A stand-in for the ``pynvml`` module: the functions and constants the gateway uses.

    ``gpus`` holds the devices' readings.  ``fail[function_name] = code`` makes that function
    raise ``NVMLError(code)`` until removed (``"nvmlInit"`` too).  ``threads`` records the
    thread ids calls ran on, so a test can prove they stayed off the event loop.  Set ``gate``
    to a ``threading.Event`` and every call waits for it: a driver that hangs.
    """

    NVMLError = FakeNvmlError
    NVML_SUCCESS = 0
    NVML_ERROR_UNINITIALIZED = 1
    NVML_ERROR_INVALID_ARGUMENT = 2
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_DRIVER_NOT_LOADED = 9
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_ERROR_UNKNOWN = 999
    NVML_TEMPERATURE_GPU = 0
    NVML_TEMPERATURE_THRESHOLD_SHUTDOWN = 0
    NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 1
    NVML_TEMPERATURE_THRESHOLD_GPU_MAX = 3
    NVML_FI_DEV_MEMORY_TEMP = 82
    NVML_VALUE_TYPE_UNSIGNED_INT = 1

    def __init__(self, gpus: int = 1) -> None:
        self.gpus = [FakeGpu(i) for i in range(gpus)]
        self.fail: dict[str, int] = {}
        self.initialised = 0
        self.calls = 0
        self.threads: set[int] = set()
        self.gate: Any = None

    def _enter(self, function: str) -> None:
        import threading

        if self.gate is not None:
            self.gate.wait(timeout=10)
        self.calls += 1
        self.threads.add(threading.get_ident())
        if function in self.fail:
            raise FakeNvmlError(self.fail[function])
        if function != "nvmlInit" and self.initialised <= 0:
            raise FakeNvmlError(self.NVML_ERROR_UNINITIALIZED)

    @staticmethod
    def _supported(value: int | None) -> int:
        if value is None:
            raise FakeNvmlError(FakeNvml.NVML_ERROR_NOT_SUPPORTED)
        return value

    def nvmlInit(self) -> None:
        self._enter("nvmlInit")
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.initialised -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError(self.NVML_ERROR_INVALID_ARGUMENT)
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        self._enter("nvmlDeviceGetName")
        return gpu.name

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        self._enter("nvmlDeviceGetTemperature")
        return self._supported(gpu.temperature_c)

    def nvmlDeviceGetTemperatureThreshold(self, gpu: FakeGpu, kind: int) -> int:
        self._enter("nvmlDeviceGetTemperatureThreshold")
        if kind == self.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN:
            return self._supported(gpu.slowdown_c)
        if kind == self.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN:
            return self._supported(gpu.shutdown_c)
        raise FakeNvmlError(self.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> object:
        from types import SimpleNamespace

        self._enter("nvmlDeviceGetMemoryInfo")
        total = self._supported(gpu.memory_total_bytes)
        used = gpu.memory_used_bytes
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> object:
        from types import SimpleNamespace

        self._enter("nvmlDeviceGetUtilizationRates")
        return SimpleNamespace(gpu=self._supported(gpu.utilization_pct), memory=0)

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._enter("nvmlDeviceGetPowerUsage")
        return self._supported(gpu.power_mw)

    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: FakeGpu) -> int:
        self._enter("nvmlDeviceGetEnforcedPowerLimit")
        return self._supported(gpu.power_limit_mw)

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        self._enter("nvmlDeviceGetCurrentClocksEventReasons")
        return self._supported(gpu.clocks_event_reasons)

    def nvmlDeviceGetFieldValues(self, gpu: FakeGpu, field_ids: list[int]) -> list[object]:
        from types import SimpleNamespace

        self._enter("nvmlDeviceGetFieldValues")
        out: list[object] = []
        for field_id in field_ids:
            reading = gpu.memory_temperature_c if field_id == self.NVML_FI_DEV_MEMORY_TEMP else None
            out.append(
                SimpleNamespace(
                    fieldId=field_id,
                    nvmlReturn=(
                        self.NVML_SUCCESS if reading is not None else self.NVML_ERROR_NOT_SUPPORTED
                    ),
                    valueType=self.NVML_VALUE_TYPE_UNSIGNED_INT,
                    value=SimpleNamespace(uiVal=reading or 0),
                )
            )
        return out

    def __repr__(self) -> str:
        failing = f" failing={sorted(self.fail)}" if self.fail else ""
        state = f"gpus={len(self.gpus)} init={self.initialised} calls={self.calls}"
        return f"<FakeNvml {state}{failing}>"


class FlakyStore:
    """A cache store wrapper that fails on demand: ``failing = True`` makes every call
    raise ``StoreError``, as a Redis that is down would.  ``calls`` counts calls by name."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.failing = False
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if name in ("stats", "sweep") or not callable(target):
            return target

        async def call(*args: Any, **kwargs: Any) -> Any:
            from gateway.errors import StoreError

            self.calls[name] = self.calls.get(name, 0) + 1
            if self.failing and name != "close":
                raise StoreError(f"{name}: store is failing (FlakyStore)")
            return await target(*args, **kwargs)

        return call

    def __repr__(self) -> str:
        return f"<FlakyStore failing={self.failing} inner={self.inner!r}>"


class FakeSocket:
    """An ``asyncio.Transport`` stand-in for a protocol under test (the upstream client's
    ``transport.connection.Connection``, say): it records what the protocol writes and
    whether it paused reading, closed or aborted; the test plays the peer by calling the
    protocol's ``data_received`` / ``eof_received`` / ``connection_lost`` itself."""

    def __init__(self) -> None:
        self.written = bytearray()
        self.reading = True
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.written += data

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.written += part

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = self.aborted = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def __repr__(self) -> str:
        state = "aborted" if self.aborted else "closed" if self.closed else "open"
        return f"<FakeSocket {state} written={len(self.written)} reading={self.reading}>"


__getattr__ = exports(__name__, {"Pipeline": "harness"})  # the whole app: only when asked for
