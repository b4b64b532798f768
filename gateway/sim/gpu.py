"""The modelled GPU: what a call costs, and how load turns into heat, power and VRAM.

``GpuModel`` is pure bookkeeping on an injected clock: the server tells it when calls queue,
start and finish, and it integrates utilisation and temperature exactly between those
events (both are piecewise constant in the busy fraction, so the first-order lags have
closed forms).  Tests drive it with ``FakeClock`` and read minutes of heating in microseconds.

    utilisation   busy fraction of the slots, averaged with time constant util_window_s
    temperature   dT/dt = (T_ss - T) / (thermal_tau_s / time_scale),
                  T_ss = ambient_c + busy * (max_steady_c - ambient_c)
    memory temp   temperature + memory_offset_c
    VRAM used     weights_ratio + kv_usage * kv_pool_ratio,
                  kv_usage = min(1, admitted items / kv_capacity_items)
    power         power_idle_w + utilisation * (power_max_w - power_idle_w), capped at the limit
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.clock import Clock
from gateway.sim.config import SimConfig


def call_cost_ms(config: SimConfig, items: int, tokens: int = 0) -> float:
    """Modelled time a call with ``items`` inputs holds its slot, decoding ``tokens`` steps."""
    return prefill_ms(config, items) + tokens * config.token_ms


def prefill_ms(config: SimConfig, items: int) -> float:
    """Time before the first token: the fixed cost, the per-item cost and injected latency."""
    return config.base_ms + items * config.per_item_ms + config.added_latency_ms


@dataclass(frozen=True, slots=True)
class GpuState:
    """The modelled GPU at one instant."""

    temperature_c: float
    memory_temperature_c: float
    peak_temperature_c: float
    utilization: float
    busy_fraction: float
    vram_used_ratio: float
    vram_used_mib: float
    vram_free_mib: float
    kv_cache_usage: float
    power_w: float
    power_limit_w: float
    running: int
    waiting: int
    running_items: int
    waiting_items: int


class GpuModel:
    """Temperature, utilisation, power and memory of one simulated GPU."""

    def __init__(self, config: SimConfig, clock: Clock) -> None:
        self._config = config
        self._clock = clock
        self._last = clock.now()
        self._temperature_c = config.ambient_c
        self._peak_c = config.ambient_c
        self._utilization = 0.0
        self.running = 0
        self.waiting = 0
        self.running_items = 0
        self.waiting_items = 0

    @property
    def config(self) -> SimConfig:
        return self._config

    @config.setter
    def config(self, config: SimConfig) -> None:
        # The old parameters govern the time that has already passed.
        self.step()
        self._config = config

    def queued(self, items: int) -> None:
        """A call with ``items`` inputs waits for a slot."""
        self.step()
        self.waiting += 1
        self.waiting_items += items

    def dequeued(self, items: int) -> None:
        """A waiting call left the queue (it got a slot or gave up)."""
        self.step()
        self.waiting -= 1
        self.waiting_items -= items

    def started(self, items: int) -> None:
        """A call with ``items`` inputs took a slot."""
        self.step()
        self.running += 1
        self.running_items += items

    def finished(self, items: int) -> None:
        """A running call gave its slot back."""
        self.step()
        self.running -= 1
        self.running_items -= items

    def reset_peak(self) -> None:
        """Forget the peak temperature seen so far."""
        self.step()
        self._peak_c = self._temperature_c

    @property
    def busy_fraction(self) -> float:
        """Share of the slots in use right now."""
        return min(1.0, self.running / self._config.slots)

    def step(self) -> None:
        """Integrate utilisation and temperature from the last event up to now."""
        now = self._clock.now()
        dt = now - self._last
        if dt <= 0:
            return
        self._last = now
        c = self._config
        busy = self.busy_fraction
        self._utilization = _approach(self._utilization, busy, dt / c.util_window_s)
        steady = c.ambient_c + busy * (c.max_steady_c - c.ambient_c)
        self._temperature_c = _approach(
            self._temperature_c, steady, dt * c.time_scale / c.thermal_tau_s
        )
        self._peak_c = max(self._peak_c, self._temperature_c)

    def state(self) -> GpuState:
        """The GPU as of now."""
        self.step()
        c = self._config
        held = (self.running_items + self.waiting_items) / c.kv_capacity_items
        kv_usage = min(1.0, c.kv_reserved_ratio + held)
        used_ratio = c.weights_ratio + kv_usage * c.kv_pool_ratio
        used_mib = used_ratio * c.vram_total_mib
        power = c.power_idle_w + self._utilization * (c.power_max_w - c.power_idle_w)
        return GpuState(
            temperature_c=self._temperature_c,
            memory_temperature_c=self._temperature_c + c.memory_offset_c,
            peak_temperature_c=self._peak_c,
            utilization=self._utilization,
            busy_fraction=self.busy_fraction,
            vram_used_ratio=used_ratio,
            vram_used_mib=used_mib,
            vram_free_mib=c.vram_total_mib - used_mib,
            kv_cache_usage=kv_usage,
            power_w=min(power, c.power_limit_w),
            power_limit_w=c.power_limit_w,
            running=self.running,
            waiting=self.waiting,
            running_items=self.running_items,
            waiting_items=self.waiting_items,
        )

    def __repr__(self) -> str:
        self.step()
        return (
            f"<GpuModel temp={self._temperature_c:.1f}C util={self._utilization:.0%} "
            f"running={self.running} waiting={self.waiting}>"
        )


def _approach(value: float, target: float, time_constants: float) -> float:
    """Where a first-order lag from ``value`` toward ``target`` is after ``time_constants``."""
    return target + (value - target) * math.exp(-time_constants)
