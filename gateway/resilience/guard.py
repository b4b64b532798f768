"""A backend's guard: its admission queue, circuit breaker and throttle limits, in front of
every call the gateway makes to it.

One ``BackendGuard`` per backend that has any of them, kept in the registry as
``("guard", backend)`` for the gateway's life: a reload ``configure``s it, so calls in
flight keep their slots and probes, and new limits apply to new admissions.  ``enter``
either hands back a ``Pass`` (a slot and a breaker permit) or raises the refusal
(``Overloaded``, ``CircuitOpen``); the caller decides whether a refusal falls back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gateway.clock import Clock
from gateway.errors import Overloaded
from gateway.metrics import Metrics
from gateway.pipeline import unbounded
from gateway.policy.model import Backend
from gateway.policy.throttle import ThrottleLimit
from gateway.resilience.admission import Admission, AdmissionConfig, Priority, Ticket
from gateway.resilience.breaker import (
    STATE_VALUES,
    Breaker,
    BreakerTransition,
    Outcome,
    Permit,
)
from gateway.resilience.rate_limit import TokenBucket
from gateway.resilience.throttle import Decision

TENANT_FLOW = "t:"
"""A named tenant's flow in a fair queue is its name after this (an address's, ``a:``)."""
UNLIMITED_CONCURRENCY = 1 << 30
"""The base concurrency of a backend without ``max_concurrency`` that a ``limit`` rule caps."""


@dataclass(slots=True)
class Pass:
    """Leave to make one call: release it (or record its outcome) exactly once."""

    ticket: Ticket | None
    permit: Permit | None

    def record(self, outcome: Outcome) -> None:
        """Count the call's outcome for the breaker; the slot stays held."""
        if self.permit is not None:
            self.permit.record(outcome)

    def release(self) -> None:
        """Give back the slot (and the permit, if no outcome was recorded)."""
        if self.permit is not None:
            self.permit.release()
        if self.ticket is not None:
            self.ticket.release()

    def release_slot(self) -> None:
        """Give back the admission slot only: the permit waits for an outcome to come."""
        if self.ticket is not None:
            self.ticket.release()


