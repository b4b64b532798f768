"""A call goes to another endpoint of its backend when the one picked did not serve it: a 503
(llama.cpp answers every call 503 while its model loads), a 429 (TGI's own queue full), a
connection reset or a misframed answer, never a timeout; only calls that change nothing,
within a retry budget (``backends.<name>.endpoint_retries``).  Model servers on real
sockets; the official ``openai`` SDK as the client end to end."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.metrics import Metrics
from gateway.pipeline import Reply
from gateway.policy.model import Backend
from gateway.testing import FakeClock
from gateway.transport.calls import MAX_REFUSAL_S, REFUSAL_S, refusal_s
from gateway.transport.endpoints import EndpointSet
from tests.helpers import chat, metric, policy, problems_of, until, write_policy

LOADING = {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
OVERLOADED = {"error": "Model is overloaded", "error_type": "overloaded"}  # TGI's 429
EMBED = json.dumps({"model": "m", "input": "hello"}).encode()


class Server:
    """A model server answering ``status`` with ``error`` (200: an answer naming it), or
    holding every call while ``gate`` is closed."""

    def __init__(self, name: str, status: int = 200, error: Any = None) -> None:
        self.name, self.status, self.error = name, status, error
        self.calls: list[str] = []
        self.gate: asyncio.Event | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(request.path)
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.json_response(self.error or {"error": self.name}, status=self.status)
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            delta = {"choices": [{"index": 0, "delta": {"content": self.name}}]}
            await stream.write(f"data: {json.dumps(delta)}\n\ndata: [DONE]\n\n".encode())
            return stream
        message = {"role": "assistant", "content": self.name}
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 1,
                "model": self.name,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )


async def fleet(serve_app: Any, *servers: Server, **backend: Any) -> tuple[Backend, EndpointSet]:
    """The servers as one backend's endpoints, on a clock of the test's
    (``endpoints._clock``)."""
    urls = tuple([await serve_app(s.app()) for s in servers])
    made = Backend("m", endpoints=urls, balance="round_robin", **backend)
    return made, EndpointSet(made, Metrics(), clock=FakeClock())


def later(endpoints: EndpointSet, seconds: float = REFUSAL_S) -> None:
    clock = endpoints._clock
    assert isinstance(clock, FakeClock)
    clock.advance(seconds)


async def send(
    endpoints: EndpointSet,
    backend: Backend,
    path: str = "/v1/embeddings",
    headers: list[tuple[str, str]] | None = None,
    streaming: bool = False,
) -> Any:
    """One call whose first pick is the first server (round robin from the start)."""
    endpoints._next = len(endpoints.endpoints) - 1
    body = json.dumps({"model": "m", "stream": streaming}).encode()
    return await endpoints.send(backend, "POST", path, headers or [], body, streaming=streaming)


def retries(endpoints: EndpointSet, reason: str, outcome: str = "sent") -> float:
    return float(endpoints._metrics.endpoint_retries.labels("m", reason, outcome)._value.get())


async def test_a_replica_still_loading_its_model_passes_its_calls_to_another(serve_app):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    reply = await send(endpoints, backend)
    assert reply.status == 200 and json.loads(reply.body)["model"] == "ready"
    assert (len(loading.calls), len(ready.calls)) == (1, 1)
    assert retries(endpoints, "upstream_503") == 1


async def test_a_replica_whose_own_queue_is_full_passes_its_calls_to_another(serve_app):
    full, free = Server("full", 429, OVERLOADED), Server("free")
    backend, endpoints = await fleet(serve_app, full, free)
    assert (await send(endpoints, backend, "/v1/chat/completions")).status == 200
    assert retries(endpoints, "upstream_429") == 1


async def test_a_streamed_call_is_retried_before_any_byte_of_it_left(serve_app):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    reply = await send(endpoints, backend, "/v1/chat/completions", streaming=True)
    assert reply.status == 200
    assert reply.stream is not None
    relayed = b"".join([chunk async for chunk in reply.stream])
    assert b'"ready"' in relayed
    assert reply.close is not None
    await reply.close()
    await until(lambda: endpoints.inflight == 0)  # the 503's connection went back too


async def test_when_no_endpoint_serves_the_call_the_last_answer_is_the_calls(serve_app):
    servers = [Server(f"s{i}", 503, LOADING) for i in range(4)]
    backend, endpoints = await fleet(serve_app, *servers)  # endpoint_retries: 2
    reply = await send(endpoints, backend)
    assert reply.status == 503
    assert sum(len(s.calls) for s in servers) == 3  # the first and two more
    assert retries(endpoints, "upstream_503") == 2
    await until(lambda: endpoints.inflight == 0)


async def test_endpoint_retries_0_and_a_spent_budget_let_the_503_through(serve_app):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready, endpoint_retries=0)
    assert (await send(endpoints, backend)).status == 503
    assert ready.calls == []

    backend, endpoints = await fleet(serve_app, loading, ready)
    endpoints.calls.saved = 0.0  # this call earns a fifth of a retry: not one
    assert (await send(endpoints, backend)).status == 503
    assert retries(endpoints, "upstream_503", "budget") == 1
    later(endpoints)
    assert (await send(endpoints, backend)).status == 503  # two fifths
    for _ in range(3):  # a fifth each: a whole retry once the fifth call is in
        later(endpoints)
        await send(endpoints, backend)
    assert ready.calls == ["/v1/embeddings"]


async def test_the_budget_is_the_backends_endpoint_retry_budget(serve_app):
    """Half a retry a call: the second call with nothing saved goes on; with a budget of 0
    none does, whatever was asked, not even the retries a backend starts with."""
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready, endpoint_retry_budget=0.5)
    endpoints.calls.saved = 0.0
    assert (await send(endpoints, backend)).status == 503  # half a retry: not one
    later(endpoints)
    assert (await send(endpoints, backend)).status == 200  # a whole one
    backend, endpoints = await fleet(serve_app, loading, ready, endpoint_retry_budget=0)
    assert endpoints.calls.saved == 10.0  # saved up at the start, as a backend starts
    for _ in range(5):
        later(endpoints)
        assert (await send(endpoints, backend)).status == 503
    assert retries(endpoints, "upstream_503", "budget") == 5


def test_the_retry_budget_is_a_share_of_the_calls():
    for given in (-0.1, 1.5):
        text = json.dumps(
            {
                "backends": {
                    "m": {"endpoints": ["http://a", "http://b"], "endpoint_retry_budget": given}
                },
                "routes": [{"backend": "m"}],
            }
        )
        problem = "backends.m.endpoint_retry_budget: must be between 0 and 1"
        assert any(problem in p for p in problems_of(text))


async def test_an_endpoint_that_refused_gets_calls_only_after_the_others_for_a_while(
    serve_app,
):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    await send(endpoints, backend)
    for _ in range(3):  # round robin would pick the loading one first: it is refusing
        await send(endpoints, backend)
    assert (len(loading.calls), len(ready.calls)) == (1, 4)
    later(endpoints)  # a second on: it is asked again (its model may be in by now)
    loading.status = 200
    assert json.loads((await send(endpoints, backend)).body)["model"] == "loading"

    loading.status, ready.status = 503, 503  # both refusing: both are still asked
    reply = await send(endpoints, backend)
    assert reply.status == 503
    assert (len(loading.calls), len(ready.calls)) == (3, 5)
    reply = await send(endpoints, backend)
    assert (len(loading.calls), len(ready.calls)) == (4, 6)


async def test_a_refusals_retry_after_is_honoured_within_bounds(serve_app):
    loading = Server("loading", 503, LOADING)
    backend, endpoints = await fleet(serve_app, loading, Server("ready"))
    retry_after = {"": REFUSAL_S, "7": 7.0, "86400": MAX_REFUSAL_S, "soon": REFUSAL_S}
    for given, seconds in retry_after.items():
        reply = Reply(503, (("Retry-After", given),) if given else ())
        assert refusal_s(reply) == seconds
    hostile = ["١٢", "²", "9" * 4000, "-5", "1e9", " 3 ", "Wed, 21 Oct 2026 07:28:00 GMT"]
    # non-ASCII digits, a number of 4,000 digits, a sign, a float, an HTTP date: all bounded
    assert [refusal_s(Reply(503, (("Retry-After", h),))) for h in hostile] == [
        REFUSAL_S,
        REFUSAL_S,
        MAX_REFUSAL_S,
        REFUSAL_S,
        REFUSAL_S,
        3.0,
        REFUSAL_S,
    ]
    await send(endpoints, backend)
    assert endpoints.endpoints[0].refused_until == endpoints._clock.now() + REFUSAL_S


async def test_a_429_is_retried_but_steers_no_other_call_away(serve_app):
    """A 429 may be one caller's own limit (a hosted API counting each client's key): the
    call goes elsewhere, the endpoint keeps its share of everyone else's."""
    full, free = Server("full", 429, OVERLOADED), Server("free")
    backend, endpoints = await fleet(serve_app, full, free)
    assert (await send(endpoints, backend)).status == 200
    assert endpoints.endpoints[0].refused_until == 0.0
    full.status = 200
    reply = await send(endpoints, backend)  # round robin picks it first again, and it serves
    assert json.loads(reply.body)["model"] == "full"


