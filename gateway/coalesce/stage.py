"""Single flight as a stage: identical in-flight requests of one tenant share one upstream call.

On a route where ``route.coalescing`` holds (``coalesce: true``, or by default where the
route caches), a deterministic OpenAI request (as ``cacheability`` judges it, with the
route's ``cache.allow_sampled``) is keyed by its exact cache key: tenant scope (the policy's
``cache.scope_headers``), route, backend, model version, path and every answer-changing body
field, plus the query string.  Concurrent calls with equal keys join one ``SingleFlight``
call made with the first caller's request, so a request never reaches the backend on another
tenant's credentials.

Streams fan out to late joiners (the events already sent, then the live ones); a
non-streaming joiner of a stream gets the answer assembled into one JSON body, and only from
a stream that completed normally.  ``stream_options`` changes the events of a stream (a usage
chunk), so a streaming call joins only streams asked for with the same options, and a
non-streaming call only streams that carry usage, as its own answer would.  The upstream call
is cancelled only when every caller has gone; its failure, or a stream cut off, reaches every
caller.  Joiners are counted in ``gateway_coalesced_requests_total`` and answered with
``X-Gateway-Coalesced: 1``.

The servers' own deterministic calls (``cache.own_apis``: KServe V2 ``infer``, TEI's
``/embed``, greedy generations, streamed or not...) are coalesced by the same key, their
body's digest, and sent as they came; their answers are handed as the backend sent them,
byte for byte, a stream as a stream.  KServe V2 calls that differ only by the ``id`` opening
them (KServe's client sends a fresh one each call) share one call too, each caller given
its own id where the answer echoed the first's (``own_apis.placeheld``); calls asking for
binary tensors are kept apart by their ids.

Anthropic's Messages API is coalesced too, at temperature 0, and the Responses API when the
server stores nothing (``store: false``): a stream joins only streams and a whole answer
only whole answers (the shape is in the key, with Anthropic's ``anthropic-version`` and
``anthropic-beta``), each handed as the backend sent it, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Hashable
from typing import Any

from gateway.cache import own_apis
from gateway.cache.keys import AS_SENT_PATHS, api_headers, cacheability, request_key
from gateway.coalesce.singleflight import SingleFlight, Start
from gateway.errors import UpstreamUnavailable
from gateway.openai.sse import StreamRecorder, events_to_json
from gateway.pipeline import Call, Handler, Headers, Reply, Stage
from gateway.policy.model import Policy
from gateway.runtime import Runtime
from gateway.state import Kind
from gateway.transport.headers import is_event_stream

FLIGHTS: Kind[SingleFlight] = Kind("singleflight")
COALESCED_HEADER = "X-Gateway-Coalesced"
# A non-streaming answer carries usage: a stream it may be assembled from must too.
_WHOLE_BODY_STREAM_OPTIONS = '{"include_usage":true}'
_REPLACED_ON_ASSEMBLY = frozenset({"content-type", "content-encoding", "cache-control"})


class CoalesceStage:
    """Runs each coalescible call through its route's single-flight table."""

    def __init__(
        self, flights: dict[str, SingleFlight], own_calls: dict[str, Callable[[], None]]
    ) -> None:
        self._flights = flights
        self._own_calls = own_calls  # joiners that made their own call after all, counted

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        flights = self._flights.get(call.route.name)
        if flights is None:
            return await call_next(call)
        sent = call
        if call.json is None and own_apis.taken(call.route):
            call = await own_apis.keyed(call) or call  # a server's own: keyed by its digest
        key = coalesce_key(call)
        if key is None:
            return await call_next(sent)
        # Anthropic's, the Responses API's and the servers' own answers are handed as the
        # backend sent them, never assembled: a whole answer and a stream have keys of their
        # own (``keys._shape``; a server's own call's body, ``stream`` in it).
        as_sent = call.streaming or own_apis.is_keyed(call) or call.path.endswith(AS_SENT_PATHS)
        start: Start = lambda: call_next(sent)  # noqa: E731
        asked = (call.json or {}).get(own_apis.REQUEST_ID)  # a KServe call's leading id
        ids = asked is not None
        if ids and own_apis.shares_answers(sent):  # one call, each caller its own id back
            start = lambda: self._placeheld(call, sent, call_next)  # noqa: E731
        elif ids:  # binary tensors: each its own id, apart
            key = (key, asked)
        reply = await flights.do(key, start, stream=as_sent)
        if ids and reply.coalesced and not own_apis.rewritable(reply):
            self._own_calls[call.route.name]()
            return await call_next(sent)  # an answer its id cannot be rewritten in
        reply = own_apis.answered(call.json, reply) if ids else reply
        return reply.with_headers(((COALESCED_HEADER, "1"),)) if reply.coalesced else reply

    @staticmethod
    async def _placeheld(call: Call, sent: Call, call_next: Handler) -> Reply:
        return own_apis.placeheld(call, await call_next(sent))

    def __repr__(self) -> str:
        return f"<CoalesceStage routes={sorted(self._flights)}>"


