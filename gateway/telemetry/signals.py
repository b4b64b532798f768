"""The normalised GPU and model-server signals, one sample of them, and a backend's latest.

Every source (NVML, a Prometheus scrape) reduces what it reads to the same few signals, so
throttle rules never care where a number came from.  A signal is *unknown* (None) when the
source could not read it, before the first sample, and when telemetry is stale: no fresh
sample for ``STALE_INTERVALS`` polling intervals.

vLLM pre-allocates about 90% of VRAM at start (``gpu_memory_utilization``), so for a vLLM
backend ``gpu_memory_used_ratio`` is always high and says nothing about load: use
``kv_cache_usage`` (and ``queue_waiting``) there.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, get_args

from gateway.clock import SYSTEM_CLOCK, Clock

Signal = Literal[
    "gpu_temperature_c",
    "gpu_memory_temperature_c",
    "gpu_memory_used_ratio",
    "gpu_utilization",
    "gpu_power_ratio",
    "gpu_thermal_throttling",
    "kv_cache_usage",
    "queue_waiting",
    "requests_running",
]
SIGNALS: tuple[Signal, ...] = get_args(Signal)
"""Every signal name a throttle rule may name, in a stable order."""

STALE_INTERVALS = 3
"""Telemetry older than this many polling intervals is stale: every signal reads unknown."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One reading of a backend's GPU and server, taken at ``at`` (clock seconds).

    Ratios are 0..1; ``gpu_thermal_throttling`` is 1.0 while the GPU slows its clocks for heat
    and 0.0 otherwise.  The slowdown and shutdown temperatures are the device's own limits
    (NVML only), shown next to the temperature so an operator can pick thresholds.
    """

    at: float
    gpu_temperature_c: float | None = None
    gpu_memory_temperature_c: float | None = None
    gpu_memory_used_ratio: float | None = None
    gpu_utilization: float | None = None
    gpu_power_ratio: float | None = None
    gpu_thermal_throttling: float | None = None
    kv_cache_usage: float | None = None
    queue_waiting: float | None = None
    requests_running: float | None = None
    gpu_slowdown_temperature_c: float | None = None
    gpu_shutdown_temperature_c: float | None = None

    def value(self, signal: Signal) -> float | None:
        """The value of ``signal`` in this sample, None when the source could not read it."""
        if signal not in SIGNALS:
            raise ValueError(f"unknown signal {signal!r}; known: {', '.join(SIGNALS)}")
        value: float | None = getattr(self, signal)
        return value

    def known(self) -> dict[str, float]:
        """Every field that has a value, by name (for logs and the admin view)."""
        return {
            f.name: v
            for f in fields(self)
            if f.name != "at" and (v := getattr(self, f.name)) is not None
        }


class Telemetry:
    """A backend's latest sample, and whether it is fresh enough to act on.

    The poller calls ``update``; throttle rules call ``value`` on every request, so it is a
    clock read and an attribute lookup.  ``fail_closed`` says how rules treat an unknown
    signal on this backend (see ``gateway.resilience.throttle``).
    """

    __slots__ = ("_clock", "_sample", "backend", "fail_closed", "interval_s", "samples", "seen")

    def __init__(
        self,
        backend: str,
        interval_ms: int = 1000,
        *,
        fail_closed: bool = False,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if interval_ms <= 0:
            raise ValueError("interval_ms must be positive")
        self.backend = backend
        self.interval_s = interval_ms / 1000
        self.fail_closed = fail_closed
        self.samples = 0
        self.seen: set[str] = set()
        """Every signal any sample so far has had a value for."""
        self._clock = clock
        self._sample: Sample | None = None

    def update(self, sample: Sample) -> None:
        """Make ``sample`` the latest."""
        self._sample = sample
        self.samples += 1
        self.seen.update(sample.known())

    @property
    def sample(self) -> Sample | None:
        """The latest sample, fresh or not; None before the first."""
        return self._sample

    @property
    def age_s(self) -> float | None:
        """Seconds since the latest sample was taken; None before the first."""
        if self._sample is None:
            return None
        return max(0.0, self._clock.now() - self._sample.at)

    @property
    def stale(self) -> bool:
        """True before the first sample and when none came for ``STALE_INTERVALS`` intervals."""
        age = self.age_s
        return age is None or age > STALE_INTERVALS * self.interval_s

    def current(self) -> Sample | None:
        """The latest sample if it is fresh, else None."""
        return None if self.stale else self._sample

    def value(self, signal: Signal) -> float | None:
        """The current value of ``signal``; None when unknown (unread, no sample, or stale)."""
        sample = self.current()
        return None if sample is None else sample.value(signal)

    def __repr__(self) -> str:
        age = self.age_s
        shown = "never" if age is None else f"{age:.1f}s"
        state = " stale" if self.stale else ""
        return f"<Telemetry {self.backend} age={shown}{state} samples={self.samples}>"
