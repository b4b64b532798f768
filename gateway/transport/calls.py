"""One call over a backend's endpoints: the pick, a hedge when the endpoint is slow
(``hedge.py``), and another endpoint when the one picked did not serve the call.

An endpoint that could not be connected to (nothing was sent) costs one more pick, as it
always has.  An endpoint that answered 503 is picked only when every other refuses too, for
its ``Retry-After`` (within ``MAX_REFUSAL_S``) or ``REFUSAL_S``: LiteLLM's cooldown, so a
replica loading its model is probed about once a second rather than sent its share of the
calls; it is shown ``refusing`` in ``gateway_endpoint_state`` until it answers otherwise.
Not after a 429: that may be one caller's own limit (a hosted API behind the gateway counts
each client's key), and one tenant's limit must not steer every tenant's calls away.  An
endpoint that answered 503 (overloaded, or still loading its model:
llama.cpp answers every call 503 until its model is loaded) or 429 (its own queue full:
TGI's "Model is overloaded"), or whose connection broke after the request went out (a reset,
a misframed answer), did not serve the call either, and the call goes to another endpoint,
up to ``backends.<name>.endpoint_retries`` times (nginx's ``proxy_next_upstream``, Envoy's
``previous_hosts`` retry predicate).  Only a call that changes nothing may be sent again
(``upstream.resendable``), and only while nothing of its answer has left for the client
(the head is read before a single byte is relayed).  A timeout is not retried: it spent the
backend's ``timeout_s`` already.  Retries are budgeted per backend as Envoy budgets them:
each call earns its backend's ``endpoint_retry_budget`` of a retry (0.2, Envoy's default)
and each retry spends one, at most ``MAX_SAVED`` saved up (as many to start with; none
with a budget of 0), so a fleet failing as a whole is not sent its load again on top.  When
no endpoint serves it, the last answer or error is the call's, and the route's
``fallback`` takes it from there.  Counted in ``gateway_endpoint_retries_total{backend,
reason, outcome}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from gateway.clock import Clock
from gateway.errors import ConnectFailed, UpstreamError, UpstreamUnavailable
from gateway.metrics import Metrics
from gateway.metrics.children import Counted
from gateway.pipeline import Reply, Spare
from gateway.policy.model import Backend
from gateway.transport.endpoint import Endpoint
from gateway.transport.hedge import Hedger, hedge_target, hedgeable
from gateway.transport.upstream import resendable

MAX_SAVED = 10.0
"""Retries saved up at most by a backend whose calls have been served."""
RETRIED_STATUSES = {503: "upstream_503", 429: "upstream_429"}
"""Answers that say the endpoint did not serve the call, by the reason counted."""
REFUSAL_S = 1.0
"""How long an endpoint that answered 503 without a ``Retry-After`` is picked only
when every other is refusing too (LiteLLM's cooldown; a probe a second, so it is back as
soon as its model is loaded)."""
MAX_REFUSAL_S = 30.0
"""The longest ``Retry-After`` taken from an endpoint."""


def refusal_s(reply: Reply) -> float:
    """How long an endpoint that answered 503 gets other calls only after them: its
    ``Retry-After`` in seconds, within ``MAX_REFUSAL_S``, else ``REFUSAL_S``."""
    given = (reply.header("Retry-After") or "").strip()
    seconds = int(given[:6]) if given.isascii() and given.isdigit() else REFUSAL_S
    return min(max(seconds, REFUSAL_S), MAX_REFUSAL_S)


class EndpointSet(Protocol):
    """What a call needs of its backend's endpoints (``endpoints.EndpointSet``)."""

    endpoints: list[Endpoint]

    def pinned(self, pin: Callable[[str], bool]) -> Endpoint | None: ...

    def pick(
        self,
        exclude: Sequence[Endpoint] = (),
        affinity: str | None = None,
        model: str | None = None,
    ) -> Endpoint: ...

    def observe(self, endpoint: Endpoint, outcome: str, failed: bool) -> None: ...