def coalesce_key(call: Call) -> Hashable | None:
    """The single-flight key of ``call``, or None when it must make its own call."""
    body, route = call.json, call.route
    allow_sampled = route.cache is not None and route.cache.allow_sampled
    if body is None or not cacheability(body, call.path, allow_sampled=allow_sampled).ok:
        return None
    exact = request_key(
        body,
        scope=call.scope,
        route=route.name,
        backend=call.backend,
        model_version=call.policy.backend(call.backend).model_version,
        path=call.path,
        near=False,
    ).exact
    if call.path.endswith(AS_SENT_PATHS):  # Anthropic's version and beta features count
        return (exact, call.query, api_headers(call.path, call.headers))
    if call.streaming:
        options = json.dumps(
            body.get("stream_options"), sort_keys=True, separators=(",", ":"), default=str
        )
    else:
        options = _WHOLE_BODY_STREAM_OPTIONS
    return (exact, call.query, options)


def assemble(status: int, headers: Headers, body: bytes) -> tuple[Headers, bytes]:
    """A shared stream's bytes as the JSON answer a non-streaming joiner asked for.

    Raises ``UpstreamUnavailable`` when the stream did not complete normally (no ``[DONE]``,
    an error event, a choice without a finish_reason): never a partial answer as a whole one.
    """
    if not is_event_stream(headers):
        return headers, body
    recorder = StreamRecorder(max_bytes=len(body) + 1)
    recorder.feed(body)
    events = recorder.result()
    answer: Any = None
    if events is not None:
        try:
            answer = events_to_json(events)
        except (ValueError, KeyError, TypeError, AttributeError):
            answer = None
    if answer is None:
        raise UpstreamUnavailable(
            "the shared stream did not complete normally; no whole answer to give"
        )
    kept = tuple((k, v) for k, v in headers if k.lower() not in _REPLACED_ON_ASSEMBLY)
    encoded = json.dumps(answer, separators=(",", ":"), ensure_ascii=False).encode()
    return (*kept, ("Content-Type", "application/json")), encoded


def build(policy: Policy, runtime: Runtime) -> list[Stage]:
    """The coalesce stage for ``policy``, or none when no route coalesces."""
    flights: dict[str, SingleFlight] = {}
    own_calls: dict[str, Callable[[], None]] = {}
    for route in policy.routes:
        if route.coalescing:
            counted = runtime.metrics.coalesced.labels(route.name).inc
            flights[route.name] = runtime.registry.get(
                FLIGHTS, route.name, (), _factory(route.name, counted)
            )
            own_calls[route.name] = runtime.metrics.coalesced_own_calls.labels(route.name).inc
    return [CoalesceStage(flights, own_calls)] if flights else []


def _factory(name: str, counted: Callable[[], None]) -> Callable[[], SingleFlight]:
    return lambda: SingleFlight(name=name, assemble=assemble, on_coalesced=counted)