class BackendGuard:
    """Admission, breaker and throttle limits of one backend."""

    def __init__(self, backend: str, metrics: Metrics, clock: Clock) -> None:
        self.backend = backend
        self.admission: Admission | None = None
        self.breaker: Breaker | None = None
        self.decision = Decision()
        self._limit: ThrottleLimit | None = None
        self._rps: TokenBucket | None = None
        self._clock = clock
        self._metrics = metrics
        self._shed = {
            reason: metrics.shed.labels(backend, reason)
            for reason in ("queue_full", "queue_share", "queue_timeout", "throttle", "circuit_open")
        }
        self._wait = metrics.queue_wait.labels(backend)
        self._fair = False

    def configure(
        self, backend: Backend, *, needs_admission: bool, weights: Mapping[str, int] | None = None
    ) -> None:
        """Apply a (re)loaded backend definition, and the named tenants' ``weights`` in its
        fair queue; state in flight is kept."""
        self._fair = backend.queue.fairness == "tenant"
        flow_weights = {TENANT_FLOW + name: w for name, w in (weights or {}).items()}
        if backend.max_concurrency is not None or needs_admission:
            config = AdmissionConfig(
                backend.max_concurrency or UNLIMITED_CONCURRENCY, backend.queue
            )
            if self.admission is None:
                self.admission = Admission(
                    self.backend,
                    config,
                    clock=self._clock,
                    on_wait=self._wait.observe,
                    on_shed=self._count_shed,
                )
                admission = self.admission
                self._metrics.queue_depth.labels(self.backend).set_function(
                    lambda: float(admission.depth)
                )
                self.admission.weights = flow_weights
                if self._limit is not None:
                    self.admission.set_throttle_limit(self._limit.max_concurrency)
            else:
                self.admission.weights = flow_weights  # before the reload's grants
                self.admission.configure(config)
        else:
            self.admission = None
        cb = backend.circuit_breaker
        if cb is None:
            self.breaker = None
        else:
            if self.breaker is None:
                self.breaker = Breaker(
                    self.backend, cb, clock=self._clock, on_transition=self._breaker_moved
                )
                self._metrics.breaker_state.labels(self.backend).set(STATE_VALUES["closed"])
            else:
                self.breaker.configure(cb)

    # -- throttle ------------------------------------------------------------------------
    def apply(self, decision: Decision) -> None:
        """Take the throttle's decision: cap concurrency and rate while a ``limit`` rule
        holds, and shed queued waiters below high priority while a ``shed`` rule does."""
        previous, self.decision = self.decision, decision
        limit = decision.limit
        if limit != self._limit:
            self._limit = limit
            if self.admission is not None:
                self.admission.set_throttle_limit(None if limit is None else limit.max_concurrency)
            rps = None if limit is None else limit.rps
            if rps is None:
                self._rps = None
            elif self._rps is None or self._rps.rate_per_s != rps:
                self._rps = TokenBucket(rps, max(1.0, rps), self._clock.now())
        if decision.action == "shed" and previous.action != "shed" and self.admission is not None:
            self.admission.shed_waiting(Priority.HIGH, "throttle")

    def shed(self, why: str) -> Overloaded:
        """A refusal by a ``shed`` or ``limit`` rule (counted)."""
        self._shed["throttle"].inc()
        return Overloaded(
            f"backend {self.backend!r} is throttled: {why}",
            retry_after_s=self.retry_after_s(),
            reason="throttle",
        )

    # -- a call --------------------------------------------------------------------------
    async def enter(self, priority: Priority, tenant: str = "", client: str = "") -> Pass:
        """A slot and a breaker permit for one call, or the refusal raised.  The call's named
        ``tenant``, else its ``client`` address, is its flow in a fair queue."""
        if self._rps is not None:
            now = self._clock.now()
            self._rps.refill(now)
            if self._rps.level < 1:
                raise self.shed(f"over the throttled rate of {self._rps.rate_per_s:g}/s")
            self._rps.level -= 1
        breaker = self.breaker
        permit = None
        if breaker is not None and not breaker.allow():
            # Refused before queueing: nothing waits for a breaker that says no.
            self._shed["circuit_open"].inc()
            permit = breaker.acquire()  # raises CircuitOpen, with when to retry
        ticket = None
        if self.admission is not None:
            flow = (TENANT_FLOW + tenant if tenant else "a:" + client) if self._fair else ""
            ticket = await self.admission.acquire(priority, flow)
        if breaker is not None and permit is None:
            try:
                permit = breaker.acquire()
            except BaseException:
                if ticket is not None:
                    ticket.release()
                self._shed["circuit_open"].inc()
                raise
        return Pass(ticket, permit)

    def spare(self) -> Callable[[], None] | None:
        """Leave for a call the gateway adds, a hedge's second call (``Call.spare``) or a
        mirror's copy, or None: a free slot that no queued call waits for, within a
        ``limit`` rule's rate; none while a rule sheds or reroutes the backend's calls, nor
        while its breaker is not closed (such a call is no probe).  It is released by
        calling what is returned."""
        if self.decision.action in ("shed", "reroute"):
            return None
        if self.breaker is not None and self.breaker.state != "closed":
            return None
        if self._rps is not None:
            self._rps.refill(self._clock.now())
            if self._rps.level < 1:
                return None
        release: Callable[[], None] = unbounded
        if self.admission is not None:
            ticket = self.admission.spare()
            if ticket is None:
                return None
            release = ticket.release
        if self._rps is not None:
            self._rps.level -= 1
        return release

    def drain(self) -> None:
        """Shutdown: the queue's waiters are refused at once (see ``Admission.drain``)."""
        if self.admission is not None:
            self.admission.drain()

    def retry_after_s(self) -> float:
        """Seconds a refused client should wait: the queue's estimate, else 1."""
        return float(self.admission.retry_after_s()) if self.admission is not None else 1.0

    def _count_shed(self, reason: str) -> None:
        counter = self._shed.get(reason)
        if counter is None:
            counter = self._shed[reason] = self._metrics.shed.labels(self.backend, reason)
        counter.inc()

    def _breaker_moved(self, t: BreakerTransition) -> None:
        self._metrics.breaker_state.labels(self.backend).set(STATE_VALUES[t.new])
        self._metrics.breaker_transitions.labels(self.backend, t.new).inc()

    def __repr__(self) -> str:
        parts = [self.backend, f"throttle={self.decision.action}"]
        if self.admission is not None:
            parts.append(repr(self.admission))
        if self.breaker is not None:
            parts.append(repr(self.breaker))
        return f"<BackendGuard {' '.join(parts)}>"