async def test_only_calls_that_change_nothing_go_to_another_endpoint(serve_app):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    assert (await send(endpoints, backend, "/v1/files")).status == 503
    assert ready.calls == []
    keyed = [("Idempotency-Key", "upload-1")]  # may be sent again, one after the other
    assert (await send(endpoints, backend, "/v1/files", keyed)).status == 200
    assert ready.calls == ["/v1/files"]


@pytest.mark.parametrize(
    "path",
    [
        "/completion",  # llama.cpp's own API: its 503 while loading is what this is for
        "/infill",
        "/embedding",
        "/tokenize",
        "/api/chat",  # Ollama's
        "/api/generate",
        "/api/embed",
        "/generate_stream",  # TGI's
        "/",  # TGI's compatibility route, where its Python clients post
        "/invocations",  # SageMaker's route (vLLM's, TGI's)
        "/vertex",  # TGI's Vertex AI route
        "/inference/v1/generate",  # vLLM's tokens in, tokens out
        "/v2/models/m/generate",  # Triton's generate extension
        "/v2/models/m/versions/2/generate_stream",
        "/v1/models/m:classify",  # TF Serving's
        "/v1/rerank",  # vLLM's, llama.cpp's
        "/score",
        "/pooling",
    ],
)
async def test_a_servers_own_inference_call_goes_to_another_endpoint(serve_app, path):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    assert (await send(endpoints, backend, path)).status == 200
    assert (loading.calls, ready.calls) == ([path], [path])


