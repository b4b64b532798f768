"""Per-endpoint load for ``balance: kv_aware``, from each model server's own ``/metrics``.

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
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

from gateway.errors import UpstreamError
from gateway.policy.model import Backend
from gateway.telemetry.prometheus import parse_exposition, read_series
from gateway.transport.upstream import BackendPool


class Endpoint(Protocol):
    """What the load figures need of an endpoint (``endpoints.Endpoint``)."""

    url: str
    pool: BackendPool
    queue_waiting: float | None
    kv_cache_usage: float | None

    @property
    def inflight(self) -> int: ...


log = logging.getLogger("gateway.transport")

MAX_QUEUE = 5
MAX_KV_CACHE = 0.8
KV_WEIGHT = 4.0
METRICS_PATH = "/metrics"


def saturated(endpoint: Endpoint) -> bool:
    queue, kv = endpoint.queue_waiting, endpoint.kv_cache_usage
    return (queue is not None and queue > MAX_QUEUE) or (kv is not None and kv > MAX_KV_CACHE)


def score(endpoint: Endpoint) -> float:
    return (
        endpoint.inflight
        + (endpoint.queue_waiting or 0.0)
        + KV_WEIGHT * (endpoint.kv_cache_usage or 0.0)
    )


async def scrape(endpoint: Endpoint, backend: Backend) -> None:
    """Read one endpoint's queue and KV use (unknown when the scrape fails)."""
    try:
        reply = await endpoint.pool.send(backend, "GET", METRICS_PATH, [], b"", streaming=False)
        if reply.close is not None:
            await reply.close()
        if reply.status != 200 or reply.body is None:
            raise ValueError(f"status {reply.status}")
        signals = read_series(parse_exposition(reply.body.decode("utf-8", "replace"))).signals
    except (UpstreamError, ValueError) as exc:
        log.debug("load of %s: %s", endpoint.url, exc)
        endpoint.queue_waiting = endpoint.kv_cache_usage = None
        return
    endpoint.queue_waiting = _figure(signals.get("queue_waiting"), math.inf)
    endpoint.kv_cache_usage = _figure(signals.get("kv_cache_usage"), 1.0)


def _figure(value: float | None, most: float) -> float | None:
    """A server's figure as it is, or unknown when it cannot be true (not finite, negative,
    a KV share over 1): a broken exporter must not leave an endpoint out for nothing."""
    if value is None or not math.isfinite(value) or not 0 <= value <= most:
        return None
    return value


async def watch(
    endpoints: Callable[[], Sequence[Endpoint]],
    backend: Backend,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> None:
    """Scrape every endpoint each ``telemetry.interval_ms``, until cancelled."""
    interval_s = backend.telemetry.interval_ms / 1000
    while True:
        await asyncio.gather(*(scrape(e, backend) for e in endpoints()))
        await sleep(interval_s)
