"""One instance of a backend: its keep-alive pool, its health (ejection, throttle rules
firing on its own signals), its load figures and its role in the pool sizing."""

from __future__ import annotations

import contextlib
from typing import Any
from urllib.parse import urlsplit

from gateway.metrics import Metrics
from gateway.policy.model import Backend
from gateway.transport.load import Adapters
from gateway.transport.upstream import BackendPool

STATES = ("active", "standby", "warming", "ejected", "throttled", "refusing")


class Endpoint:
    """One instance: its pool and its health."""

    def __init__(self, pool: BackendPool, metrics: Metrics, backend: Backend) -> None:
        self.pool = pool
        self.url = pool.base_url
        self._backend = backend
        self._metrics = metrics
        self._side: dict[str, BackendPool] = {}  # telemetry at another address of its own
        self.signals: dict[str, float] = {}  # its own telemetry (load.py)
        self.throttled: set[str] = set()  # the throttle rules firing on its signals
        self.refused_until = 0.0  # it answered 503: others first till then (calls.py); 0
        # again once it answers otherwise
        self.warming = False  # new through discovery: being warmed, others first (joining.py)
        self.failures = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.role = ""  # with a `pool`: active, standby or warming (sizing.py)
        self.last_used = 0.0
        self.queue_waiting: float | None = None  # the server's own figures (kv_aware)
        self.kv_cache_usage: float | None = None
        self.adapters: Adapters | None = None  # a vLLM server's LoRA adapters (kv_aware)
        self._requests = metrics.endpoint_requests
        self._counted: dict[str, Any] = {}  # outcome -> its counter child, looked up once
        # read at scrape time: no per-request cost
        metrics.endpoint_inflight.labels(pool.name, self.url).set_function(lambda: pool.inflight)
        self._state = metrics.endpoint_state
        self._signal = metrics.endpoint_signal
        self._shown_signals: set[str] = set()
        self._name = pool.name
        self.show_state()

    @property
    def inflight(self) -> int:
        return self.pool.inflight

    def pool_to(self, url: str) -> tuple[BackendPool, str]:
        """The pool and path to read ``url`` over: its own pool at its own address, else a
        small one of its own to that address."""
        parts = urlsplit(url)
        origin = f"{parts.scheme}://{parts.netloc}"
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if url.startswith(self.url + "/"):
            return self.pool, url[len(self.url) :]
        pool = self._side.get(origin)
        if pool is None:
            pool = self._side[origin] = BackendPool(self._backend, self._metrics, origin)
        return pool, path

    def state(self) -> str:
        if self.ejected_until:
            return "ejected"
        if self.throttled:
            return "throttled"
        if self.warming:
            return "warming"
        return "refusing" if self.refused_until else self.role or "active"

    def pools(self) -> list[BackendPool]:
        return [self.pool, *self._side.values()]

    def show_signals(self) -> None:
        """Publish this endpoint's signals; drop the series of those it no longer has."""
        for name, value in self.signals.items():
            self._signal.labels(self._name, self.url, name).set(value)
        for name in self._shown_signals - self.signals.keys():
            with contextlib.suppress(KeyError):
                self._signal.remove(self._name, self.url, name)
        self._shown_signals = set(self.signals)

    def forget(self, metrics: Metrics) -> None:
        """Drop this endpoint's metric series (it left the backend: bounded cardinality)."""
        for family, labels in (
            (metrics.endpoint_inflight, ()),
            *((metrics.endpoint_requests, (o,)) for o in self._counted),
            *((metrics.endpoint_state, (s,)) for s in STATES),
            *((metrics.endpoint_signal, (s,)) for s in self._shown_signals),
        ):
            with contextlib.suppress(KeyError):
                family.remove(self._name, self.url, *labels)

    def count(self, outcome: str) -> None:
        counter = self._counted.get(outcome)
        if counter is None:
            counter = self._counted[outcome] = self._requests.labels(self._name, self.url, outcome)
        counter.inc()

    def show_state(self) -> None:
        """Publish ``state()``: ejected, throttled, warming (joining), refusing (its last
        answer a 503), else its role in the pool sizing."""
        state = self.state()
        for name in STATES:
            self._state.labels(self._name, self.url, name).set(1 if name == state else 0)

    def __repr__(self) -> str:
        return f"<Endpoint {self.url} inflight={self.inflight} failures={self.failures}>"
