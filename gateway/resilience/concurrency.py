"""Each named tenant's calls in flight to its backends, capped by
``tenants.keys[].max_concurrency``.

A rate limit bounds how often a tenant starts calls, not how many it holds: ten long streams
started within its rate can hold every slot of a backend for minutes, and the fair queue
shares only the slots that come free.  So a tenant with a cap has at most that many calls
in flight at once in this process (a batched or coalesced call counts once, as everywhere
past the cache); one more is a 429 ``concurrency_limit_exceeded`` with ``Retry-After``,
before any rate limit is charged or any queue is entered (LiteLLM's
``max_parallel_requests`` per key refuses the same way).  A call is in flight from this
stage until its answer is done: a whole body when it has been read, a stream when it has
ended, been cut or been left by its client.

A client offering no listed key may be capped too (``tenants.max_concurrency``), counted
by its address as nginx's ``limit_conn`` counts one (behind ``server.trusted_proxies``, the
real client's): many connections from one address cannot hold every slot either.

The counts outlive policy reloads (a reload that lowers a cap lets the calls in flight
finish), and only capped tenants are counted, so ``gateway_tenant_in_flight{tenant}`` has
one series per capped tenant; addresses are no label, so ``gateway_client_in_flight`` is
their sum.  A key is counted only while it has calls in flight.

With ``tenants.concurrency_store: redis`` the caps hold across every process and replica
(``concurrency_redis.py``); this count is then each process's share of it.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.errors import RateLimited
from gateway.metrics import Metrics
from gateway.pipeline import Reply
from gateway.state import Kind

RETRY_AFTER_S = 1.0
"""What a refused call is told to wait: a slot frees when one of the tenant's calls ends."""


class ConcurrencyLimited(RateLimited):
    """A named tenant (or a client offering no listed key) already has its cap of calls in
    flight."""

    code = "concurrency_limit_exceeded"


class InFlight:
    """The calls in flight per capped tenant (or, with ``clients``, per client offering no
    listed key, by its address), in this process; kept across reloads."""

    def __init__(self, metrics: Metrics, *, clients: bool = False) -> None:
        self._counts: dict[str, int] = {}
        self._clients = clients
        self._total = 0
        self._gauge = metrics.tenant_in_flight
        self._refused = metrics.tenant_concurrency_limited
        self._clients_gauge = metrics.client_in_flight
        self._clients_refused = metrics.client_concurrency_limited

    async def take(self, key: str, cap: int) -> Slot:
        """``enter`` (the stage's way in, as ``SharedInFlight.take``)."""
        return self.enter(key, cap)

    def enter(self, key: str, cap: int | None, then: Callable[[], None] | None = None) -> Slot:
        """A slot for one of ``key``'s calls (a tenant's name, or a client's address), or
        ``ConcurrencyLimited`` past ``cap`` (None: counted, never refused); ``then`` runs
        when it is given back."""
        held = self._counts.get(key, 0)
        if cap is not None and held >= cap:
            raise self.refusal(key, held, cap)
        self._counts[key] = held + 1
        self._told(key, held + 1, +1)
        return Slot(self, key, then)

    def refusal(self, key: str, held: int, cap: int, where: str = "") -> ConcurrencyLimited:
        """The 429 for one more of ``key``'s calls, ``held`` being in flight (``where``:
        across what), counted."""
        if self._clients:  # an address is no label: one series for them all
            self._clients_refused.inc()
            who, setting = "this client", "tenants.max_concurrency"
        else:
            self._refused.labels(key).inc()
            who, setting = f"tenant {key!r}", "its max_concurrency"
        return ConcurrencyLimited(
            f"{who} already has {held} requests in flight{where} ({setting} is {cap}); "
            "retry when one has finished",
            retry_after_s=RETRY_AFTER_S,
        )

    def held(self, key: str) -> int:
        """``key``'s calls in flight now."""
        return self._counts.get(key, 0)

    def _leave(self, key: str) -> None:
        left = self._counts[key] - 1
        if left:
            self._counts[key] = left
        else:
            del self._counts[key]
        self._told(key, left, -1)

    def _told(self, key: str, held: int, change: int) -> None:
        self._total += change
        if self._clients:
            self._clients_gauge.set(self._total)
        else:
            self._gauge.labels(key).set(held)

    def __repr__(self) -> str:
        return f"<InFlight clients={self._clients} {self._counts}>"


class Slot:
    """One call's place in its tenant's (or client's) count: given back exactly once."""

    __slots__ = ("_key", "_owner", "_then")

    def __init__(self, owner: InFlight, key: str, then: Callable[[], None] | None = None) -> None:
        self._owner: InFlight | None = owner
        self._key = key
        self._then = then

    def release(self) -> None:
        """Give the place back; a second call does nothing."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._leave(self._key)
            if self._then is not None:
                self._then()

    def holding(self, reply: Reply) -> Reply:
        """``reply``, the place held until it is done: now for a whole body, when its
        stream is closed (ended, cut or left) for a stream."""
        return reply.when_done(self.release)


IN_FLIGHT: Kind[InFlight] = Kind("tenant_in_flight")
CLIENTS_IN_FLIGHT: Kind[InFlight] = Kind("client_in_flight")
