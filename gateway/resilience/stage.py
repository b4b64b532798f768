"""Admission, throttling, circuit breaking and fallback: the last stage before a call goes to
a backend (its calls are already batched and coalesced, so each counts once).

For each call:

1. A named tenant's cap on its calls in flight (``concurrency.py``, ``max_concurrency``;
   for a client offering no listed key, its address's; across every process with
   ``concurrency_store: redis``, ``concurrency_redis.py``), then the rate limits
   (``rates.py``): a route's per-tenant ``rate_limit`` and a named tenant's own; past one,
   429 with ``Retry-After``.
2. The candidates: the call's backend, then the route's ``fallback`` backends in order
   (none for a call pinned to the endpoint that holds what it names, ``Call.pin``: no
   other backend has it).
3. For each candidate, its guard (``guard.py``): the throttle's decision over the
   backend's telemetry (``reroute`` moves on; ``shed`` refuses all but high priority;
   ``limit`` caps concurrency and rate), the circuit breaker, and the admission queue,
   ordered by the ``X-Priority`` header or the route's ``priority``, never above the
   caller's cap (``max_priority``), and fair between tenants.  Then the call, which
   carries the guard's ``spare`` where its backend hedges (``Call.spare``): a hedge of it
   takes a slot of its own, or is not made.
4. A refusal (open breaker, throttle, full queue, queue timeout), a timeout, a failed
   connection, or a 5xx or 429 status moves on to the next candidate; a failed reply is
   closed first, which is possible because its status has not reached the client yet.  A
   streamed 200 has started and is never replaced.  Moves caused by a backend failing are
   retries and spend the retry budget (when it is spent, the client gets that failure);
   moves the gateway chose (open breaker, throttle, full queue) are not and do not.
5. Quality (a route's ``quality``, non-streaming chat only): the primary is asked for
   logprobs, and an answer whose mean token logprob is below the threshold moves on to the
   fallback (``low_confidence``); logprobs the client did not ask for are stripped.

``X-Gateway-Backend`` (set at the edge) names who served; ``X-Gateway-Fallback`` says why
the primary did not, with one of ``FALLBACK_REASONS``, also counted in
``gateway_fallbacks_total{route,reason}``.  Every 429 and 503 leaving this stage carries a
``Retry-After``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.errors import (
    CircuitOpen,
    GatewayError,
    Overloaded,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.metrics import Metrics
from gateway.openai import vllm_priority as vllm
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy, Quality
from gateway.resilience.admission import Priority
from gateway.resilience.breaker import Outcome
from gateway.resilience.concurrency_redis import Counts, in_flight_counts
from gateway.resilience.context import REASON as CONTEXT_REASON
from gateway.resilience.context import read_refusal
from gateway.resilience.gpu import GpuControl, wire_gpu
from gateway.resilience.guard import BackendGuard, Pass
from gateway.resilience.health import Failed, account
from gateway.resilience.quality import asking_logprobs, judged, mean_logprob, parse, strip_logprobs
from gateway.resilience.quota import without_rate_headers
from gateway.resilience.rates import RateLimits, build_rate_limits
from gateway.resilience.retry_budget import RetryAllowance
from gateway.resilience.standings import STANDINGS, Standings
from gateway.state import Kind

if TYPE_CHECKING:
    from gateway.runtime import Runtime

GUARDS: Kind[BackendGuard] = Kind("guard")
RETRY_BUDGET: Kind[RetryAllowance] = Kind("retry_budget")

FALLBACK_HEADER = "X-Gateway-Fallback"
PRIORITY_HEADER = "X-Priority"
FALLBACK_REASONS = (
    "upstream_5xx",  # the backend answered 5xx (503 included)
    "upstream_429",  # the backend answered 429
    "timeout",  # connect, total or idle timeout before the answer's head
    "unavailable",  # refused, reset or closed connection
    "low_confidence",  # the answer's mean token logprob was below the route's threshold
    CONTEXT_REASON,  # refused as too long for the model's context (context_fallback)
    "circuit_open",  # the backend's circuit breaker is open (or busy probing)
    "throttle",  # a throttle rule rerouted or shed the call
    "queue_full",  # the backend's admission queue was full
    "queue_share",  # shed from a full queue to make room for another tenant's call
    "queue_timeout",  # the call waited in the queue past its timeout
)
VLLM_PRIORITY = {Priority.HIGH: vllm.HIGH, Priority.NORMAL: vllm.NORMAL, Priority.LOW: vllm.LOW}
"""The gateway's priorities as vLLM's ``priority`` (lower runs first; 0 is its default)."""
RETRY_REASONS = frozenset(
    {"upstream_5xx", "upstream_429", "timeout", "unavailable", "low_confidence"}
)
"""Moves that are retries: the backend was called and failed; they spend the retry budget."""
DEFAULT_RETRY_AFTER_S = 1.0


@dataclass(frozen=True, slots=True)
class Moved:
    """A candidate did not serve the call: why, and the refusal or failed reply."""

    reason: str
    failure: Reply | GatewayError


class Resilience:
    """The stage; see the module docstring."""

    def __init__(
        self,
        *,
        guards: Mapping[str, BackendGuard],
        control: GpuControl,
        budget: RetryAllowance,
        rates: RateLimits,
        metrics: Metrics,
        caps: Mapping[str, Priority] | None = None,
        anonymous_cap: Priority = Priority.HIGH,
        vllm_priority: frozenset[str] = frozenset(),
        hedged: frozenset[str] = frozenset(),
        in_flight: Counts | None = None,
        max_concurrency: Mapping[str, int] | None = None,
        clients: Counts | None = None,
        client_concurrency: int | None = None,
    ) -> None:
        self._caps = caps or {}
        self._in_flight = in_flight
        self._max_concurrency = max_concurrency or {}
        self._clients = clients
        self._client_concurrency = client_concurrency
        self._vllm_priority = vllm_priority
        self._hedged = hedged
        self._anonymous_cap = anonymous_cap
        self._guards = guards
        self._control = control
        self._budget = budget
        self._rates = rates
        self._metrics = metrics

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        if call.tenant:
            cap, counts, key = self._max_concurrency.get(call.tenant), self._in_flight, call.tenant
        else:
            cap, counts, key = self._client_concurrency, self._clients, call.client
        if cap is None or counts is None:
            return await self._limited(call, call_next)
        slot = await counts.take(key, cap)
        try:
            reply = await self._limited(call, call_next)
        except BaseException:
            slot.release()
            raise
        return slot.holding(reply)

    async def _limited(self, call: Call, call_next: Handler) -> Reply:
        """The call past its tenant's cap: the rate limits, then the candidates."""
        route = call.route
        admitted = await self._rates.admit(call) if self._rates else None
        self._budget.record_request()
        fallback = tuple(b for b in route.fallback if b != call.backend and call.pin is None)
        if (
            not fallback
            and call.backend not in self._guards
            and call.backend not in self._vllm_priority
        ):
            reply = await call_next(call)
            served = self._served(call, reply, 0, None)
        else:
            served = await self._serve(call, call_next, (call.backend, *fallback))
        if route.context_fallback and call.pin is None:
            served = await self._longer_context(call, call_next, served)
        if admitted is not None:
            served = await self._rates.settle(admitted, served)
            told = self._rates.told(call, admitted.standing)
            if told:  # the caller's standing here, never the backend's key's
                served = served.replace(headers=without_rate_headers(served.headers) + tuple(told))
        return served

    async def _longer_context(self, call: Call, call_next: Handler, served: Reply) -> Reply:
        """``served``, or, where it refuses the call as too long for the model's context,
        the answer of the route's ``context_fallback`` backends (``context.py``)."""
        served, overflowed = await read_refusal(served)
        refused_by = served.backend or call.backend
        candidates = tuple(b for b in call.route.context_fallback if b != refused_by)
        if not overflowed or not candidates:
            return served
        await _close(served)
        return await self._serve(call, call_next, candidates, moved=CONTEXT_REASON)

    async def _serve(
        self,
        call: Call,
        call_next: Handler,
        candidates: tuple[str, ...],
        moved: str | None = None,
    ) -> Reply:
        """The first of ``candidates`` to serve ``call`` (``moved``: why the call left the
        backends before them, which served it not)."""
        cap = self._caps.get(call.tenant, Priority.HIGH) if call.tenant else self._anonymous_cap
        priority = min(priority_of(call), cap)
        if call.record is not None:
            call.record.priority = priority.name.lower()
        judge = judged(call, call.route.quality)
        reason = moved
        last: Moved | None = None
        index = 0
        for index, backend in enumerate(candidates, start=moved is not None):
            more = index + 1 < len(candidates) + (moved is not None)
            target = call if backend == call.backend else dataclasses.replace(call, backend=backend)
            quality = call.route.quality if judge and index == 0 else None
            result = await self._attempt(target, call_next, priority, more, quality)
            if isinstance(result, Reply):
                return self._served(call, result, index, reason)
            last = result
            reason = reason or result.reason
            if not more:
                break
            if result.reason in RETRY_REASONS and not self._budget.try_spend():
                break  # the budget is spent: this failure is the answer
            if isinstance(result.failure, Reply):
                await _close(result.failure)
        assert last is not None  # the loop ran at least once and did not return
        if isinstance(last.failure, Reply):
            return self._served(call, last.failure, index, reason)
        raise last.failure

    async def _attempt(
        self,
        call: Call,
        call_next: Handler,
        priority: Priority,
        more: bool,
        quality: Quality | None,
    ) -> Reply | Moved:
        """One candidate: its guard, then the call."""
        guard = self._guards.get(call.backend)
        passed: Pass | None = None
        if guard is not None:
            decision = self._control.decide(call.backend)
            if decision is not guard.decision:
                guard.apply(decision)
            record = call.record
            if record is not None and decision.rule is not None:
                record.throttle = decision.rule
            if decision.action == "reroute" and more:
                return Moved("throttle", Overloaded("rerouted", reason="throttle"))
            if decision.action == "shed" and priority < Priority.HIGH:
                return Moved("throttle", guard.shed(f"rule {decision.rule!r} sheds load"))
            timed = record is not None or call.tenant
            queued = time.perf_counter() if timed else 0.0
            try:
                passed = await guard.enter(priority, call.tenant, call.client)
            except CircuitOpen as exc:
                return Moved("circuit_open", exc)
            except Overloaded as exc:
                return Moved(exc.reason, exc)
            if timed and passed.ticket is not None:
                admitted = time.perf_counter()
                if record is not None:
                    record.queue_wait = (queued, admitted)
                if call.tenant:
                    self._metrics.tenant_waited(call.tenant, admitted - queued)
            if guard.decision.action == "reroute" and more:
                # The rule fired while the call waited in the queue: it is rerouted too.
                passed.release()
                return Moved("throttle", Overloaded("rerouted", reason="throttle"))
        if guard is not None and call.backend in self._hedged:
            call = dataclasses.replace(call, spare=guard.spare)  # a hedge's room (hedge.py)
        if call.backend in self._vllm_priority:
            call = await with_vllm_priority(call, priority)
        strip = False
        if quality is not None:
            call, strip = await asking_logprobs(call, quality)
        try:
            reply = await call_next(call)
        except UpstreamError as exc:
            reason = "timeout" if isinstance(exc, UpstreamTimeout) else "unavailable"
            if passed is not None:
                self._failed(call.backend)(reason)
                passed.record(Outcome.FAILURE)
                passed.release()
            return Moved(reason, exc)
        except BaseException:
            if passed is not None:
                passed.release()
            raise
        if passed is not None:
            reply = account(call, reply, passed, self._failed(call.backend))
        if reply.status >= 500:
            return Moved("upstream_5xx", reply)
        if reply.status == 429:
            return Moved("upstream_429", reply)
        if quality is not None and reply.status == 200:
            return _judge(reply, quality, strip)
        return reply

    def _failed(self, backend: str) -> Failed:
        """What counts a failure of ``backend`` by reason."""
        family = self._metrics.backend_failures

        def count(reason: str) -> None:
            family.labels(backend, reason).inc()

        return count

    def _served(self, call: Call, reply: Reply, index: int, reason: str | None) -> Reply:
        extra: list[tuple[str, str]] = []
        if index > 0 and reason is not None:
            extra.append((FALLBACK_HEADER, reason))
            self._metrics.fallbacks.labels(call.route.name, reason).inc()
            if call.record is not None:
                call.record.fallback = reason
        if reply.status in (429, 503) and reply.header("Retry-After") is None:
            guard = self._guards.get(reply.backend or call.backend)
            retry_s = guard.retry_after_s() if guard is not None else DEFAULT_RETRY_AFTER_S
            extra.append(("Retry-After", str(max(1, round(retry_s)))))
        return reply.with_headers(extra) if extra else reply

    def __repr__(self) -> str:
        return f"<Resilience guards={sorted(self._guards)} {self._rates!r} {self._budget!r}>"


