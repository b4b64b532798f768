"""GPU telemetry at run time: a poller per backend, the throttle rules over its signals, and
the gauges they publish.

Everything here is long-lived and kept in the runtime's registry across reloads:

    TELEMETRY, backend     BackendTelemetry, rebuilt when the backend's telemetry changes
    TELEMETRY_HTTP, ""     the aiohttp session every prometheus source scrapes through
    GPU_CONTROL, ""        GpuControl: the Throttle (rule state survives reloads), the live
                           Telemetry of each backend, and what a new sample sets off

Pollers start with the gateway (``Registry.start``, called by ``Gateway.start`` and after a
reload) and stop when the registry closes them: on shutdown, or when a reload removes or
changes a backend's telemetry.  A clock that can ``sleep`` (``FakeClock``) also drives the
pollers' schedule, so tests move telemetry time by advancing the clock.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import aiohttp

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.policy.model import Policy, TelemetrySource
from gateway.resilience.throttle import Decision, Throttle, ThrottleTransition
from gateway.state import Kind, Registry
from gateway.telemetry import (
    Telemetry,
    TelemetryPoller,
    make_source,
    telemetry_for,
)
from gateway.telemetry.poller import Source
from gateway.transport.load import Fleet, FleetSource, templated

log = logging.getLogger("gateway.resilience.throttle")

GAUGE_OF_SIGNAL = {
    "gpu_temperature_c": "gpu_temperature",
    "gpu_memory_used_ratio": "gpu_memory_used",
    "gpu_utilization": "gpu_utilization",
    "gpu_power_ratio": "gpu_power",
    "gpu_thermal_throttling": "gpu_thermal_throttling",
    "kv_cache_usage": "kv_cache_usage",
    "gpu_slowdown_temperature_c": "gpu_slowdown_temperature",
}
"""Sample fields published as gauges, and the ``Metrics`` attribute of each."""
UNSEEN_AFTER_SAMPLES = 3
_COUNTERS_HINT = (
    " (the stock dcgm-exporter counters lack {}: run the exporter with "
    "deploy/k8s/dcgm-counters.csv)"
)
_HINTS = {
    "gpu_power_ratio": _COUNTERS_HINT.format("DCGM_FI_DEV_POWER_MGMT_LIMIT"),
    "gpu_thermal_throttling": _COUNTERS_HINT.format("DCGM_FI_DEV_CLOCKS_EVENT_REASONS"),
}
"""Samples after which a rule's signal that none of them had is reported as never seen."""


TELEMETRY: Kind[BackendTelemetry] = Kind("telemetry")
TELEMETRY_HTTP: Kind[TelemetryHttp] = Kind("telemetry_http")
GPU_CONTROL: Kind[GpuControl] = Kind("gpu_control")


class ThrottleTarget(Protocol):
    """What a throttle decision is applied to (a backend's guard)."""

    def apply(self, decision: Decision) -> None: ...


class TelemetryHttp:
    """The one aiohttp session the prometheus sources share, opened on first use."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Scrapes are few and small: a small pool, no cookies, no env proxies.
            connector = aiohttp.TCPConnector(limit=32, ttl_dns_cache=60)
            self._session = aiohttp.ClientSession(
                connector=connector, cookie_jar=aiohttp.DummyCookieJar()
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def __repr__(self) -> str:
        state = "open" if self._session is not None and not self._session.closed else "idle"
        return f"<TelemetryHttp {state}>"


class BackendTelemetry:
    """One backend's ``Telemetry`` and the poller that fills it (created on ``start``)."""

    def __init__(
        self,
        backend: str,
        config: TelemetrySource,
        *,
        http: TelemetryHttp | None,
        clock: Clock,
        on_sample: Callable[[Telemetry], None],
        source: Source | None = None,
    ) -> None:
        self.backend = backend
        self.config = config
        self._source = source
        self.telemetry = telemetry_for(backend, config, clock)
        self.poller: TelemetryPoller | None = None
        self._http = http
        self._clock = clock
        self._on_sample = on_sample
        self._closed = False

    def start(self) -> None:
        """Start polling (idempotent); the source is opened here, on the running loop."""
        if self._closed or (self.poller is not None and self.poller.running):
            return
        if self.poller is None:
            session = self._http.session() if self._http is not None else None
            source = self._source or make_source(
                self.config, session=session, clock=self._clock, name=self.backend
            )
            if source is None:
                return
            sleep = getattr(self._clock, "sleep", None) or asyncio.sleep
            self.poller = TelemetryPoller(
                self.telemetry, source, clock=self._clock, sleep=sleep, on_sample=self._on_sample
            )
        self.poller.start()

    async def aclose(self) -> None:
        self._closed = True
        if self.poller is not None:
            await self.poller.stop()

    def __repr__(self) -> str:
        return f"<BackendTelemetry {self.backend} {self.config.source} {self.poller!r}>"


