"""Micro-batching as a stage: separate requests to an array-taking API share one upstream call.

On a route with ``batch:``, a request whose path has a batch adapter (``adapter_for``) and
whose body that adapter can batch waits in the route's ``Batcher`` for company; anything else
passes straight on.  There is one batcher per route, backend and adapter, kept in the
runtime's registry under its ``Batch`` settings, so a reload that leaves them alone keeps the
batcher and its learnt limit.  Callers are grouped by the adapter's compat key and a scope of
tenant (the policy's ``cache.scope_headers``), route, backend, path and query: requests of
different tenants or parameters never share a call.

A merged call is a copy of one member's call with the merged body and exactly the headers
every member sent alike (so the same credentials, which the scope already requires; a
header its members differ in, such as a request id, is left out), sent through the rest
of the pipeline (admission, breakers, fallback and the forward), where it counts as one
upstream call.  Its answer is read whole and split; each
caller gets its own share as a whole JSON body with the upstream's headers, or the upstream's
own answer where it was not split (an error for that caller alone, or for the whole call).

The backend's ``max_concurrency`` (default 1) is the batcher's ``slots``: while fewer
batches are in flight a request goes at once.  Past that, a batch goes when full or after
``max_wait_ms``, but at most one more is let upstream to queue there (it hides the round trip
between two batches); the rest are held in the gateway and cut when a batch returns, so they
go full instead of piling up at the backend as partial batches.  With ``adaptive`` the limit
moves by AIMD (``AimdLimit``) against the p90 batch latency, and nothing queues at the
backend (``max_in_flight`` = ``slots``), so that latency is the backend's time for a batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from gateway.batching import (
    Adapter,
    AimdLimit,
    Answer,
    Batcher,
    FixedLimit,
    KServeInfer,
    OpenAICompletions,
    OpenAIEmbeddings,
    TEIEmbed,
    TFServingPredict,
    adapter_for,
)
from gateway.batching.aimd import BatchLimit, CappedLimit
from gateway.batching.merged_calls import SPLIT_REASONS
from gateway.errors import Overloaded
from gateway.metrics import Metrics
from gateway.pipeline import Call, Handler, Headers, Record, Reply, Stage, Verdict
from gateway.policy.model import Batch, Policy, Route
from gateway.resilience.gpu import batch_limit
from gateway.runtime import Runtime
from gateway.state import Kind

BATCHERS: Kind[Batcher] = Kind("batcher")
DEFAULT_SLOTS = 1
QUEUED_AT_BACKEND = 1  # fixed size: batches let upstream past the backend's slots
ADAPTERS: tuple[Adapter, ...] = (
    OpenAIEmbeddings(),
    OpenAICompletions(),
    TEIEmbed(),
    KServeInfer(),
    TFServingPredict(),
)
_GLOB_CHARS = frozenset("*?[")
_SPLIT_DROPS = frozenset({"content-type", "content-encoding"})

BatcherKey = tuple[str, str, str]  # route, backend, adapter name


@dataclass(slots=True, eq=False)
class _Item:
    """One caller's body, with what a merged call needs to go on down the pipeline."""

    body: Any
    call: Call
    call_next: Handler
    backend: str = ""
    headers: Headers = ()
    queued: float = 0.0  # when it began to wait (perf_counter), for its Record


@dataclass(frozen=True, slots=True, eq=False)
class _Merged:
    """A merged body and the items it carries (the first one's call is the template)."""

    items: tuple[_Item, ...]
    body: Any


class _ItemAdapter:
    """An API's adapter seen through ``_Item``s: merged bodies remember their members."""

    def __init__(self, inner: Adapter) -> None:
        self.inner = inner
        self.name = inner.name
        self.opaque_arrays = inner.opaque_arrays

    def batchable(self, item: Any) -> bool:
        return self.inner.batchable(item.body)

    def compat_key(self, item: Any) -> Hashable:
        return self.inner.compat_key(item.body)

    def items(self, item: Any) -> list[Any]:
        return self.inner.items(item.body)

    def count(self, item: Any) -> int:
        return self.inner.count(item.body)

    def merge(self, items: Sequence[Any]) -> Any:
        return _Merged(tuple(items), self.inner.merge([i.body for i in items]))

    def split(self, status: int, response: Any, items: Sequence[Any]) -> list[Any]:
        return self.inner.split(status, response, [i.body for i in items])


class BatchStage:
    """Sends each batchable call through its route's batcher; passes the others on."""

    def __init__(self, batchers: dict[BatcherKey, Batcher]) -> None:
        self._batchers = batchers

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        if call.route.batch is None or call.method != "POST":
            return await call_next(call)
        adapter = adapter_for(call.path)
        batcher = (
            self._batchers.get((call.route.name, call.backend, adapter.name)) if adapter else None
        )
        if adapter is None or batcher is None:
            return await call_next(call)
        body = call.json if call.json is not None else _parse(call.body)
        if body is None or not adapter.batchable(body):
            return await call_next(call)
        scope = (
            call.scope,
            call.route.name,
            call.backend,
            call.path,
            call.query,
        )
        item = _Item(body, call, call_next)
        if call.record is not None:
            item.queued = time.perf_counter()
        try:
            answer = await batcher.submit(item, scope)
        except Overloaded as exc:
            if exc.reason != "shutdown":
                raise
            # A reload replaced this batcher before the call went: it goes on alone.
            return await call_next(call)
        return _reply(answer, item, call.backend)

    def __repr__(self) -> str:
        return f"<BatchStage batchers={len(self._batchers)}>"


