"""Request traces (the ``otel`` extra): one SERVER span per request with the GenAI
attributes and the gateway's own, child spans for the cache lookup, the admission queue,
the batch wait and each upstream call, ``traceparent`` to the backend and from the client,
the policy's ``tracing.sample_ratio`` (reloadable), and spans over OTLP/HTTP to a collector.

The spans are read with the SDK's own ``InMemorySpanExporter`` (the exporter is the
boundary), except in the end-to-end test, where a local OTLP/HTTP receiver decodes them."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.batching.stage import BATCHERS
from gateway.testing import json_reply
from gateway.testing.harness import Pipeline
from tests.helpers import until, write_policy
from tests.upstreams import Recorder

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


def policy(route: str = "", ratio: float = 1.0, backend: str = "") -> str:
    extra = f", {route}" if route else ""
    more = f", {backend}" if backend else ""
    return f"""
    backends: {{main: {{url: "http://main.test:8000"{more}}}, spare: {{url: "http://spare.test"}}}}
    routes: [{{name: chat, match: {{path: "/v1/*"}}, backend: main{extra}}}]
    tracing: {{sample_ratio: {ratio:.12f}}}
    """


def answer(model: str = "m-served", finish: str = "stop") -> dict[str, Any]:
    return {
        "id": "chatcmpl-7",
        "object": "chat.completion",
        "model": model,
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": finish}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }


@pytest.fixture
def exporter() -> Any:
    memory = pytest.importorskip("opentelemetry.sdk.trace.export.in_memory_span_exporter")
    return memory.InMemorySpanExporter()


def finished(gateway: Any, exporter: Any) -> list[Any]:
    """The spans ended so far, once the batch processor has handed them over."""
    if gateway.tracer is not None:
        assert gateway.tracer.flush()
    return list(exporter.get_finished_spans())


def server_spans(spans: list[Any]) -> list[Any]:
    return [s for s in spans if s.kind.name == "SERVER"]


def children(spans: list[Any], parent: Any) -> dict[str, Any]:
    """The spans whose parent is ``parent``, by kind (CLIENT) or else by name."""
    return {
        (s.kind.name if s.kind.name == "CLIENT" else s.name): s
        for s in spans
        if s.parent is not None and s.parent.span_id == parent.context.span_id
    }


async def test_a_chat_request_makes_one_server_span_with_genai_attributes_and_children(
    pipeline, exporter
):
    gw = await pipeline(
        policy("cache: {ttl_s: 60}"), lambda sent: json_reply(answer()), span_exporter=exporter
    )
    reply = await gw.post("/v1/chat/completions", CHAT, headers={"X-Request-ID": "req-1"})
    assert reply.status_code == 200

    spans = finished(gw.gateway, exporter)
    [server] = server_spans(spans)
    assert server.name == "chat m"
    attrs = dict(server.attributes)
    assert {
        "gen_ai.operation.name": "chat",
        "gen_ai.request.model": "m",
        "gen_ai.response.model": "m-served",
        "gen_ai.response.id": "chatcmpl-7",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": 5,
        "gen_ai.usage.output_tokens": 2,
        "server.address": "main.test",
        "server.port": 8000,
        "http.request.method": "POST",
        "http.response.status_code": 200,
        "gateway.request.id": "req-1",
        "gateway.route": "chat",
        "gateway.backend": "main",
        "gateway.endpoint": "http://main.test:8000",
        "gateway.cache.result": "miss",
        "gateway.coalesced": False,
    }.items() <= attrs.items()
    kids = children(spans, server)
    assert set(kids) == {"cache lookup", "CLIENT"}
    upstream = kids["CLIENT"]
    assert upstream.name == "chat m"
    assert upstream.attributes["server.address"] == "main.test"
    assert upstream.attributes["http.response.status_code"] == 200
    assert dict(kids["cache lookup"].attributes) == {"gateway.cache.result": "miss"}
    for child in kids.values():
        assert server.start_time <= child.start_time <= child.end_time <= server.end_time
    assert len(spans) == 3


async def test_a_cache_hit_span_says_the_tier_and_has_no_upstream_call(pipeline, exporter):
    gw = await pipeline(
        policy("cache: {ttl_s: 60}"), lambda sent: json_reply(answer()), span_exporter=exporter
    )
    await gw.post("/v1/chat/completions", CHAT)
    hit = await gw.post("/v1/chat/completions", CHAT)
    assert hit.headers["X-Gateway-Cache"] == "hit"

    spans = finished(gw.gateway, exporter)
    second = server_spans(spans)[-1]
    assert second.attributes["gateway.cache.result"] == "hit"
    assert second.attributes["gateway.cache.tier"] == "exact"
    assert second.attributes["gen_ai.response.model"] == "m-served"  # read from the stored answer
    assert "server.address" not in second.attributes
    kids = children(spans, second)
    assert set(kids) == {"cache lookup"}
    assert kids["cache lookup"].attributes["gateway.cache.tier"] == "exact"


async def test_the_backend_gets_a_traceparent_of_the_upstream_span_in_the_same_trace(
    serve_app, start_gateway, tmp_path, exporter
):
    rec = Recorder()
    url = await serve_app(rec.app())
    path = write_policy(tmp_path, policy().replace("http://main.test:8000", url))
    gw = await start_gateway(policy=path, span_exporter=exporter)
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200

    spans = finished(gw.gateway, exporter)
    [server] = server_spans(spans)
    upstream = children(spans, server)["CLIENT"]
    version, trace_id, parent_id, flags = rec.seen[0].headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # sampled
    assert int(trace_id, 16) == server.context.trace_id == upstream.context.trace_id
    assert int(parent_id, 16) == upstream.context.span_id
    assert upstream.attributes["server.port"] == int(url.rsplit(":", 1)[1])


async def test_an_incoming_traceparent_is_continued_whatever_the_ratio(pipeline, exporter):
    gw = await pipeline(
        policy(ratio=1e-9), lambda sent: json_reply(answer()), span_exporter=exporter
    )
    incoming = f"00-{TRACE_ID}-{PARENT_ID}-01"
    await gw.post(
        "/v1/chat/completions", CHAT, headers={"traceparent": incoming, "tracestate": "v=1"}
    )

    [server] = server_spans(finished(gw.gateway, exporter))
    assert server.context.trace_id == int(TRACE_ID, 16)
    assert server.parent.span_id == int(PARENT_ID, 16) and server.parent.is_remote
    [sent] = gw.transport.to("main")
    assert [k for k, _ in sent.headers].count("traceparent") == 1  # replaced, not added
    assert sent.header("traceparent").split("-")[1] == TRACE_ID
    assert sent.header("traceparent") != incoming
    assert sent.header("tracestate") == "v=1"


async def test_a_caller_that_did_not_sample_is_followed_and_its_traceparent_passes_as_is(
    pipeline, exporter
):
    gw = await pipeline(policy(), lambda sent: json_reply(answer()), span_exporter=exporter)
    incoming = f"00-{TRACE_ID}-{PARENT_ID}-00"
    await gw.post("/v1/chat/completions", CHAT, headers={"traceparent": incoming})

    assert finished(gw.gateway, exporter) == []
    assert gw.transport.to("main")[0].header("traceparent") == incoming


@pytest.mark.parametrize(
    "header",
    ["garbage", "00-" + "0" * 32 + "-" + "0" * 16 + "-01", "ff-zz-yy-01", "00-" + "a" * 999],
)
async def test_a_broken_traceparent_is_a_new_root_and_the_request_answers(
    pipeline, exporter, header
):
    """A caller's malformed or all-zero traceparent is ignored (a root: at ratio 1, a trace
    of its own), never an error; the backend gets the gateway's traceparent, not it."""
    gw = await pipeline(policy(), lambda sent: json_reply(answer()), span_exporter=exporter)
    r = await gw.post("/v1/chat/completions", CHAT, headers={"traceparent": header})

    assert r.status_code == 200
    [server] = server_spans(finished(gw.gateway, exporter))
    assert server.parent is None
    sent = gw.transport.to("main")[0].header("traceparent")
    assert sent is not None and sent != header
    assert sent.split("-")[1] == format(server.context.trace_id, "032x")