@pytest.mark.parametrize(
    "path",
    ["/slots/0", "/lora-adapters", "/props", "/api/pull", "/api/delete", "/v1/load_lora_adapter"],
)
async def test_a_call_that_changes_a_server_stays_on_its_endpoint(serve_app, path):
    """llama.cpp's slot saves and adapter scales, Ollama's pulls, vLLM's adapter loads."""
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    assert (await send(endpoints, backend, path)).status == 503
    assert ready.calls == []


async def test_a_reset_is_retried_for_an_inference_call_and_not_for_another(raw_backend, serve_app):
    reset_url, reset = await raw_backend(lambda exchange: (b"", "reset"))
    ready = Server("ready")
    urls = (reset_url, await serve_app(ready.app()))
    backend = Backend("m", endpoints=urls, balance="round_robin")
    endpoints = EndpointSet(backend, Metrics())
    reply = await send(endpoints, backend)
    assert reply.status == 200
    assert retries(endpoints, "unavailable") == 1
    try:
        await send(endpoints, backend, "/v1/files")
    except UpstreamUnavailable:
        pass
    else:
        raise AssertionError("a reset upload went to another endpoint")
    assert ready.calls == ["/v1/embeddings"]
    assert len(reset.exchanges) == 2


async def test_a_timeout_is_not_retried(serve_app):
    slow, ready = Server("slow"), Server("ready")
    slow.gate = asyncio.Event()
    backend, endpoints = await fleet(serve_app, slow, ready, timeout_s=0.2)
    try:
        await send(endpoints, backend)
    except UpstreamTimeout:
        pass
    else:
        raise AssertionError("the call did not time out")
    assert ready.calls == []
    slow.gate.set()