class Calls:
    """The calls of one endpoint set: its hedging and its retry budget."""

    def __init__(self, name: str, metrics: Metrics, clock: Clock) -> None:
        self._name = name
        self._metrics = metrics
        self._clock = clock
        self.hedger: Hedger | None = None  # made on the first hedgeable call
        self.saved = MAX_SAVED
        self._counted = Counted(metrics.endpoint_retries, name)  # by reason and outcome

    async def send(
        self,
        endpoints: EndpointSet,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        streaming: bool,
        affinity: str | None,
        pin: Callable[[str], bool] | None,
        model: str | None,
        spare: Spare | None = None,
    ) -> Reply:
        tried: list[Endpoint] = []
        pinned = endpoints.pinned(pin) if pin is not None else None
        several = len(endpoints.endpoints) > 1

        sent = 0

        async def attempt(endpoint: Endpoint) -> Reply:
            nonlocal sent
            sent += 1
            endpoint.last_used = self._clock.now()
            try:
                reply = await endpoint.pool.send(
                    backend, method, path_qs, headers, body, streaming=streaming
                )
            except UpstreamError:
                endpoints.observe(endpoint, "error", True)
                raise
            status = reply.status
            endpoints.observe(endpoint, f"{status // 100}xx", status >= 500 and status != 503)
            if status == 503 and several:  # the server's state, not one caller's (a 429)
                shown = bool(endpoint.refused_until)
                endpoint.refused_until = self._clock.now() + refusal_s(reply)
                if not shown:
                    endpoint.show_state()
            elif endpoint.refused_until:  # it serves again
                endpoint.refused_until = 0.0
                endpoint.show_state()
            return reply

        def another(first: Endpoint) -> Endpoint | None:
            second = endpoints.pick(tried, affinity, model)
            tried.append(second)
            return second if hedge_target(second, first, backend, self._clock.now()) else None

        inert = resendable(method, path_qs, [])  # changes nothing, whatever its key says
        hedge = hedgeable(backend, streaming, pinned is not None, inert)
        retries = 0
        if several and pinned is None and (inert or resendable(method, path_qs, headers)):
            retries = backend.endpoint_retries
            earned = backend.endpoint_retry_budget
            # a budget of 0 allows none, not the retries saved at the start
            self.saved = min(MAX_SAVED, self.saved + earned) if earned > 0 else 0.0
        while True:
            endpoint = pinned if pinned is not None else endpoints.pick(tried, affinity, model)
            tried.append(endpoint)
            try:
                if hedge is not None and len(tried) == 1 and several:
                    self.hedger = self.hedger or Hedger(self._name, self._metrics)
                    reply = await self.hedger.send(
                        hedge, endpoint, attempt, another, streaming, spare
                    )
                else:
                    reply = await attempt(endpoint)
            except ConnectFailed:
                if pinned is not None or len(tried) >= min(2, len(endpoints.endpoints)):
                    raise
                self._counted.inc("connect", "sent")
                continue  # nothing reached that endpoint: another may take it
            except UpstreamUnavailable:
                if not self._again(retries, tried, endpoints, "unavailable"):
                    raise
                retries -= 1
                continue
            reason = RETRIED_STATUSES.get(reply.status)
            if reason is None or not self._again(retries, tried, endpoints, reason):
                return reply if sent == 1 else reply.replace(attempts=sent)
            retries -= 1
            if reply.close is not None:
                await reply.close()

    def _again(self, retries: int, tried: list[Endpoint], endpoints: EndpointSet, why: str) -> bool:
        """Whether the call goes to another endpoint (one it has not tried) after ``why``."""
        if retries <= 0 or len(set(tried)) >= len(endpoints.endpoints):
            return False
        if self.saved < 1:
            self._counted.inc(why, "budget")
            return False
        self.saved -= 1
        self._counted.inc(why, "sent")
        return True
