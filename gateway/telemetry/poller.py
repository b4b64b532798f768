"""Per-backend telemetry polling: the settings, the source they name, and the polling task.

One ``TelemetryPoller`` per backend reads its source every ``interval_ms`` and hands each
sample to the backend's ``Telemetry``.  It never dies of a failed read: it counts the error and
tries again next tick, while the signals go unknown once the last sample is stale.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

import aiohttp

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.telemetry.nvml import NvmlSource
from gateway.telemetry.prometheus import PrometheusSource, Selector
from gateway.telemetry.signals import Sample, Telemetry

log = logging.getLogger(__name__)


SourceKind = Literal["prometheus", "nvml", "none"]


class TelemetrySettings(Protocol):
    """Where a backend's telemetry comes from: a policy's ``backends.<name>.telemetry``
    (``gateway.policy.model.TelemetrySource``, whose checks hold: a prometheus source has a
    url, ``interval_ms`` is at least 50).

    ``url`` is scraped for ``prometheus`` (``extra_urls`` too: a DCGM exporter and the model
    server's own ``/metrics`` side by side); ``index`` picks the GPU for ``nvml``; ``gpu``
    picks one GPU's series from a multi-GPU exporter by its ``gpu`` or ``UUID`` label, and
    ``gpu_instance`` one MIG instance; ``select`` are label matchers every GPU series must
    meet.  ``fail_closed`` makes rules treat unknown signals as firing.
    """

    @property
    def source(self) -> SourceKind: ...
    @property
    def url(self) -> str: ...
    @property
    def extra_urls(self) -> tuple[str, ...]: ...
    @property
    def index(self) -> int: ...
    @property
    def gpu(self) -> str | None: ...
    @property
    def gpu_instance(self) -> str | None: ...
    @property
    def select(self) -> tuple[tuple[str, str], ...]: ...
    @property
    def interval_ms(self) -> int: ...
    @property
    def fail_closed(self) -> bool: ...


class Source(Protocol):
    """A telemetry source: one ``read`` per tick, ``aclose`` when the poller stops."""

    async def read(self) -> Sample: ...

    async def aclose(self) -> None: ...


def make_source(
    config: TelemetrySettings,
    *,
    session: aiohttp.ClientSession | None = None,
    nvml: Any = None,
    clock: Clock = SYSTEM_CLOCK,
    name: str = "",
) -> Source | None:
    """The source ``config`` names, or None for ``none``."""
    if config.source == "prometheus":
        if session is None:
            raise ValueError("the prometheus source needs an aiohttp session")
        return PrometheusSource(
            (config.url, *config.extra_urls),
            session,
            select=Selector(config.select, config.gpu, config.gpu_instance),
            name=name,
            timeout_ms=config.interval_ms,
            clock=clock,
        )
    if config.source == "nvml":
        return NvmlSource(config.index, nvml=nvml, clock=clock)
    return None


def telemetry_for(
    backend: str, config: TelemetrySettings, clock: Clock = SYSTEM_CLOCK
) -> Telemetry:
    """The ``Telemetry`` holder ``config`` implies for ``backend``."""
    return Telemetry(backend, config.interval_ms, fail_closed=config.fail_closed, clock=clock)


Sleep = Callable[[float], Awaitable[Any]]


class TelemetryPoller:
    """Reads ``source`` into ``telemetry`` every ``telemetry.interval_s`` until stopped.

    Ticks are on a fixed schedule; a slow read skips the ticks it overran rather than bunching
    reads up.  A read longer than one interval is abandoned and counted as an error.
    ``on_sample`` runs after each good sample (the lead hooks throttle evaluation and metrics
    there).  ``sleep`` is injected so tests drive ticks with a fake clock.
    """

    def __init__(
        self,
        telemetry: Telemetry,
        source: Source,
        *,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Sleep = asyncio.sleep,
        on_sample: Callable[[Telemetry], None] | None = None,
    ) -> None:
        self.telemetry = telemetry
        self.source = source
        self.errors = 0
        self.last_error: BaseException | None = None
        self.on_sample = on_sample
        self._clock = clock
        self._sleep = sleep
        self._task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    def start(self) -> None:
        """Start polling in a task of the running loop; idempotent."""
        if not self.running:
            name = f"telemetry-{self.telemetry.backend}"
            self._task = asyncio.get_running_loop().create_task(self._run(), name=name)

    async def stop(self) -> None:
        """Stop polling and close the source."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.source.aclose()

    async def poll_once(self) -> bool:
        """Take one reading now; True when it produced a sample."""
        try:
            async with asyncio.timeout(self.telemetry.interval_s):
                sample = await self.source.read()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # survive anything a source throws; count it
            self.errors += 1
            if self.last_error is None or type(exc) is not type(self.last_error):
                log.warning("telemetry for %s failed: %r", self.telemetry.backend, exc)
            self.last_error = exc
            return False
        self.last_error = None
        self.telemetry.update(sample)
        if self.on_sample is not None:
            try:
                self.on_sample(self.telemetry)
            except Exception:
                log.exception("on_sample hook for %s failed", self.telemetry.backend)
        return True

    async def _run(self) -> None:
        interval = self.telemetry.interval_s
        next_tick = self._clock.now()
        while True:
            await self.poll_once()
            now = self._clock.now()
            next_tick += interval
            if next_tick <= now:
                next_tick += interval * ((now - next_tick) // interval + 1)
            await self._sleep(next_tick - now)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        age = self.telemetry.age_s
        shown = "never" if age is None else f"{age:.1f}s"
        return (
            f"<TelemetryPoller {self.telemetry.backend} {state} "
            f"every={self.telemetry.interval_s * 1000:.0f}ms samples={self.telemetry.samples} "
            f"errors={self.errors} age={shown}>"
        )
