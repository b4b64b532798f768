"""The real transport: an endpoint set per backend (``EndpointSet``), kept across reloads
while the backend's endpoints and connection settings hold, a replaced set retired after
its requests in flight."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.metrics import Metrics
from gateway.pipeline import Reply, Spare
from gateway.policy.model import Backend, Policy
from gateway.transport.discovery import Resolver, SystemResolver
from gateway.transport.endpoint import Endpoint
from gateway.transport.endpoints import EndpointSet, set_key
from gateway.transport.identity import AUTO, Identities
from gateway.transport.sizing import Demand


def _endpoints_of(pool: EndpointSet) -> list[Endpoint]:
    return pool.endpoints


class Upstreams:
    """The real transport: an endpoint set per backend, kept across reloads while its key
    holds."""

    def __init__(
        self,
        metrics: Metrics,
        clock: Clock = SYSTEM_CLOCK,
        resolver: Resolver | None = None,
        demand: Demand | None = None,
    ) -> None:
        self._metrics = metrics
        self.demand: Demand = demand if demand is not None else {}
        self._clock = clock
        self._resolver = resolver or SystemResolver()
        self._pools: dict[str, EndpointSet] = {}
        self._retired: dict[tuple[object, ...], EndpointSet] = {}
        self._live: dict[int, tuple[Backend, EndpointSet]] = {}  # by the live policy's objects
        self._identities: dict[str, tuple[Identities, EndpointSet]] = {}  # model_version: auto

    def sync(self, policy: Policy) -> None:
        """Make the pools match ``policy``: keep, replace (retiring the old) or drop."""
        wanted = {b.name: b for b in policy.backends}
        replaced: dict[str, list[str]] = {}  # the endpoints of each set being replaced
        for name, pool in list(self._pools.items()):
            backend = wanted.get(name)
            if backend is None or set_key(backend) != pool.key:
                replaced[name] = [e.url for e in pool.endpoints]
                pool.retire()
                del self._pools[name]
                if not pool.closed:
                    self._retired[pool.key] = pool
        self._retired = {k: p for k, p in self._retired.items() if not p.closed}
        for name, backend in wanted.items():
            if name not in self._pools:
                self._pools[name] = EndpointSet(
                    backend, self._metrics, clock=self._clock, demand=self.demand
                )
                if name in replaced:  # a reload changed it: warm the endpoints it adds
                    self._pools[name].join_new(replaced[name])
                self._pools[name].follow(self._resolver)
                self._pools[name].watch_load()
                self._pools[name].keep_warm()
        for name, pool in self._pools.items():
            pool.rules = tuple(r for r in policy.throttle if r.backend == name)
            if pool.joining is not None:  # the warm-up the policy now asks of joiners
                pool.joining.backend = wanted[name]
        self._live = {id(b): (b, self._pools[b.name]) for b in policy.backends}
        self._watch_identities(wanted)

    def _watch_identities(self, wanted: dict[str, Backend]) -> None:
        """Ask the servers of each ``model_version: auto`` backend what they serve (those of
        its set as it is now; what is known of an endpoint a new set keeps is kept)."""
        for name in list(self._identities):
            if name not in wanted or wanted[name].model_version != AUTO:
                self._identities.pop(name)[0].forget()
        sleep = getattr(self._clock, "sleep", asyncio.sleep)
        for name, backend in wanted.items():
            if backend.model_version != AUTO:
                continue
            pool = self._pools[name]
            identities, watched = self._identities.get(name) or (
                Identities(backend, self._metrics),
                None,
            )
            identities.backend = backend
            if watched is not pool:
                identities.start(functools.partial(_endpoints_of, pool), sleep)
            self._identities[name] = (identities, pool)

    def model_identity(self, name: str, model: str | None = None) -> str | None:
        """The version of the backend ``name`` by what its servers say they serve, if its
        ``model_version`` is ``auto`` (``identity.UNKNOWN`` until one has said); with
        ``model``, that model's (``Identities.version_for``)."""
        found = self._identities.get(name)
        return found[0].version_for(model) if found is not None else None

    def endpoint_set(self, name: str) -> EndpointSet | None:
        """The live set of the backend ``name``, if the policy has it."""
        return self._pools.get(name)

    def pool(self, backend: Backend) -> EndpointSet:
        """The live pool of ``backend`` (a request started on an older policy still gets the
        pool its backend's URL calls for)."""
        live = self._live.get(id(backend))
        if live is not None and live[0] is backend:
            return live[1]
        pool = self._pools.get(backend.name)
        if pool is not None and pool.key == set_key(backend):
            return pool
        # (a one-off set never follows discovery: a request of a policy replaced mid-way)
        retired = self._retired.get(set_key(backend))
        if retired is not None and not retired.closed:
            return retired
        pool = EndpointSet(backend, self._metrics, clock=self._clock, demand=self.demand)
        pool.retire_after_use()
        return pool

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
        endpoints = self.pool(backend)
        if endpoints.direct is not None:  # one instance: it holds whatever a pin names
            return await endpoints.direct.send(
                backend, method, path_qs, headers, body, streaming=streaming
            )
        return await endpoints.send(
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

    async def aclose(self) -> None:
        for identities, _ in self._identities.values():
            identities.stop()
        for pool in [*self._pools.values(), *self._retired.values()]:
            await pool.aclose()
        self._pools.clear()
        self._retired.clear()
        self._live.clear()

    def __repr__(self) -> str:
        return f"<Upstreams {list(self._pools.values())!r}>"