def test_endpoint_retries_are_checked():
    backends = {"m": {"url": "http://127.0.0.1:1", "endpoint_retries": -1}}
    assert any("endpoint_retries" in p for p in problems_of(json.dumps(policy(backends))))


async def test_the_access_log_names_the_endpoint_that_answered_and_the_calls_made(
    serve_app, start_gateway, tmp_path, capsys
):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    urls = [await serve_app(loading.app()), await serve_app(ready.app())]
    doc = policy(
        {"m": {"endpoints": urls, "balance": "round_robin"}},
        {"coalesce": False},
        server={"access_log": True},
    )
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    async with httpx.AsyncClient() as http:
        for i in range(2):  # round robin: the second picks the loading replica first
            r = await http.post(gw.url + "/v1/chat/completions", json=chat(f"q{i}"))
            assert r.status_code == 200
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert [line["endpoint"] for line in lines] == [urls[1], urls[1]]
    assert [line.get("upstream_attempts") for line in lines] == [None, 2]


async def test_through_the_gateway_the_openai_sdk_never_sees_the_loading_replica(
    serve_app, start_gateway, tmp_path
):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    urls = [await serve_app(loading.app()), await serve_app(ready.app())]
    doc = policy({"m": {"endpoints": urls, "balance": "round_robin"}}, {"coalesce": False})
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    try:
        for i in range(4):
            answer = await client.chat.completions.create(**chat(f"q{i}"))
            assert answer.model == "ready"
    finally:
        await client.close()
    assert len(loading.calls) == 1  # then it was left out: it refuses calls
    async with httpx.AsyncClient() as http:
        text = (await http.get(gw.admin_url + "/metrics")).text
    found = metric(
        text, "gateway_endpoint_retries_total", backend="m", reason="upstream_503", outcome="sent"
    )
    assert found == 1


async def test_a_refusing_endpoint_is_shown_in_its_state_until_it_answers_otherwise(serve_app):
    loading, ready = Server("loading", 503, LOADING), Server("ready")
    backend, endpoints = await fleet(serve_app, loading, ready)
    first = endpoints.endpoints[0]

    def shown(state: str) -> float:
        gauge = endpoints._metrics.endpoint_state.labels("m", first.url, state)
        return float(gauge._value.get())

    assert (shown("active"), shown("refusing")) == (1, 0)
    await send(endpoints, backend)
    assert (shown("active"), shown("refusing")) == (0, 1)
    later(endpoints)
    assert shown("refusing") == 1  # until it is asked again: its last answer was a 503
    loading.status = 200
    await send(endpoints, backend)
    assert (shown("active"), shown("refusing")) == (1, 0)
    assert first.refused_until == 0.0


@pytest.mark.llm
async def test_llama_cpps_own_completion_never_sees_a_replica_still_loading(
    llama, serve_app, start_gateway, tmp_path
):
    """The real server (llama.cpp, Gemma 3 270M) beside one answering as llama.cpp does while
    its weights load: every ``/completion`` is answered by the real one (before, the calls
    sent to the loading one were its 503s)."""
    loading = Server("loading", 503, LOADING)
    urls = [await serve_app(loading.app()), llama.url]
    doc = policy({"m": {"endpoints": urls, "balance": "round_robin"}}, {"match": {"path": "*"}})
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    body = {"prompt": "Once upon a time", "n_predict": 4, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as client:
        answers = [await client.post(gw.url + "/completion", json=body) for _ in range(4)]
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json()["tokens_predicted"] == 4 for a in answers)
    assert loading.calls == ["/completion"]  # then it was left out: it refuses calls
