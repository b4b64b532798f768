"""Per-endpoint load and telemetry, from each model server's own ``/metrics``.

vLLM exports ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (TGI
``tgi_queue_size``); the Kubernetes Gateway API inference extension and llm-d filter out a
pod whose queue is over 5 or whose KV cache is over 80% full, and score the rest by queue
and KV use.  So does ``kv_aware``: ``watch`` scrapes ``<endpoint>/metrics`` every
``telemetry.interval_ms`` over the endpoint's own pool, ``saturated`` says whether an
endpoint is over either limit, and ``score`` orders the rest (requests in flight here plus
the server's queue, plus four for a full KV cache).  An endpoint whose scrape fails, or whose
figures cannot be true (not finite, negative, a KV share over 1), has no load figures: it is
treated as unsaturated and scored by its requests in flight alone.  A scrape is an ordinary
exchange over the endpoint's pool, so its answer is bounded like any other's.

With ``{host}`` or ``{port}`` in the backend's ``telemetry.url`` (and ``extra_urls``), each
endpoint is scraped at those URLs, its own host and port put in (a DCGM exporter on the
node, the server's metrics on another port: over a pool of the endpoint's own to that
address), for any ``balance``: each endpoint has its own signals, the backend's throttle
rules are judged on each endpoint's with their hysteresis (``judge``: a firing rule takes
the endpoint out of rotation while another is not throttled), and ``FleetSource`` gives the
backend's telemetry the coolest endpoint's signals (each signal's least value over the
endpoints), so a rule acts on the whole backend (reroute, shed, limit) only when every
endpoint is over it.  An endpoint whose scrape fails has no signals: no rule fires on it
(fail open, like the backend-wide telemetry by default).

LoRA adapters: vLLM serving adapters exports ``vllm:lora_requests_info`` (its labels name
the adapters of the requests running and waiting, and ``max_lora``, how many it can hold at
once; its value is when it was set, so the latest of its series is the truth) and names its
base model in every series' ``model_name``.  With ``kv_aware``, a request for an adapter
goes to an unsaturated server already serving it, else to one with room for another adapter
(``for_model``), as the inference extension's LoRA affinity does: a server that must swap
adapters in and out of GPU memory stalls its batch each time.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from gateway.errors import TelemetryError, UpstreamError
from gateway.policy.model import Backend, ThrottleRule
from gateway.telemetry.prometheus import (
    QUEUE_WAITING,
    WANTED,
    Selector,
    Series,
    parse_exposition,
    read_series,
)
from gateway.telemetry.signals import Sample
from gateway.transport.upstream import BackendPool


@dataclass(frozen=True, slots=True)
class Adapters:
    """What a vLLM server says of its LoRA adapters: the base model it serves (``model_name``),
    the adapters of the requests it is running or queueing, and how many it holds at once;
    and what the gateway makes of it: the adapters it holds in GPU memory (``resident``,
    most recent first: those it serves now, then those it served before, up to ``most``).
    vLLM keeps the ``max_lora`` adapters used last and evicts the least recently used, but
    says only which its requests in flight use: an adapter between two requests is still
    there, and a request for it belongs there."""

    base: str | None
    serving: frozenset[str]
    most: int | None
    resident: tuple[str, ...] = ()

    @property
    def room(self) -> bool:
        """Whether it can take another adapter without evicting one."""
        return self.most is None or len(self.resident or self.serving) < self.most

    def holds(self, adapter: str) -> bool:
        return adapter in self.serving or adapter in self.resident


class Endpoint(Protocol):
    """What the load figures need of an endpoint (``endpoints.Endpoint``)."""

    url: str
    pool: BackendPool
    queue_waiting: float | None
    kv_cache_usage: float | None
    adapters: Adapters | None
    signals: dict[str, float]
    throttled: set[str]

    @property
    def inflight(self) -> int: ...

    def pool_to(self, url: str) -> tuple[BackendPool, str]: ...


log = logging.getLogger("gateway.transport")

KV_WEIGHT = 4.0
METRICS_PATH = "/metrics"
LORA_INFO = "vllm:lora_requests_info"
_READ = WANTED | {LORA_INFO}
_LIMITS = {"kv_cache_usage": 1.0, "gpu_memory_used_ratio": 1.0, "gpu_utilization": 1.0}
"""Signals that are shares: over 1 they cannot be true."""


def templated(backend: Backend) -> bool:
    """Whether the backend's telemetry is per endpoint (``{host}``/``{port}`` in its URL)."""
    t = backend.telemetry
    return t.source == "prometheus" and any(
        "{host}" in u or "{port}" in u for u in (t.url, *t.extra_urls)
    )


