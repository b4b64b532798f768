"""The ``prometheus`` telemetry source: scrape DCGM exporter and model-server metrics.

In Kubernetes a sidecar without its own GPU request cannot open the GPU with NVML, so it reads
the DCGM exporter (``DCGM_FI_DEV_*``, or the old namespace's ``dcgm_*`` with a lower-case
``uuid``) and the model server's own ``/metrics`` (vLLM, TGI, llama.cpp's ``llama-server
--metrics``).  Only the few series that map
to a signal are parsed; the rest of a large exposition is skipped by name without parsing
labels.

A GPU series belongs to one device: its ``gpu`` index or UUID, and with MIG its instance
(``GPU_I_ID``, ``GPU_I_PROFILE``), so two MIG instances of one GPU are two devices, never
one series overwriting the other.  A ``Selector`` keeps only the devices a backend uses: label
matchers (``{pod: ..., namespace: ...}`` on a node-wide exporter that maps devices to pods)
and the ``gpu`` / ``gpu_instance`` shorthands.  With several devices left, each signal takes
the largest value: the hottest, fullest GPU wins (and the source says so once, in a
warning).  Queue lengths and running requests are summed over series (one per model or
engine); KV-cache use takes the largest.

llama.cpp's server has one queue (``llamacpp:requests_deferred``: requests waiting for a
free slot) and its busy slots (``llamacpp:requests_processing``); this build exports no
KV-cache gauge (older ones had ``llamacpp:kv_cache_usage_ratio``, read when present).  Its
``n_busy_slots_per_decode`` is an average since the server started and its token
throughputs are averaged between two scrapes (each scrape restarts them), so neither is a
signal of the load now; they are not read.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import aiohttp

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import TelemetryError
from gateway.telemetry.signals import Sample

log = logging.getLogger("gateway.telemetry")

DEFAULT_TIMEOUT_MS = 1000

GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
MEMORY_TEMP = "DCGM_FI_DEV_MEMORY_TEMP"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
FB_TOTAL = "DCGM_FI_DEV_FB_TOTAL"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
POWER_USAGE = "DCGM_FI_DEV_POWER_USAGE"
POWER_LIMITS = ("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_POWER_MGMT_LIMIT")
CLOCK_REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
QUEUE_WAITING = ("vllm:num_requests_waiting", "tgi_queue_size", "llamacpp:requests_deferred")
RUNNING = ("vllm:num_requests_running", "tgi_batch_current_size", "llamacpp:requests_processing")
KV_CACHE = (
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "llamacpp:kv_cache_usage_ratio",
)

OLD_NAMESPACE = {
    "dcgm_gpu_temp": GPU_TEMP,
    "dcgm_memory_temp": MEMORY_TEMP,
    "dcgm_fb_used": FB_USED,
    "dcgm_fb_free": FB_FREE,
    "dcgm_fb_resv": FB_RESERVED,
    "dcgm_fb_total": FB_TOTAL,
    "dcgm_gpu_utilization": GPU_UTIL,
    "dcgm_power_usage": POWER_USAGE,
    "dcgm_enforced_power_limit": POWER_LIMITS[0],
    "dcgm_power_management_limit": POWER_LIMITS[1],
    "dcgm_clocks_event_reasons": CLOCK_REASONS[0],
    "dcgm_clock_throttle_reasons": CLOCK_REASONS[1],
}
"""dcgm-exporter's ``--use-old-namespace`` names: ``dcgm_`` and DCGM's field tag."""
DEVICE_LABELS = ("gpu", "UUID", "uuid", "GPU_I_ID", "GPU_I_PROFILE")
"""The labels that tell one GPU (or MIG instance) from another."""

THERMAL_REASONS = 0x08 | 0x20 | 0x40
"""Clock-event bits that mean heat: HW slowdown, SW thermal, HW thermal."""

WANTED = frozenset(
    (
        *(GPU_TEMP, MEMORY_TEMP, GPU_UTIL, POWER_USAGE),
        *(FB_USED, FB_FREE, FB_RESERVED, FB_TOTAL),
        *POWER_LIMITS,
        *CLOCK_REASONS,
        *QUEUE_WAITING,
        *RUNNING,
        *KV_CACHE,
        *OLD_NAMESPACE,
    )
)

_ESCAPE = re.compile(r"\\(.)")
_ESCAPES = {"n": "\n"}
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


@dataclass(frozen=True, slots=True)
class Series:
    """One line of an exposition: a metric name, its labels and its value."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        for k, v in self.labels:
            if k == key:
                return v
        return None


