"""The OpenTelemetry SDK side of tracing: a tracer provider of the gateway's own (the
global one is left alone), a sampler whose ratio a reload changes, the exporter the
``OTEL_*`` variables describe, and the spans of each traced request.

Imported only when a policy turns tracing on; without the ``otel`` extra that import fails
and the app runs without traces.  The SDK reads the standard variables itself:
``OTEL_SERVICE_NAME`` and ``OTEL_RESOURCE_ATTRIBUTES`` (the service is ``sidecar-gateway``
unless they name it), ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``, ``_HEADERS``, ``_TIMEOUT``,
``OTEL_BSP_*`` (the batch processor), ``OTEL_PROPAGATORS`` and ``OTEL_SDK_DISABLED``.
``OTEL_TRACES_EXPORTER`` may be ``otlp`` (the default, OTLP/HTTP protobuf), ``console`` or
``none`` (spans are made and batched, then dropped: what ``bench/bench_proxy.py`` measures).
The sampler is the policy's ``tracing.sample_ratio``, not ``OTEL_TRACES_SAMPLER``.

A request is sampled at the edge (``begin``); one that is not costs the sampling decision
and nothing more: its client's ``traceparent``, if any, goes upstream as it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import random
import threading
import time
from collections.abc import AsyncIterator, Sequence

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, SpanKind, Status, StatusCode
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from gateway import __version__
from gateway.errors import GatewayError
from gateway.pipeline import Call, Handler, Record, Reply
from gateway.tracing.attributes import (
    AnswerFacts,
    child_spans,
    endpoint_attributes,
    request_attributes,
    server_attributes,
    span_name,
)

log = logging.getLogger("gateway.tracing")

SERVICE_NAME = "sidecar-gateway"
CLOSE_TIMEOUT_S = 2.0
"""At exit, how long the spans not yet sent may take (a collector that is down must not
hold the shutdown)."""
EXPORTERS = ("otlp", "console", "none")


class RatioSampler(Sampler):
    """``ParentBased(TraceIdRatioBased(ratio))`` whose ratio may change while it runs: a
    root request is traced with probability ``ratio``; one with a remote parent as its
    parent was.

    ``Tracer.begin`` draws a root request's chance itself, before anything of the SDK runs
    (an unsampled request then costs one random number, not a span and its context, about
    a fifth of the throughput at saturation); the roots that reach the sampler were drawn
    already, and ``decided`` says so."""

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.decided = False

    @property
    def ratio(self) -> float:
        return self._ratio

    @ratio.setter
    def ratio(self, ratio: float) -> None:
        self._ratio = ratio
        self._inner = ParentBased(TraceIdRatioBased(ratio))

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if self.decided:
            return _ROOT_SAMPLED
        return self._inner.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"GatewayRatio{{{self._ratio}}}"


Pairs = Sequence[tuple[str, str]]
_ROOT_SAMPLED = SamplingResult(Decision.RECORD_AND_SAMPLE)


class _HeaderGetter(Getter[Pairs]):
    """Reads a propagator's fields from headers as received (name case ignored)."""

    def get(self, carrier: Pairs, key: str) -> list[str] | None:
        values = [v for k, v in carrier if k.lower() == key]
        return values or None

    def keys(self, carrier: Pairs) -> list[str]:
        return [k for k, _ in carrier]


_GETTER = _HeaderGetter()


class Discard(SpanExporter):
    """Drops every span (``OTEL_TRACES_EXPORTER=none``)."""

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def exporter_from_env() -> SpanExporter:
    """The exporter ``OTEL_TRACES_EXPORTER`` names (default: OTLP over HTTP, protobuf)."""
    name = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip().lower()
    if name == "none":
        return Discard()
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        log.warning("OTEL_TRACES_EXPORTER=%s: the gateway has %s; using otlp", name, EXPORTERS)
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol != "http/protobuf":
        log.warning("OTLP protocol %s: the gateway sends http/protobuf", protocol)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


@dataclasses.dataclass(slots=True, eq=False)
class Trace:
    """One traced request: its server span, the context its children hang from, the clock
    they share (wall-clock ns = ``offset_ns`` + ``perf_counter_ns``), and what the answer
    said."""

    tracer: Tracer
    span: trace.Span
    context: Context
    offset_ns: int
    answer: AnswerFacts = dataclasses.field(default_factory=AnswerFacts)
    error: str | None = None
    """The gateway error the request was answered with (its ``code``)."""

    def watch(self, reply: Reply) -> Reply:
        """``reply`` with its stream read for the answer's facts on the way to the client."""
        if reply.stream is None:
            return reply
        return reply.replace(stream=_watched(reply.stream, self.answer))

    def end(
        self, call: Call | None, reply: Reply | None, status: int, tokens: tuple[int, int] | None
    ) -> None:
        """The request is over (``Tracer.end``)."""
        self.tracer.end(self, call, reply, status, tokens)

    def now_ns(self) -> int:
        return self.offset_ns + time.perf_counter_ns()

    def at_ns(self, perf_s: float) -> int:
        return self.offset_ns + int(perf_s * 1e9)