async def test_sample_ratio_0_makes_no_spans_and_no_tracer(pipeline, exporter):
    gw = await pipeline(policy(ratio=0), lambda sent: json_reply(answer()), span_exporter=exporter)
    await gw.post("/v1/chat/completions", CHAT)

    assert gw.gateway.tracer is None and gw.gateway.snapshot.tracer is None
    assert finished(gw.gateway, exporter) == []
    assert gw.transport.to("main")[0].header("traceparent") is None


async def test_a_reload_changes_the_sample_ratio_without_a_restart(tmp_path, exporter):
    path = write_policy(tmp_path, policy(ratio=0))
    async with Pipeline(path, lambda sent: json_reply(answer()), span_exporter=exporter) as gw:
        await gw.post("/v1/chat/completions", CHAT)
        assert finished(gw.gateway, exporter) == []

        write_policy(tmp_path, policy(ratio=1))
        assert gw.gateway.reload()
        await gw.post("/v1/chat/completions", CHAT)
        assert len(server_spans(finished(gw.gateway, exporter))) == 1
        tracer = gw.gateway.tracer
        assert tracer is not None

        write_policy(tmp_path, policy(ratio=0.25))
        assert gw.gateway.reload()
        assert gw.gateway.tracer is tracer and tracer.ratio == 0.25
        assert repr(tracer) == "<Tracer ratio=0.25 GatewayRatio{0.25}>"

        write_policy(tmp_path, policy(ratio=0))
        assert gw.gateway.reload()
        await gw.post("/v1/chat/completions", CHAT)
        assert len(server_spans(finished(gw.gateway, exporter))) == 1  # none added