def _judge(reply: Reply, quality: Quality, strip: bool) -> Reply | Moved:
    answer = parse(reply)
    mean = mean_logprob(answer)
    if strip and answer is not None:
        reply = reply.replace(body=strip_logprobs(answer))
    if mean is not None and mean < quality.min_mean_logprob:
        return Moved("low_confidence", reply)
    return reply


async def _close(reply: Reply) -> None:
    """Release a reply that is not the answer (the next candidate is tried instead)."""
    if reply.close is not None:
        await reply.close()


async def with_vllm_priority(call: Call, priority: Priority) -> Call:
    """``call`` whose body carries ``priority`` as vLLM's ``priority`` field
    (``backends.<name>.upstream_priority: vllm``), replacing the client's."""
    return await vllm.with_priority(call, VLLM_PRIORITY[priority])


def priority_of(call: Call) -> Priority:
    """The ``X-Priority`` header (``high``, ``normal``, ``low``) or else the route's, before
    the caller's cap (``tenants.max_priority``, ``tenants.keys[].max_priority``)."""
    header = call.header(PRIORITY_HEADER)
    if header:
        try:
            return Priority.parse(header)
        except ValueError:
            pass  # an unknown value is not worth a 400: the route's priority applies
    return Priority.parse(call.route.priority)


