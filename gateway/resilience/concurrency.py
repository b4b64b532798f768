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

The counts outlive policy reloads (a reload that lowers a cap lets the calls in flight
finish), and only capped tenants are counted, so ``gateway_tenant_in_flight{tenant}`` has
one series per capped tenant.
"""

from __future__ import annotations

from gateway.errors import RateLimited
from gateway.metrics import Metrics
from gateway.pipeline import Reply
from gateway.state import Kind

RETRY_AFTER_S = 1.0
"""What a refused call is told to wait: a slot frees when one of the tenant's calls ends."""


class ConcurrencyLimited(RateLimited):
    """A named tenant already has its ``max_concurrency`` calls in flight."""

    code = "concurrency_limit_exceeded"


class InFlight:
    """The calls in flight per capped tenant, in this process; kept across reloads."""

    def __init__(self, metrics: Metrics) -> None:
        self._counts: dict[str, int] = {}
        self._gauge = metrics.tenant_in_flight
        self._refused = metrics.tenant_concurrency_limited

    def enter(self, tenant: str, cap: int) -> Slot:
        """A slot for one of ``tenant``'s calls, or ``ConcurrencyLimited`` past its cap."""
        held = self._counts.get(tenant, 0)
        if held >= cap:
            self._refused.labels(tenant).inc()
            raise ConcurrencyLimited(
                f"tenant {tenant!r} already has {held} requests in flight (its "
                f"max_concurrency is {cap}); retry when one has finished",
                retry_after_s=RETRY_AFTER_S,
            )
        self._counts[tenant] = held + 1
        self._gauge.labels(tenant).set(held + 1)
        return Slot(self, tenant)

    def held(self, tenant: str) -> int:
        """``tenant``'s calls in flight now."""
        return self._counts.get(tenant, 0)

    def _leave(self, tenant: str) -> None:
        left = self._counts[tenant] - 1
        if left:
            self._counts[tenant] = left
        else:
            del self._counts[tenant]
        self._gauge.labels(tenant).set(left)

    def __repr__(self) -> str:
        return f"<InFlight {self._counts}>"


class Slot:
    """One call's place in its tenant's count: given back exactly once."""

    __slots__ = ("_owner", "_tenant")

    def __init__(self, owner: InFlight, tenant: str) -> None:
        self._owner: InFlight | None = owner
        self._tenant = tenant

    def release(self) -> None:
        """Give the place back; a second call does nothing."""
        owner, self._owner = self._owner, None
        if owner is not None:
            owner._leave(self._tenant)

    def holding(self, reply: Reply) -> Reply:
        """``reply``, the place held until it is done: now for a whole body, when its
        stream is closed (ended, cut or left) for a stream."""
        return reply.when_done(self.release)


IN_FLIGHT: Kind[InFlight] = Kind("tenant_in_flight")