async def test_a_root_request_is_traced_at_the_ratio_drawn_once_before_the_sdk(pipeline, exporter):
    """At 0.25, a quarter of 400 root requests are traced (not a sixteenth: the edge's draw
    and the sampler's do not both apply), each sampled one with its backend's traceparent,
    an unsampled one with none."""
    gw = await pipeline(
        policy(ratio=0.25), lambda sent: json_reply(answer()), span_exporter=exporter
    )
    for _ in range(400):
        await gw.post("/v1/chat/completions", CHAT)
    traced = len(server_spans(finished(gw.gateway, exporter)))
    assert 60 <= traced <= 140  # binomial(400, 0.25): mean 100, sd 8.7
    sent = [r.header("traceparent") for r in gw.transport.to("main")]
    assert sum(tp is not None for tp in sent) == traced


def test_the_sampler_reads_the_ratio_it_has_now():
    pytest.importorskip("opentelemetry.sdk")
    from gateway.tracing.otel import RatioSampler

    low, high = 1, (1 << 64) - 1  # the ratio sampler reads a trace id's low 64 bits
    sampler = RatioSampler(0.5)
    assert sampler.should_sample(None, low, "chat").decision.is_sampled()
    assert not sampler.should_sample(None, high, "chat").decision.is_sampled()
    sampler.ratio = 1.0
    assert sampler.should_sample(None, high, "chat").decision.is_sampled()
    sampler.ratio = 1e-9
    assert not sampler.should_sample(None, 1 << 40, "chat").decision.is_sampled()


async def test_a_stream_span_ends_with_the_stream_and_reads_its_model_and_finish_reason(
    serve_app, start_gateway, tmp_path, exporter
):
    rec = Recorder()
    url = await serve_app(rec.app())
    path = write_policy(tmp_path, policy().replace("http://main.test:8000", url))
    gw = await start_gateway(policy=path, span_exporter=exporter)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")

    await until(lambda: len(finished(gw.gateway, exporter)) == 2)
    spans = finished(gw.gateway, exporter)
    [server] = server_spans(spans)
    upstream = children(spans, server)["CLIENT"]
    assert server.attributes["gen_ai.response.model"] == "m"
    assert server.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert server.attributes["gen_ai.usage.output_tokens"] == 2
    assert upstream.end_time <= server.end_time


async def test_a_failed_upstream_call_is_an_error_and_the_fallback_says_why(pipeline, exporter):
    gw = await pipeline(
        policy("fallback: [spare]"),
        {
            "main": lambda sent: json_reply({"error": {"message": "busy"}}, status=503),
            "spare": lambda sent: json_reply(answer("spare-model")),
        },
        span_exporter=exporter,
    )
    reply = await gw.post("/v1/chat/completions", CHAT)
    assert reply.status_code == 200

    spans = finished(gw.gateway, exporter)
    [server] = server_spans(spans)
    assert server.attributes["gateway.fallback.reason"] == "upstream_5xx"
    assert server.attributes["gateway.backend"] == "spare"
    assert server.attributes["server.address"] == "spare.test"
    calls = sorted((s for s in spans if s.kind.name == "CLIENT"), key=lambda s: s.start_time)
    assert [c.attributes["gateway.backend"] for c in calls] == ["main", "spare"]
    assert calls[0].status.status_code.name == "ERROR"
    assert calls[0].attributes["error.type"] == "503"
    assert calls[1].status.status_code.name == "UNSET"