class GpuControl:
    """The throttle over every backend's telemetry, and what a fresh sample sets off.

    ``telemetry`` and ``targets`` are replaced at each policy build; the ``Throttle`` (and so
    each rule's fired/cleared state) lives as long as the gateway.
    """

    def __init__(self, metrics: Metrics, clock: Clock) -> None:
        self._metrics = metrics
        self.telemetry: dict[str, Telemetry] = {}
        self.targets: Mapping[str, ThrottleTarget] = {}
        self.throttle = Throttle(telemetry=self.telemetry, clock=clock, on_transition=self._moved)
        self._warned: set[tuple[str, str]] = set()

    def sync(
        self,
        policy: Policy,
        telemetry: dict[str, Telemetry],
        targets: Mapping[str, ThrottleTarget],
    ) -> None:
        """Take a new policy generation's rules, telemetry and guards."""
        gone = set(self.telemetry) - set(telemetry)
        new = set(telemetry) - set(self.telemetry)
        self.telemetry.clear()
        self.telemetry.update(telemetry)
        self.targets = targets
        self.throttle.set_rules(policy.throttle)
        m = self._metrics
        m.throttle_threshold.clear()
        for rule in policy.throttle:
            when = rule.when
            for bound, value in (("above", when.above), ("clear_below", when.clear_below)):
                m.throttle_threshold.labels(rule.name, rule.backend, when.signal, bound).set(value)
        for backend in gone:
            for gauge in (*(getattr(m, g) for g in GAUGE_OF_SIGNAL.values()), m.telemetry_age):
                _remove(gauge, backend)
        for backend in new:
            m.telemetry_age.labels(backend).set_function(self._age_of(backend))
        for backend, target in targets.items():
            target.apply(self.throttle.decide(backend))

    def _age_of(self, backend: str) -> Callable[[], float]:
        def age() -> float:
            telemetry = self.telemetry.get(backend)
            value = telemetry.age_s if telemetry is not None else None
            return math.nan if value is None else value

        return age

    def decide(self, backend: str) -> Decision:
        return self.throttle.decide(backend)

    def on_sample(self, telemetry: Telemetry) -> None:
        """A poller's hook: publish the gauges, re-evaluate the rules, apply their limits."""
        if self.telemetry.get(telemetry.backend) is not telemetry:
            return  # a poller a reload has just replaced
        sample = telemetry.sample
        if sample is not None:
            for signal, gauge in GAUGE_OF_SIGNAL.items():
                value = getattr(sample, signal)
                if value is not None:
                    getattr(self._metrics, gauge).labels(telemetry.backend).set(value)
        self._check_signals(telemetry)
        decision = self.throttle.decide(telemetry.backend)
        target = self.targets.get(telemetry.backend)
        if target is not None:
            target.apply(decision)

    def _check_signals(self, telemetry: Telemetry) -> None:
        """Say (a metric; a warning once) when a rule's signal has never been read."""
        if telemetry.samples < UNSEEN_AFTER_SAMPLES:
            return
        for rule in self.throttle.rules:
            if rule.backend != telemetry.backend:
                continue
            seen = rule.when.signal in telemetry.seen
            self._metrics.throttle_signal_seen.labels(rule.name, rule.backend).set(int(seen))
            if not seen and (rule.name, rule.backend) not in self._warned:
                self._warned.add((rule.name, rule.backend))
                log.warning(
                    "throttle rule %r on backend %s reads %s, which its telemetry has not "
                    "reported in %d samples: the rule cannot fire%s",
                    rule.name,
                    rule.backend,
                    rule.when.signal,
                    telemetry.samples,
                    _HINTS.get(rule.when.signal, ""),
                )

    def signal_status(self) -> list[dict[str, str]]:
        """Each rule's signal: ``seen``, ``unknown`` (never read in the samples so far), or
        ``waiting`` (too few samples yet) (for ``GET /policy``)."""
        out = []
        for rule in self.throttle.rules:
            telemetry = self.telemetry.get(rule.backend)
            if telemetry is not None and rule.when.signal in telemetry.seen:
                status = "seen"
            elif telemetry is not None and telemetry.samples >= UNSEEN_AFTER_SAMPLES:
                status = "unknown"
            else:
                status = "waiting"
            out.append(
                {
                    "rule": rule.name,
                    "backend": rule.backend,
                    "signal": rule.when.signal,
                    "status": status,
                }
            )
        return out

    def _moved(self, t: ThrottleTransition) -> None:
        m = self._metrics
        m.throttle_active.labels(t.rule, t.backend).set(1 if t.active else 0)
        m.throttle_transitions.labels(t.rule, t.backend).inc()

    def __repr__(self) -> str:
        return f"<GpuControl telemetry={sorted(self.telemetry)} {self.throttle!r}>"