def scrape_urls(endpoint_url: str, backend: Backend) -> tuple[str, ...]:
    """Where one endpoint's figures are read: its telemetry URLs, or ``<endpoint>/metrics``."""
    if not templated(backend):
        return (endpoint_url + METRICS_PATH,)
    parts = urlsplit(endpoint_url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host
    port = parts.port or (443 if parts.scheme == "https" else 80)
    t = backend.telemetry
    return tuple(u.format(host=host, port=port) for u in (t.url, *t.extra_urls))


def saturated(endpoint: Endpoint, backend: Backend) -> bool:
    queue, kv, limit = endpoint.queue_waiting, endpoint.kv_cache_usage, backend.saturation
    return (queue is not None and queue > limit.queue_waiting) or (
        kv is not None and kv > limit.kv_cache_usage
    )


def score(endpoint: Endpoint) -> float:
    return (
        endpoint.inflight
        + (endpoint.queue_waiting or 0.0)
        + KV_WEIGHT * (endpoint.kv_cache_usage or 0.0)
    )


async def scrape(endpoint: Endpoint, backend: Backend) -> None:
    """Read one endpoint's figures (none when every scrape of it fails).  Each scrape has one
    ``telemetry.interval_ms``: a server that accepts and never answers costs one round its
    figures, not the backend's whole ``timeout_s`` of stale ones."""
    t = backend.telemetry
    texts = []
    for url in scrape_urls(endpoint.url, backend):
        pool, path = endpoint.pool_to(url)
        try:
            async with asyncio.timeout(t.interval_ms / 1000):
                reply = await pool.send(backend, "GET", path, [], b"", streaming=False)
                if reply.close is not None:
                    await reply.close()
            if reply.status != 200 or reply.body is None:
                raise ValueError(f"status {reply.status}")
            texts.append(reply.body.decode("utf-8", "replace"))
        except (UpstreamError, ValueError, TimeoutError) as exc:
            log.debug("load of %s at %s: %r", endpoint.url, url, exc)
    series = [s for text in texts for s in parse_exposition(text, _READ)]
    endpoint.adapters = adapters_of(series, endpoint.adapters)
    read = read_series(series, Selector(t.select, t.gpu, t.gpu_instance)).signals
    signals = {}
    for k, v in read.items():
        figure = _figure(v, _LIMITS.get(k, math.inf))
        if figure is not None:
            signals[k] = figure
    endpoint.signals = signals
    endpoint.queue_waiting = signals.get("queue_waiting")
    endpoint.kv_cache_usage = signals.get("kv_cache_usage")


def adapters_of(series: Sequence[Series], before: Adapters | None = None) -> Adapters | None:
    """The adapters of a server's latest ``vllm:lora_requests_info`` (with those ``before``
    held, while there is room: ``Adapters.resident``); None without one."""
    latest = max((s for s in series if s.name == LORA_INFO), key=lambda s: s.value, default=None)
    if latest is None:
        return None
    serving = {
        name.strip()
        for label in ("running_lora_adapters", "waiting_lora_adapters")
        for name in (latest.label(label) or "").split(",")
        if name.strip()
    }
    given = latest.label("max_lora") or ""
    # ASCII digits, few: int() refuses '²' and 5,000 digits with a ValueError
    most = int(given) if given.isascii() and given.isdigit() and len(given) <= 6 else None
    base = next((s.label("model_name") for s in series if s.name in QUEUE_WAITING), None)
    earlier = [a for a in (before.resident if before else ()) if a not in serving]
    room = min(most if most is not None else MAX_RESIDENT, MAX_RESIDENT) - len(serving)
    resident = (*sorted(serving), *earlier[: max(0, room)])
    return Adapters(base, frozenset(serving), most, resident)


MAX_RESIDENT = 64
"""The most adapters remembered of a server (all it names in flight, then as many of those
before as ``max_lora`` allows, within this): an exporter naming new adapters each scrape
must not grow the memory."""


E = TypeVar("E", bound=Endpoint)
ADAPTER_PICKS = ("serving", "room", "full")
"""Why an adapter's request went where it did: a server was serving it; none was, and one
had room for it; none had room either (the pick loads it where it can)."""


def for_model(model: str, choices: list[E], backend: Backend) -> tuple[list[E], str]:
    """``kv_aware``: of ``choices``, where a request for ``model`` should go, and why
    (``ADAPTER_PICKS``).  For one of the servers' LoRA adapters: the unsaturated servers
    serving it, else those with room for it, else all; for their base model (or servers
    that say nothing of adapters): all."""
    told = [e.adapters for e in choices if e.adapters is not None]
    if not told or any(a.base == model for a in told):
        return choices, ""
    fresh = [e for e in choices if not saturated(e, backend)] or choices
    serving = [e for e in fresh if e.adapters is not None and e.adapters.holds(model)]
    if serving:
        return serving, "serving"
    room = [e for e in fresh if e.adapters is not None and e.adapters.room]
    return (room, "room") if room else (choices, "full")


def judge(endpoint: Endpoint, rules: Sequence[ThrottleRule]) -> bool:
    """Apply the backend's throttle rules to one endpoint's signals, each with its
    hysteresis (fires above ``above``, clears below ``clear_below``; an unknown signal
    clears); True when the endpoint's throttled state changed."""
    before = bool(endpoint.throttled)
    for rule in rules:
        value = endpoint.signals.get(rule.when.signal)
        if rule.name in endpoint.throttled:
            if value is None or value < rule.when.clear_below:
                endpoint.throttled.discard(rule.name)
        elif value is not None and value > rule.when.above:
            endpoint.throttled.add(rule.name)
    return before != bool(endpoint.throttled)


class Fleet(Protocol):
    """What ``FleetSource`` reads of a backend's endpoints (``endpoints.EndpointSet``)."""

    @property
    def endpoints(self) -> Sequence[Endpoint]: ...

    @property
    def scraped_at(self) -> float | None: ...


class FleetSource:
    """The backend's telemetry when it is per endpoint: each signal's least value over the
    endpoints (the coolest one), as of their last scrape round; ``fleet`` finds the
    backend's live endpoints (a reload may have replaced them)."""

    def __init__(self, fleet: Callable[[], Fleet | None]) -> None:
        self._fleet = fleet

    async def read(self) -> Sample:
        fleet = self._fleet()
        signals: dict[str, float] = {}
        for e in fleet.endpoints if fleet is not None else ():
            for k, v in e.signals.items():
                signals[k] = min(v, signals.get(k, v))
        if fleet is None or fleet.scraped_at is None or not signals:
            raise TelemetryError("no endpoint's telemetry could be read")
        return Sample(at=fleet.scraped_at, **signals)

    async def aclose(self) -> None:
        """Nothing to release: the scrapes are the endpoints'."""

    def __repr__(self) -> str:
        return "<FleetSource>"


def _figure(value: float | None, most: float) -> float | None:
    """A server's figure as it is, or unknown when it cannot be true (not finite, negative,
    a KV share over 1): a broken exporter must not leave an endpoint out for nothing."""
    if value is None or not math.isfinite(value) or not 0 <= value <= most:
        return None
    return value


async def watch(
    endpoints: Callable[[], Sequence[Endpoint]],
    backend: Backend,
    round_done: Callable[[], None],
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> None:
    """Scrape every endpoint each ``telemetry.interval_ms``, until cancelled; after each
    round, ``round_done`` (the throttle rules are judged there)."""
    interval_s = backend.telemetry.interval_ms / 1000
    while True:
        await asyncio.gather(*(scrape(e, backend) for e in endpoints()))
        round_done()
        await sleep(interval_s)