async def test_a_call_too_long_for_the_context_and_one_clamped_say_so(pipeline, exporter):
    """The span of a call moved to a longer context names the reason; one whose bound the
    route set names what it did and the bound it was sent with."""
    refusal = {"error": {"type": "exceed_context_size_error", "message": "too long"}}
    gw = await pipeline(
        policy("context_fallback: [spare], generation: {max_tokens: 8}"),
        {
            "main": lambda sent: json_reply(refusal, status=400),
            "spare": lambda sent: json_reply(answer("spare-model")),
        },
        span_exporter=exporter,
    )
    assert (await gw.post("/v1/chat/completions", {**CHAT, "max_tokens": 99})).status_code == 200
    [server] = server_spans(finished(gw.gateway, exporter))
    assert server.attributes["gateway.fallback.reason"] == "context_length"
    assert server.attributes["gateway.backend"] == "spare"
    assert server.attributes["gateway.generation.action"] == "clamped"
    assert server.attributes["gateway.generation.max_tokens"] == 8


async def test_an_unreachable_backend_makes_an_error_span_with_the_gateway_error(
    pipeline, exporter
):
    from gateway.errors import UpstreamUnavailable

    def refuse(sent: Any) -> Any:
        raise UpstreamUnavailable("connection refused", "main")

    gw = await pipeline(policy(), refuse, span_exporter=exporter)
    reply = await gw.post("/v1/chat/completions", CHAT)
    assert reply.status_code == 502

    spans = finished(gw.gateway, exporter)
    [server] = server_spans(spans)
    upstream = children(spans, server)["CLIENT"]
    code = UpstreamUnavailable.code
    assert server.attributes["error.type"] == upstream.attributes["error.type"] == code
    assert server.status.status_code.name == upstream.status.status_code.name == "ERROR"


async def test_a_call_that_queued_for_admission_has_a_queue_wait_span(pipeline, exporter):
    gate = asyncio.Event()

    async def held(sent: Any) -> Any:
        await gate.wait()
        return json_reply(answer())

    gw = await pipeline(policy(backend="max_concurrency: 1"), held, span_exporter=exporter)
    first = gw.send("POST", "/v1/chat/completions", json=CHAT)
    await until(lambda: len(gw.transport.sent) == 1)
    second = gw.send("POST", "/v1/chat/completions", json=CHAT)
    await until(lambda: gw.metric("gateway_queue_depth", backend="main") == 1)
    gate.set()
    await first.done()
    await second.done()

    spans = finished(gw.gateway, exporter)
    waits = [s for s in spans if s.name == "queue wait"]
    assert len(waits) == 2  # each call took a slot; the second waited for it
    waited = max(server_spans(spans), key=lambda s: s.attributes["gateway.queue.wait_ms"])
    assert waited.attributes["gateway.queue.wait_ms"] > 0
    assert "queue wait" in children(spans, waited)


async def test_batched_calls_have_a_batch_wait_span_and_the_merged_call_one_trace(
    pipeline, exporter
):
    gate = asyncio.Event()

    async def embed(sent: Any) -> Any:
        await gate.wait()
        inputs = sent.json()["input"]
        inputs = inputs if isinstance(inputs, list) else [inputs]
        data = [{"object": "embedding", "index": i, "embedding": [0.5]} for i in range(len(inputs))]
        return json_reply({"object": "list", "data": data, "model": "e5"})

    gw = await pipeline(
        policy("batch: {max_size: 8, max_wait_ms: 600000}"), embed, span_exporter=exporter
    )
    body = lambda text: {"model": "e", "input": text}  # noqa: E731
    first = gw.send("POST", "/v1/embeddings", json=body("a"))
    await until(lambda: len(gw.transport.sent) == 1)
    more = [gw.send("POST", "/v1/embeddings", json=body(t)) for t in ("b", "c")]
    batchers = gw.gateway.registry.items(BATCHERS)
    await until(lambda: sum(b.waiting for _, b in batchers) == 2)  # the backend is held
    gate.set()
    for exchange in (first, *more):
        assert (await exchange.done()).status_code == 200

    spans = finished(gw.gateway, exporter)
    servers = server_spans(spans)
    assert {s.name for s in servers} == {"embeddings e"}
    sizes = sorted(s.attributes["gateway.batch.size"] for s in servers)
    assert sizes == [1, 2, 2]
    batched = [s for s in servers if s.attributes["gateway.batch.size"] == 2]
    assert all("batch wait" in children(spans, s) for s in batched)
    merged = [s for s in spans if s.kind.name == "CLIENT"]
    assert len(merged) == 2  # the first call's own, and the merged call's in one member's trace
    traces = {s.context.trace_id for s in batched}
    assert any(c.context.trace_id in traces for c in merged)