async def send(merged: _Merged, verdict: Verdict) -> tuple[int, Headers, bytes]:
    """The batcher's send: the merged call through the rest of the pipeline, read whole;
    its failures wait for the batch's ``verdict`` before they count against the backend."""
    first = merged.items[0]
    went = time.perf_counter()
    trace = None
    for item in merged.items:
        record = item.call.record
        if record is not None:
            record.batch = (len(merged.items), item.queued, went)
            trace = trace or record.trace
    shared = shared_headers([item.call.headers for item in merged.items])
    call = merged_call(first.call, merged.body, trace, shared)
    call.verdict = verdict
    reply = await first.call_next(call)
    try:
        if reply.body is not None:
            raw = reply.body
        else:
            parts = [chunk async for chunk in reply.stream] if reply.stream is not None else []
            raw = b"".join(parts)
    finally:
        if reply.close is not None:
            await reply.close()
    for item in merged.items:
        item.backend, item.headers = reply.backend, reply.headers
    return reply.status, reply.headers, raw


def shared_headers(members: Sequence[Headers]) -> Headers:
    """The header lines every member's call carries alike (name case-insensitively, value
    exactly), in the first member's order."""
    first, rest = members[0], members[1:]
    if not rest:
        return first
    others = [{(k.lower(), v) for k, v in headers} for headers in rest]
    return tuple((k, v) for k, v in first if all((k.lower(), v) in o for o in others))


def merged_call(
    template: Call, body: Any, trace: object | None = None, headers: Headers | None = None
) -> Call:
    """A copy of a member's call carrying ``body`` and ``headers`` (default: the
    template's), asking for an uncompressed answer; its upstream call belongs to ``trace``,
    a traced member's (``Record.trace``), if any."""
    encoded = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
    given = template.headers if headers is None else headers
    headers = tuple((k, v) for k, v in given if k.lower() != "accept-encoding")
    return dataclasses.replace(
        template,
        body=encoded,
        json=body if template.json is not None else None,
        headers=(*headers, ("Accept-Encoding", "identity")),
        # The merged call is no client's: its members' records are theirs.
        record=Record(trace=trace) if trace is not None else None,
    )


def _reply(answer: Answer, item: _Item, backend: str) -> Reply:
    if answer.split:
        kept = tuple((k, v) for k, v in item.headers if k.lower() not in _SPLIT_DROPS)
        headers: Headers = (*kept, ("Content-Type", answer.content_type))
    else:
        headers = item.headers or (("Content-Type", answer.content_type),)
    return Reply(answer.status, headers, body=answer.body, backend=item.backend or backend)


def _parse(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None


class RouteObserver:
    """The batcher's reports as the route's ``gateway_batch_*`` series."""

    def __init__(self, metrics: Metrics, route: str) -> None:
        self._size = metrics.batch_size.labels(route)
        self._wait = metrics.batch_wait.labels(route)
        self._limit = metrics.batch_limit.labels(route)
        self._splits = {r: metrics.batch_splits.labels(route, r) for r in SPLIT_REASONS}
        self._ooms = metrics.batch_oom_backoffs.labels(route)

    def batch_sent(self, items: int) -> None:
        self._size.observe(items)

    def waited(self, seconds: float) -> None:
        self._wait.observe(seconds)

    def limit_changed(self, limit: int) -> None:
        self._limit.set(limit)

    def split(self, reason: str) -> None:
        self._splits[reason].inc()

    def oom_backoff(self) -> None:
        self._ooms.inc()


def build(policy: Policy, runtime: Runtime) -> list[Stage]:
    """The batch stage for ``policy``, or none when no route batches."""
    batchers: dict[BatcherKey, Batcher] = {}
    for route in policy.routes:
        if route.batch is None:
            continue
        slots = policy.backend(route.backend).max_concurrency or DEFAULT_SLOTS
        for adapter in route_adapters(route):
            name = f"{route.name} {route.backend} {adapter.name}"
            # A batch's bisection ends when a caller alone would have timed out.
            deadline_s = policy.backend(route.backend).timeout_s
            make = _factory(name, route, route.batch, adapter, slots, runtime, deadline_s)
            batchers[(route.name, route.backend, adapter.name)] = runtime.registry.get(
                BATCHERS, name, (route.batch, slots, deadline_s), make
            )
    return [BatchStage(batchers)] if batchers else []


def route_adapters(route: Route) -> tuple[Adapter, ...]:
    """The adapters a route's requests may need: the one its exact path has, or all."""
    path = route.match.path
    if _GLOB_CHARS.isdisjoint(path):
        adapter = adapter_for(path)
        return (adapter,) if adapter is not None else ()
    return ADAPTERS


def _factory(
    name: str,
    route: Route,
    batch: Batch,
    adapter: Adapter,
    slots: int,
    runtime: Runtime,
    deadline_s: float,
) -> Callable[[], Batcher]:
    def make() -> Batcher:
        observer = RouteObserver(runtime.metrics, route.name)
        limit = CappedLimit(
            _limit(batch, runtime), partial(batch_limit, runtime.registry, route.backend)
        )
        observer.limit_changed(limit.limit)
        return Batcher(
            _ItemAdapter(adapter),
            send,
            name=name,
            limit=limit,
            max_wait_ms=batch.max_wait_ms,
            slots=slots,
            observer=observer,
            clock=runtime.clock,
            sleep=getattr(runtime.clock, "sleep", asyncio.sleep),
            max_in_flight=slots if batch.adaptive is not None else slots + QUEUED_AT_BACKEND,
            deadline_s=deadline_s,
        )

    return make


def _limit(batch: Batch, runtime: Runtime) -> BatchLimit:
    if batch.adaptive is None:
        return FixedLimit(batch.max_size)
    return AimdLimit(batch.max_size, batch.adaptive.target_latency_ms, clock=runtime.clock)
