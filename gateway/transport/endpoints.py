"""The instances of a backend and the real transport over them.

A backend is one ``url`` or several ``endpoints`` (replicas of one model server).  Each
endpoint has its own keep-alive pool (``BackendPool``).  ``EndpointSet`` picks one per
request by the backend's ``balance``:

* ``least_request`` (the default): the power of two random choices over in-flight counts
  (Mitzenmacher; Envoy's default): two distinct endpoints drawn at random, the one with
  fewer requests in flight wins, so a slow instance, whose requests pile up, gets fewer;
* ``round_robin``: each in turn, whatever their load;
* ``kv_aware``: least request over the model servers' own figures (``load.py``): an
  endpoint whose queue or KV cache is over its limit is left out while another is not, and
  a request for a LoRA adapter goes where it is served already, else where there is room;
* with ``prefix_affinity``, on top of either: a request whose leading context (its
  ``openai.prefix.leading_key``) an endpoint served recently goes to that endpoint again,
  while it is no busier than the least busy by more than ``AFFINITY_SLACK`` (so its model
  server's prefix cache is reused, and a hot prefix cannot pile onto one instance) and,
  with ``kv_aware``, while its server is not saturated when another is not (a server with
  few slots, llama.cpp's, queues a request long before the slack is reached).

Per-endpoint health is outlier ejection (Envoy's ``consecutive_5xx``): after
``EJECT_AFTER`` failures in a row (a connect error, a timeout, a 5xx other than 503; the
backend's ``circuit_breaker.consecutive_failures`` when set) an endpoint gets no traffic
for ``circuit_breaker.open_s`` (``EJECT_S`` without a breaker), then is tried again.  The
backend stays up while any endpoint is healthy; when every endpoint is ejected, all are
tried again (Envoy's panic mode), so the backend's own breaker, not the ejection, decides
whether the backend is down.  A request whose connection could not even be opened (so
nothing was sent) is tried once more on another endpoint.

A request that names something only one endpoint holds (a stored response of the
Responses API: ``Call.pin``, set by ``openai.response_ids``) goes to that endpoint, ejected
or not, and to no other if it cannot be reached (another would answer that it has no such
thing); when no endpoint matches any more (the instance is gone, and what it held with
it), it is balanced as any other, and the backend says what it has.  Both are counted
(``gateway_endpoint_pins_total``).

A call the picked endpoint is slow to answer may go to a second one as well (a ``hedge``),
and one it did not serve (a 503, a 429, a broken connection) to another (``calls.py``).

``backends.Upstreams`` keeps one set per backend across reloads.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import ConnectFailed
from gateway.metrics import Metrics
from gateway.metrics.children import Counted
from gateway.pipeline import Reply, Spare
from gateway.policy.checks import MAX_ENDPOINTS
from gateway.policy.model import Backend, ThrottleRule
from gateway.transport import load
from gateway.transport.calls import Calls
from gateway.transport.discovery import Resolver, follow
from gateway.transport.endpoint import Endpoint
from gateway.transport.joining import Joining
from gateway.transport.sizing import Demand, Sizing
from gateway.transport.upstream import BackendPool, pool_key

AFFINITY_SLACK = 4
"""Requests in flight an affine endpoint may have over the least busy one before a request
of its prefix goes elsewhere (consistent hashing with bounded loads, in spirit)."""
AFFINITY_KEYS = 4096
"""Leading contexts remembered per backend, least recently used out."""
EJECT_AFTER = 5
"""Failures in a row that eject an endpoint when the backend has no breaker settings."""
EJECT_S = 10.0
"""How long an ejected endpoint gets no traffic when the backend has no breaker settings."""


def endpoint_urls(backend: Backend) -> tuple[str, ...]:
    """The backend's instances as the policy lists them: ``endpoints``, or its one ``url``
    (none with ``discovery``: DNS says)."""
    if backend.discovery is not None:
        return ()
    return tuple(u.rstrip("/") for u in backend.endpoints) or (backend.url.rstrip("/"),)


def set_key(backend: Backend) -> tuple[object, ...]:
    """What makes two backend definitions share an endpoint set."""
    return (*pool_key(backend, ""), endpoint_urls(backend), backend.discovery, backend.balance)


class EndpointSet:
    """The endpoints of one backend, picked per request; duck-types a ``BackendPool``."""

    def __init__(
        self,
        backend: Backend,
        metrics: Metrics,
        *,
        clock: Clock = SYSTEM_CLOCK,
        rng: random.Random | None = None,
        demand: Demand | None = None,
    ) -> None:
        self.key = set_key(backend)
        self.name = backend.name
        self.balance = backend.balance
        breaker = backend.circuit_breaker
        self.eject_after = (breaker.consecutive_failures if breaker else 0) or EJECT_AFTER
        self.eject_s = breaker.open_s if breaker else EJECT_S
        self._backend = backend
        self._metrics = metrics
        self.endpoints = [
            Endpoint(BackendPool(backend, metrics, url), metrics, backend)
            for url in endpoint_urls(backend)
        ]
        # one fixed instance (the `url` form): requests go straight to its pool, unpicked,
        # uncounted per endpoint (the backend's own metrics say it all), at no extra cost
        self.direct = (
            self.endpoints[0].pool
            if backend.discovery is None and len(self.endpoints) == 1
            else None
        )
        self.resolved = asyncio.Event()  # set once the endpoints are known
        if backend.discovery is None:
            self.resolved.set()
        self._follower: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._clock = clock
        self._rng = rng or random.Random()
        self.sizing = Sizing(backend, backend.pool, clock, demand) if backend.pool else None
        if self.sizing is not None:
            self.sizing.assign(self.endpoints)
        sleep = getattr(clock, "sleep", asyncio.sleep)
        several = backend.discovery is not None or len(self.endpoints) > 1
        joins = several and self.sizing is None
        self.joining = Joining(backend, metrics, clock, sleep) if joins else None
        self.rules: tuple[ThrottleRule, ...] = ()  # the backend's, judged per endpoint
        self.scraped_at: float | None = None  # the last round of telemetry scrapes
        self._affinity: OrderedDict[str, Endpoint] = OrderedDict()
        self.affinity_hits = 0
        self._pins = Counted(metrics.endpoint_pins, backend.name)
        self._adapter_picks = Counted(metrics.endpoint_adapter_picks, backend.name)
        self._next = 0
        self.calls = Calls(backend.name, metrics, clock)  # hedges and retries
        self._active = metrics.pool_active_endpoints.labels(backend.name)
        self._shown_active = -1
        self._show_active(len(self.endpoints))

    @property
    def inflight(self) -> int:
        return sum(e.inflight for e in self.endpoints)

    @property
    def waiting(self) -> int:
        return sum(e.pool.waiting for e in self.endpoints)

    @property
    def closed(self) -> bool:
        return all(e.pool.closed for e in self.endpoints)

    def healthy(self) -> list[Endpoint]:
        """The endpoints not ejected now (an ejection that ran out returns here)."""
        now = self._clock.now()
        out = []
        for e in self.endpoints:
            if e.ejected_until and now >= e.ejected_until:
                e.ejected_until = 0.0
                e.failures = 0
                e.show_state()
            if not e.ejected_until:
                out.append(e)
        self._show_active(len(out))
        return out

    def _show_active(self, count: int) -> None:
        if count != self._shown_active:  # the gauge takes a lock: set it on change only
            self._shown_active = count
            self._active.set(count)

    def update(self, urls: Sequence[str]) -> None:
        """Make the endpoints ``urls`` (discovery): add the new, drain the gone (no new
        requests; those in flight finish, then the pool closes)."""
        wanted = [u.rstrip("/") for u in urls][:MAX_ENDPOINTS]
        kept = {e.url: e for e in self.endpoints if e.url in wanted}
        for e in self.endpoints:
            if e.url not in kept:
                if self.joining is not None:
                    self.joining.leave(e)  # no warm-up of a replica that is gone
                for pool in e.pools():
                    pool.retire()
                e.forget(self._metrics)
        self.endpoints = [
            kept.get(u)
            or Endpoint(BackendPool(self._backend, b := self._metrics, u), b, self._backend)
            for u in dict.fromkeys(wanted)
        ]
        for e in self.endpoints:
            if self.joining is not None and e.url not in kept:
                self.joining.join(e)  # warmed before it takes calls
        if self.sizing is not None:
            self.sizing.assign(self.endpoints)
        self.healthy()
        self.resolved.set()

    def join_new(self, known: Sequence[str]) -> None:
        """A reload made this set in place of one with the endpoints ``known``: warm those
        it adds before they take calls (``joining.py``; discovery's join as they come)."""
        if self.joining is not None and self._backend.discovery is None:
            for e in self.endpoints:
                if e.url not in known:
                    self.joining.join(e)

    def keep_warm(self) -> None:
        """With a ``pool``, send warm-up requests to idle core endpoints (``Sizing``)."""
        if self.sizing is not None and self._keeper is None:
            self._keeper = asyncio.get_running_loop().create_task(
                self.sizing.keep_warm(
                    lambda: self.endpoints, getattr(self._clock, "sleep", asyncio.sleep)
                )
            )

    def watch_load(self) -> None:
        """With ``balance: kv_aware`` or telemetry per endpoint, keep each endpoint's
        figures current (and judge the throttle rules on them)."""
        wanted = self.balance == "kv_aware" or load.templated(self._backend)
        if wanted and self._watcher is None:
            self._watcher = asyncio.get_running_loop().create_task(
                load.watch(
                    lambda: self.endpoints,
                    self._backend,
                    self._judged,
                    getattr(self._clock, "sleep", asyncio.sleep),
                )
            )

    def _judged(self) -> None:
        self.scraped_at = self._clock.now()
        for e in self.endpoints:
            e.show_signals()
            if load.judge(e, self.rules):
                e.show_state()

    def follow(self, resolver: Resolver) -> None:
        """Keep the endpoints on what the backend's ``discovery`` name resolves to."""
        discovery = self._backend.discovery
        if discovery is not None and self._follower is None:
            self._follower = asyncio.get_running_loop().create_task(
                follow(
                    self.name,
                    discovery,
                    self.update,
                    resolver,
                    getattr(self._clock, "sleep", asyncio.sleep),
                )
            )

    def pick(
        self,
        exclude: Sequence[Endpoint] = (),
        affinity: str | None = None,
        model: str | None = None,
    ) -> Endpoint:
        """The endpoint for the next request (``exclude``: those already tried;
        ``affinity``: the request's leading-context key, see ``prefix_affinity``; ``model``:
        the model it asks for, a LoRA adapter's servers preferred with ``kv_aware``)."""
        if not self.endpoints:
            raise ConnectFailed(f"backend {self.name!r} has no endpoint", self.name)
        if len(self.endpoints) == 1:
            return self.endpoints[0]
        choices = [e for e in self.healthy() if e not in exclude]
        now = self._clock.now()
        choices = [
            e for e in choices if not e.throttled and not e.warming and e.refused_until <= now
        ] or choices
        if self.sizing is not None:
            rotation = self.sizing.in_rotation(self.endpoints)
            choices = [e for e in choices if e in rotation] or [
                e for e in rotation if e not in exclude
            ]
            self.sizing.pressure(
                self.endpoints, len(rotation), sum(e.inflight for e in rotation), self.waiting
            )
            self._show_active(len(rotation))
        if not choices:  # every endpoint ejected (or tried): try them all again
            choices = [e for e in self.endpoints if e not in exclude] or self.endpoints
        if model is not None and self.balance == "kv_aware":
            choices, why = load.for_model(model, choices, self._backend)
            if why:
                self._adapter_picks.inc(why)
        if affinity is not None:
            return self._affine(affinity, choices)
        return self._balanced(choices)

    def _affine(self, key: str, choices: list[Endpoint]) -> Endpoint:
        """The endpoint that served ``key`` recently, while it is among ``choices``, no
        busier than the least busy by more than ``AFFINITY_SLACK`` and (``kv_aware``) not
        saturated while another is not; else a balanced pick.
        Only a prefix new here, or whose endpoint is out of ``choices`` (ejected, gone,
        throttled), gets a new home: an overflow to another endpoint leaves it where its
        model server's prefix cache is."""
        known = self._affinity.get(key)
        if known is not None and known in choices:
            self._affinity.move_to_end(key)
            least = min(e.inflight for e in choices)
            if known.inflight <= least + AFFINITY_SLACK and not self._queues(known, choices):
                self.affinity_hits += 1
                return known
            return self._balanced([e for e in choices if e is not known] or choices)
        endpoint = self._balanced(choices)
        self._affinity[key] = endpoint
        self._affinity.move_to_end(key)
        while len(self._affinity) > AFFINITY_KEYS:
            self._affinity.popitem(last=False)
        return endpoint

    def _queues(self, known: Endpoint, choices: list[Endpoint]) -> bool:
        """``kv_aware``: whether ``known``'s server is saturated while another is not (a
        request sent there would wait for a slot that another server has free)."""
        if self.balance != "kv_aware" or not load.saturated(known, self._backend):
            return False
        return any(not load.saturated(e, self._backend) for e in choices if e is not known)

    def _balanced(self, choices: list[Endpoint]) -> Endpoint:
        if self.balance == "kv_aware":  # the unsaturated, else all; then by score
            choices = [e for e in choices if not load.saturated(e, self._backend)] or choices
        if len(choices) == 1:
            return choices[0]
        if self.balance == "round_robin":
            self._next += 1
            return choices[self._next % len(choices)]
        a, b = self._rng.sample(choices, 2)
        if self.balance == "kv_aware":
            return a if load.score(a) <= load.score(b) else b
        return a if a.inflight <= b.inflight else b

    def observe(self, endpoint: Endpoint, outcome: str, failed: bool) -> None:
        """Count an answer (or error) of ``endpoint``; eject it after too many failures."""
        endpoint.count(outcome)
        if not failed:
            endpoint.failures = 0
            return
        endpoint.failures += 1
        if len(self.endpoints) > 1 and endpoint.failures >= self.eject_after:
            endpoint.ejected_until = self._clock.now() + self.eject_s
            endpoint.ejections += 1
            endpoint.show_state()
            self.healthy()

    async def send(
        self,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        streaming: bool,
        affinity: str | None = None,
        pin: Callable[[str], bool] | None = None,
        model: str | None = None,
        spare: Spare | None = None,
    ) -> Reply:
        if not self.resolved.is_set():  # discovery's first answer is on its way
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.resolved.wait(), backend.connect_timeout_s)
        return await self.calls.send(
            self,
            backend,
            method,
            path_qs,
            headers,
            body,
            streaming=streaming,
            affinity=affinity,
            pin=pin,
            model=model,
            spare=spare,
        )

    def pinned(self, pin: Callable[[str], bool]) -> Endpoint | None:
        """The endpoint ``pin`` names, if the backend still has it."""
        found = next((e for e in self.endpoints if pin(e.url)), None)
        self._pins.inc("kept" if found else "gone")
        return found

    def _stop(self) -> None:
        if self.sizing is not None:
            self.sizing.close()
        if self.joining is not None:
            self.joining.close()
        for task in (self._follower, self._watcher, self._keeper):
            if task is not None:
                task.cancel()
        self._follower = self._watcher = self._keeper = None

    def retire(self) -> None:
        self._stop()
        for e in self.endpoints:
            for pool in e.pools():
                pool.retire()

    def retire_after_use(self) -> None:
        for e in self.endpoints:
            e.pool.retire_after_use()

    async def aclose(self) -> None:
        self._stop()
        for e in self.endpoints:
            for pool in e.pools():
                await pool.aclose()

    def __repr__(self) -> str:
        healthy = len(self.healthy())
        return (
            f"<EndpointSet {self.name} balance={self.balance} "
            f"healthy={healthy}/{len(self.endpoints)} inflight={self.inflight}>"
        )