async def test_a_request_refused_before_routing_still_has_its_span(pipeline, exporter):
    gw = await pipeline(policy(), lambda sent: json_reply(answer()), span_exporter=exporter)
    reply = await gw.request("POST", "/v1/chat/completions", body=b"{not json")
    assert reply.status_code == 400

    [server] = server_spans(finished(gw.gateway, exporter))
    assert server.name == "POST"
    assert server.attributes["http.response.status_code"] == 400
    assert server.attributes["error.type"] == "invalid_json"  # the error's code
    assert server.status.status_code.name == "UNSET"  # a 4xx is the client's failure


async def test_without_opentelemetry_the_gateway_runs_untraced(pipeline, monkeypatch, caplog):
    """The ``otel`` extra missing: a policy asking for traces gets a warning, not a failure."""
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # `import opentelemetry` fails
    monkeypatch.delitem(sys.modules, "gateway.tracing.otel", raising=False)
    gw = await pipeline(policy(), lambda sent: json_reply(answer()))
    reply = await gw.post("/v1/chat/completions", CHAT)

    assert reply.status_code == 200 and gw.gateway.tracer is None
    assert gw.transport.to("main")[0].header("traceparent") is None
    assert "OpenTelemetry is not installed" in caplog.text


async def test_spans_reach_an_otlp_http_collector(serve_app, start_gateway, tmp_path, monkeypatch):
    """End to end: the OTLP/HTTP exporter the ``OTEL_*`` variables configure sends the
    request's spans, protobuf-encoded, to a collector on 127.0.0.1."""
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[ExportTraceServiceRequest] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        received.append(message)
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", traces)
    collector_url = await serve_app(collector)
    rec = Recorder()
    backend_url = await serve_app(rec.app())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector_url)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "gateway-under-test")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    path = write_policy(tmp_path, policy().replace("http://main.test:8000", backend_url))
    gw = await start_gateway(policy=path)
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "llama-3"})
    assert r.status_code == 200
    # The exporter posts from this thread and the collector answers on the loop: off it.
    assert await asyncio.to_thread(gw.gateway.tracer.flush)

    spans = [
        (resource.resource, span)
        for message in received
        for resource in message.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    names = {span.name: (resource, span) for resource, span in spans}
    assert set(names) == {"chat llama-3"} and len(spans) == 2  # the server and the client span
    server = next(s for _, s in spans if s.kind == s.SPAN_KIND_SERVER)
    attrs = {a.key: a.value for a in server.attributes}
    assert attrs["gen_ai.operation.name"].string_value == "chat"
    assert attrs["gen_ai.request.model"].string_value == "llama-3"
    assert attrs["gen_ai.usage.input_tokens"].int_value == 3
    assert attrs["gateway.route"].string_value == "chat"
    reasons = [v.string_value for v in attrs["gen_ai.response.finish_reasons"].array_value.values]
    assert reasons == ["stop"]
    resource = {a.key: a.value.string_value for a in spans[0][0].attributes}
    assert resource["service.name"] == "gateway-under-test"
    traceparent = rec.seen[0].headers["traceparent"]
    assert traceparent.split("-")[1] == server.trace_id.hex()


def test_an_endpoints_attributes_never_carry_its_urls_credentials():
    from gateway.tracing.attributes import endpoint_attributes

    attrs = endpoint_attributes("http://svc-user:hunter2@10.0.0.7:8000")
    assert attrs == {
        "gateway.endpoint": "http://***@10.0.0.7:8000",
        "server.address": "10.0.0.7",
        "server.port": 8000,
    }