def parse_exposition(text: str, names: frozenset[str] = WANTED) -> list[Series]:
    """The series in Prometheus text ``text`` whose metric name is in ``names``.

    Handles labels with escaped quotes, an optional trailing timestamp, and NaN/Inf values.
    Lines it cannot read are skipped: one odd line must not blind the whole source.
    """
    found: list[Series] = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            if name not in names:
                continue
            end = line.rfind("}")
            if end < brace:
                continue
            labels = tuple(
                (k, _unescape(v) if "\\" in v else v)
                for k, v in _LABEL.findall(line, brace + 1, end)
            )
            rest = line[end + 1 :]
        else:
            name = line[:space] if space != -1 else line
            if name not in names:
                continue
            labels = ()
            rest = line[space:] if space != -1 else ""
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        found.append(Series(name, labels, value))
    return found


def _unescape(value: str) -> str:
    return _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), m.group(1)), value)


@dataclass(frozen=True, slots=True)
class Selector:
    """Which GPU series a backend reads: every ``labels`` matcher equal, ``gpu`` the series'
    ``gpu`` index or UUID, ``gpu_instance`` its MIG ``GPU_I_ID``.  Empty: every device."""

    labels: tuple[tuple[str, str], ...] = ()
    gpu: str | None = None
    gpu_instance: str | None = None

    @property
    def empty(self) -> bool:
        return not self.labels and self.gpu is None and self.gpu_instance is None

    def matches(self, s: Series) -> bool:
        for key, value in self.labels:
            if s.label(key) != value:
                return False
        if self.gpu is not None and self.gpu not in (s.label("gpu"), _uuid(s)):
            return False
        return self.gpu_instance is None or s.label("GPU_I_ID") == self.gpu_instance


@dataclass(frozen=True, slots=True)
class Reading:
    """What one scrape says: the signals, and how many GPU devices they came from."""

    signals: dict[str, float]
    devices: tuple[tuple[tuple[str, str], ...], ...]


def signals_from(
    series: Iterable[Series], select: Selector | str | None = None
) -> dict[str, float]:
    """Map parsed series to signal values (see the module docstring for the rules)."""
    return read_series(series, select).signals


def read_series(series: Iterable[Series], select: Selector | str | None = None) -> Reading:
    """The signals of ``series`` and the devices they came from."""
    if not isinstance(select, Selector):
        select = Selector(gpu=select)
    per_device: dict[tuple[tuple[str, str], ...], dict[str, float]] = {}
    server: dict[str, list[float]] = {}
    for s in series:
        name = OLD_NAMESPACE.get(s.name, s.name)
        if name.startswith("DCGM_"):
            if not select.matches(s):
                continue
            if not math.isnan(s.value):
                per_device.setdefault(_device(s), {})[name] = s.value
        elif not math.isnan(s.value):
            server.setdefault(name, []).append(s.value)

    values: dict[str, list[float]] = {}
    for fields in per_device.values():
        for signal, value in _gpu_signals(fields).items():
            values.setdefault(signal, []).append(value)
    out = {signal: max(vs) for signal, vs in values.items()}

    for signal, names in (("queue_waiting", QUEUE_WAITING), ("requests_running", RUNNING)):
        for name in names:
            if name in server:
                out[signal] = sum(server[name])
                break
    for name in KV_CACHE:
        if name in server:
            out["kv_cache_usage"] = max(server[name])
            break
    return Reading(out, tuple(per_device))