class Tracer:
    """The spans of the gateway's requests, and where they go.  ``exporter`` replaces the
    one the environment describes (tests: the SDK's ``InMemorySpanExporter``)."""

    def __init__(self, ratio: float, exporter: SpanExporter | None = None) -> None:
        self.sampler = RatioSampler(ratio)
        resource = Resource.create()
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": SERVICE_NAME}))
        self._provider = TracerProvider(
            sampler=self.sampler, resource=resource, shutdown_on_exit=False
        )
        self._provider.add_span_processor(
            BatchSpanProcessor(exporter if exporter is not None else exporter_from_env())
        )
        self._tracer = self._provider.get_tracer("gateway", __version__)
        self._propagator = propagate.get_global_textmap()
        self._fields = frozenset(f.lower() for f in self._propagator.fields)
        self._random = random.random

    @property
    def ratio(self) -> float:
        return self.sampler.ratio

    @ratio.setter
    def ratio(self, ratio: float) -> None:
        self.sampler.ratio = ratio

    # -- the server span ------------------------------------------------------------------
    def begin(self, method: str, path: str, headers: Pairs, request_id: str) -> Trace | None:
        """A request arrived: its trace if it is sampled, else None."""
        sampler = self.sampler
        root = not any(k.lower() in self._fields for k, _ in headers)
        if root and self._random() >= sampler.ratio:
            return None  # the common case: nothing of the SDK runs
        parent = None if root else self._propagator.extract(headers, getter=_GETTER)
        wall_ns, perf_ns = time.time_ns(), time.perf_counter_ns()
        sampler.decided = root
        try:
            span = self._tracer.start_span(method, parent, kind=SpanKind.SERVER, start_time=wall_ns)
        finally:
            sampler.decided = False
        if not span.is_recording():
            return None
        span.set_attributes(
            {"http.request.method": method, "url.path": path, "gateway.request.id": request_id}
        )
        return Trace(self, span, trace.set_span_in_context(span, parent), wall_ns - perf_ns)

    def end(
        self,
        tr: Trace,
        call: Call | None,
        reply: Reply | None,
        status: int,
        tokens: tuple[int, int] | None,
    ) -> None:
        """The request is over: its child spans from the facts recorded, then its own.
        Tracing never fails a request: what goes wrong here is logged."""
        try:
            self._end(tr, call, reply, status, tokens)
        except Exception:
            log.exception("tracing: the span of request %s was not recorded", tr.span)

    def _end(
        self,
        tr: Trace,
        call: Call | None,
        reply: Reply | None,
        status: int,
        tokens: tuple[int, int] | None,
    ) -> None:
        span = tr.span
        record = call.record if call is not None else None
        if record is not None:
            for name, began, ended, attrs in child_spans(record):
                child = self._tracer.start_span(
                    name, tr.context, start_time=tr.at_ns(began), attributes=attrs
                )
                child.end(end_time=tr.at_ns(ended))
        if call is not None and call.json is not None and reply is not None and reply.body:
            tr.answer.read_body(reply.body)
        if call is not None:
            span.update_name(span_name(call, call.method))
        span.set_attributes(server_attributes(call, reply, status, tokens, tr.answer, tr.error))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=tr.now_ns())

    # -- upstream calls -------------------------------------------------------------------
    def forward(self, inner: Handler) -> TracedForward:
        """The pipeline's last handler ``inner`` with a CLIENT span per traced call."""
        return TracedForward(self, inner)

    async def upstream(self, tr: Trace, record: Record, call: Call, inner: Handler) -> Reply:
        """Send ``call`` through ``inner`` inside a CLIENT span whose context goes to the
        backend (``traceparent``, replacing the client's)."""
        span = self._tracer.start_span(
            span_name(call, call.method),
            tr.context,
            kind=SpanKind.CLIENT,
            start_time=tr.now_ns(),
            attributes={**request_attributes(call), "gateway.backend": call.backend},
        )
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, trace.set_span_in_context(span, tr.context))
        headers = (
            *((k, v) for k, v in call.headers if k.lower() not in self._fields),
            *carrier.items(),
        )
        url = call.policy.backend(call.backend).url.rstrip("/")
        try:
            reply = await inner(dataclasses.replace(call, headers=headers))
        except BaseException as exc:
            span.set_attributes(endpoint_attributes(url))
            span.set_attribute(
                "error.type", exc.code if isinstance(exc, GatewayError) else type(exc).__name__
            )
            span.set_status(Status(StatusCode.ERROR))
            span.end(end_time=tr.now_ns())
            raise
        record.endpoint = reply.endpoint or url
        span.set_attributes(endpoint_attributes(record.endpoint))
        span.set_attribute("http.response.status_code", reply.status)
        if reply.status >= 500:
            span.set_attribute("error.type", str(reply.status))
            span.set_status(Status(StatusCode.ERROR))
        return reply.when_done(lambda: span.end(end_time=tr.now_ns()))

    # -- lifecycle ------------------------------------------------------------------------
    def flush(self) -> bool:
        """Send every span ended so far, now (blocks until the exporter is done)."""
        return self._provider.force_flush()

    async def aclose(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Send what is left and stop, waiting at most ``timeout_s`` (in a thread of its own:
        an export to a collector that is down can take the exporter's whole timeout)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def settle() -> None:
            if not done.done():
                done.set_result(None)

        def run() -> None:
            try:
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(settle)

        threading.Thread(target=run, name="gateway-tracing-close", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await done

    def __repr__(self) -> str:
        return f"<Tracer ratio={self.ratio:g} {self.sampler.get_description()}>"


class TracedForward:
    """The last handler, with a CLIENT span around each call of a traced request."""

    def __init__(self, tracer: Tracer, inner: Handler) -> None:
        self._tracer = tracer
        self._inner = inner

    async def __call__(self, call: Call) -> Reply:
        record = call.record
        if record is None or not isinstance(record.trace, Trace):
            return await self._inner(call)
        return await self._tracer.upstream(record.trace, record, call, self._inner)

    def __repr__(self) -> str:
        return f"<TracedForward {self._tracer!r} inner={self._inner!r}>"


async def _watched(stream: AsyncIterator[bytes], facts: AnswerFacts) -> AsyncIterator[bytes]:
    async for chunk in stream:
        facts.feed(chunk)
        yield chunk