def wire_gpu(
    policy: Policy,
    registry: Registry,
    metrics: Metrics,
    clock: Clock,
    targets: Mapping[str, ThrottleTarget],
    fleet: Callable[[str], Fleet | None] | None = None,
) -> GpuControl:
    """The telemetry and throttle state for ``policy``, taken from (or added to) ``registry``.

    A backend whose telemetry is per endpoint (``{host}`` in its URL) reads its endpoints'
    coolest signals (``FleetSource``) from ``fleet(name)``, its live endpoint set (none
    given: the real transport is not in use, and that backend has no telemetry)."""
    control = registry.get(GPU_CONTROL, "", None, lambda: GpuControl(metrics, clock))
    telemetry: dict[str, Telemetry] = {}
    http: TelemetryHttp | None = None
    for backend in policy.backends:
        if backend.telemetry.source == "none":
            continue
        config = backend.telemetry
        per_endpoint = templated(backend)
        if per_endpoint and fleet is None:
            continue
        if config.source == "prometheus" and http is None and not per_endpoint:
            http = registry.get(TELEMETRY_HTTP, "", None, TelemetryHttp)
        source = (
            FleetSource(functools.partial(fleet, backend.name)) if fleet and per_endpoint else None
        )
        item = registry.get(
            TELEMETRY,
            backend.name,
            config,
            _factory(backend.name, config, http, clock, control.on_sample, source),
        )
        telemetry[backend.name] = item.telemetry
    control.sync(policy, telemetry, targets)
    return control


def _factory(
    backend: str,
    config: TelemetrySource,
    http: TelemetryHttp | None,
    clock: Clock,
    on_sample: Callable[[Telemetry], None],
    source: Source | None,
) -> Callable[[], BackendTelemetry]:
    def make() -> BackendTelemetry:
        return BackendTelemetry(
            backend, config, http=http, clock=clock, on_sample=on_sample, source=source
        )

    return make


def batch_limit(registry: Registry, backend: str) -> int | None:
    """The batch size a ``limit`` throttle rule holds ``backend`` to now, or None.

    For the batching stage: read per batch, it costs a dictionary lookup while the
    backend's telemetry has not moved."""
    control = registry.peek(GPU_CONTROL)
    if control is None:
        return None
    limit = control.decide(backend).limit
    return None if limit is None else limit.batch_max_size


def _remove(gauge: Any, backend: str) -> None:
    try:
        gauge.remove(backend)
    except KeyError:
        pass