def build(policy: Policy, runtime: Runtime) -> list[Stage]:
    """The stage for ``policy`` (none when it uses none of it), with telemetry wired."""
    registry, metrics, clock = runtime.registry, runtime.metrics, runtime.clock
    ruled = {r.backend for r in policy.throttle}
    capped = {
        r.backend
        for r in policy.throttle
        if r.limit is not None and r.limit.max_concurrency is not None
    }
    guards: dict[str, BackendGuard] = {}
    weights = policy.tenants.weights()
    for b in policy.backends:
        if b.max_concurrency is None and b.circuit_breaker is None and b.name not in ruled:
            continue
        guard = registry.get(
            GUARDS, b.name, None, functools.partial(BackendGuard, b.name, metrics, clock)
        )
        guard.configure(b, needs_admission=b.name in capped, weights=weights)
        guards[b.name] = guard
    fleet = getattr(runtime.transport, "endpoint_set", None)  # the real transport's
    control = wire_gpu(policy, registry, metrics, clock, guards, fleet)
    rates = build_rate_limits(policy, registry, clock, metrics)
    if rates:  # GET /tenants tells where the named tenants stand in them
        registry.get(STANDINGS, "", None, functools.partial(Standings, registry))
    vllm_priority = frozenset(b.name for b in policy.backends if b.upstream_priority == "vllm")
    max_concurrency = policy.tenants.max_concurrencies()
    client_concurrency = policy.tenants.max_concurrency
    if not (
        guards
        or rates
        or vllm_priority
        or max_concurrency
        or client_concurrency is not None
        or any(r.fallback or r.context_fallback for r in policy.routes)
    ):
        return []
    settings = policy.retry_budget
    in_flight, clients = in_flight_counts(policy.tenants, registry, metrics, clock, policy.redis)
    budget = registry.get(
        RETRY_BUDGET, "", settings, functools.partial(RetryAllowance, settings, clock=clock)
    )
    stage = Resilience(
        guards=guards,
        control=control,
        budget=budget,
        rates=rates,
        metrics=metrics,
        caps={name: Priority.parse(cap) for name, cap in policy.tenants.max_priorities().items()},
        anonymous_cap=Priority.parse(policy.tenants.max_priority),
        vllm_priority=vllm_priority,
        hedged=frozenset(b.name for b in policy.backends if b.hedge is not None),
        in_flight=in_flight,
        max_concurrency=max_concurrency,
        clients=clients,
        client_concurrency=client_concurrency,
    )
    return [stage]