def _uuid(s: Series) -> str | None:
    return s.label("UUID") or s.label("uuid")


def _device(s: Series) -> tuple[tuple[str, str], ...]:
    return tuple((k, v) for k in DEVICE_LABELS if (v := s.label(k)) is not None)


def _gpu_signals(f: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    if GPU_TEMP in f:
        out["gpu_temperature_c"] = f[GPU_TEMP]
    if f.get(MEMORY_TEMP):  # boards without a memory sensor export 0
        out["gpu_memory_temperature_c"] = f[MEMORY_TEMP]
    if FB_USED in f:
        used = f[FB_USED]
        if FB_TOTAL in f:
            total = f[FB_TOTAL]
        elif FB_FREE in f:
            total = used + f[FB_FREE] + f.get(FB_RESERVED, 0.0)
        else:
            total = 0.0
        if total > 0:
            out["gpu_memory_used_ratio"] = used / total
    if GPU_UTIL in f:
        out["gpu_utilization"] = f[GPU_UTIL] / 100
    limit = next((f[n] for n in POWER_LIMITS if f.get(n, 0) > 0), None)
    if POWER_USAGE in f and limit is not None:
        out["gpu_power_ratio"] = f[POWER_USAGE] / limit
    reasons = next((f[n] for n in CLOCK_REASONS if n in f), None)
    if reasons is not None:
        out["gpu_thermal_throttling"] = 1.0 if int(reasons) & THERMAL_REASONS else 0.0
    return out


class PrometheusSource:
    """Scrapes one or more metrics URLs and reduces them to one ``Sample``.

    The aiohttp session belongs to the caller (one per app).  A URL that fails makes its
    signals unknown for this sample; only when every URL fails does ``read`` raise
    ``TelemetryError``.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        session: aiohttp.ClientSession,
        *,
        gpu: str | None = None,
        select: Selector | None = None,
        name: str = "",
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.urls = (urls,) if isinstance(urls, str) else tuple(urls)
        if not self.urls:
            raise ValueError("the prometheus source needs at least one url")
        self.select = select if select is not None else Selector(gpu=gpu)
        self.name = name
        self._warned = False
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_ms / 1000)
        self._clock = clock
        self.last_errors: tuple[str, ...] = ()

    async def read(self) -> Sample:
        texts = await asyncio.gather(*(self._fetch(u) for u in self.urls), return_exceptions=True)
        errors = [t for t in texts if isinstance(t, BaseException)]
        self.last_errors = tuple(str(e) for e in errors)
        if len(errors) == len(texts):
            raise errors[0]
        series = [s for t in texts if isinstance(t, str) for s in parse_exposition(t)]
        reading = read_series(series, self.select)
        if len(reading.devices) > 1 and self.select.empty and not self._warned:
            self._warned = True
            log.warning(
                "telemetry of %s sees %d GPUs (%s) and telemetry.select names none: each "
                "signal takes the largest value, so the hottest GPU of the node wins; select "
                "this pod's with {pod: ${POD_NAME}, namespace: ${POD_NAMESPACE}} or `gpu`",
                self.name or " ".join(self.urls),
                len(reading.devices),
                "; ".join(",".join(f"{k}={v}" for k, v in d) for d in reading.devices[:4]),
            )
        return Sample(at=self._clock.now(), **reading.signals)

    async def _fetch(self, url: str) -> str:
        try:
            async with self._session.get(url, timeout=self._timeout) as resp:
                if resp.status != 200:
                    raise TelemetryError(f"scrape of {url} answered {resp.status}")
                return await resp.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
            raise TelemetryError(f"scrape of {url} failed: {exc!r}") from exc

    async def aclose(self) -> None:
        """Nothing to release: the session is the caller's."""

    def __repr__(self) -> str:
        failing = f" failing={len(self.last_errors)}" if self.last_errors else ""
        return f"<PrometheusSource {' '.join(self.urls)}{failing}>"
