"""Hedged requests (``backends.<name>.hedge``): a call one endpoint is slow to answer goes to
a second endpoint as well, and the first good answer wins, the other call cancelled.  Model
servers on real sockets; the official ``openai`` SDK as the client end to end."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import yaml
from aiohttp import web

from gateway.metrics import Metrics
from gateway.policy import load_policy
from gateway.policy.hedge import Hedge
from gateway.policy.load import parse_policy_text
from gateway.policy.model import Backend
from gateway.transport import hedge as hedging
from gateway.transport.endpoints import EndpointSet
from tests.helpers import metric, policy, problems_of, until, write_policy

EMBED = json.dumps({"model": "m", "input": "hello"}).encode()


class Server:
    """A model server that names itself in its answers; ``gate``, when set, holds every
    answer until it opens; ``status`` is what it answers.  It counts the calls whose client
    left before the answer (``left``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.left = 0
        self.gate: asyncio.Event | None = None
        self.status = 200

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.answer)
        app.router.add_post("/v1/chat/completions", self.answer)
        app.router.add_post("/admin/reset", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls += 1
        stream = None
        if body.get("stream"):  # the head at once, as vLLM sends it; the first token later
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
        try:
            if self.gate is not None:
                await self.gate.wait()
        except asyncio.CancelledError:
            self.left += 1
            raise
        if stream is not None:
            delta = {"choices": [{"index": 0, "delta": {"content": self.name}}]}
            await stream.write(f"data: {json.dumps(delta)}\n\ndata: [DONE]\n\n".encode())
            return stream
        if self.status != 200:
            return web.json_response({"error": {"message": self.name}}, status=self.status)
        data = [{"object": "embedding", "index": 0, "embedding": [0.6, 0.8]}]
        return web.json_response(
            {"object": "list", "data": data, "model": self.name, "usage": {"prompt_tokens": 1}}
        )


async def pair(serve_app: Any, **hedge: Any) -> tuple[Server, Server, Backend, EndpointSet]:
    """A fast and a slow server behind one backend; round robin picks the slow one first."""
    fast, slow = Server("fast"), Server("slow")
    urls = (await serve_app(fast.app()), await serve_app(slow.app()))
    backend = Backend(
        "m", endpoints=urls, balance="round_robin", hedge=Hedge(**{"after_ms": 30, **hedge})
    )
    return fast, slow, backend, EndpointSet(backend, Metrics())


async def send(endpoints: EndpointSet, backend: Backend) -> Any:
    """An embedding call, whose first pick is the slow server (round robin from the start)."""
    endpoints._next = 0
    reply = await endpoints.send(backend, "POST", "/v1/embeddings", [], EMBED, streaming=False)
    return reply.status, json.loads(reply.body or b"{}").get("model")


def counted(endpoints: EndpointSet, outcome: str, kind: str = "answer") -> float:
    value = endpoints._metrics.hedges.labels("m", kind, outcome)._value.get()
    return float(value)


async def test_a_slow_endpoints_call_is_hedged_to_another_which_answers_and_the_slow_call_is_cancelled(
    serve_app,
):
    fast, slow, backend, endpoints = await pair(serve_app)
    slow.gate = asyncio.Event()  # the slow one never answers on its own
    assert await send(endpoints, backend) == (200, "fast")
    assert (fast.calls, slow.calls) == (1, 1)
    await until(lambda: slow.left == 1)  # its model server saw the client leave
    assert counted(endpoints, "won") == 1
    await until(lambda: endpoints.inflight == 0)


async def test_an_endpoint_answering_in_time_is_not_hedged(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app, after_ms=5000)
    assert await send(endpoints, backend) == (200, "slow")
    assert (fast.calls, slow.calls) == (0, 1)
    assert counted(endpoints, "won") + counted(endpoints, "lost") == 0


async def test_the_first_endpoint_wins_when_it_answers_before_the_hedge(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app)
    slow.gate, fast.gate = asyncio.Event(), asyncio.Event()  # both slow
    call = asyncio.ensure_future(send(endpoints, backend))
    await until(lambda: fast.calls == 1)  # the hedge is out
    slow.gate.set()
    assert await call == (200, "slow")
    await until(lambda: fast.left == 1)  # the hedge is cancelled
    assert counted(endpoints, "lost") == 1


async def test_a_failed_answer_waits_for_the_other_and_both_failing_gives_the_first(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app)
    slow.gate, fast.gate = asyncio.Event(), asyncio.Event()
    slow.status = 500
    call = asyncio.ensure_future(send(endpoints, backend))
    await until(lambda: fast.calls == 1)
    slow.gate.set()  # the first endpoint fails while the hedge still runs
    await asyncio.sleep(0.05)
    assert not call.done()
    fast.gate.set()
    assert await call == (200, "fast")

    fast.status = 503
    fast.gate, slow.gate = asyncio.Event(), asyncio.Event()
    call = asyncio.ensure_future(send(endpoints, backend))
    await until(lambda: fast.calls == 2)
    fast.gate.set()
    slow.gate.set()
    assert await call == (500, None)  # both failed: the first endpoint's answer
    await until(lambda: endpoints.inflight == 0)  # the other answer was closed


async def test_hedges_are_bounded_by_max_ratio(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app, max_ratio=0.5)
    slow.gate = asyncio.Event()
    endpoints.calls.hedger = hedging.Hedger("m", endpoints._metrics)
    endpoints.calls.hedger.saved = 0.5  # half a hedge saved: this call earns the other half
    assert await send(endpoints, backend) == (200, "fast")
    # the next call to the slow endpoint has half a hedge: it waits for its own answer
    call = asyncio.ensure_future(send(endpoints, backend))
    await until(lambda: slow.calls == 2 and counted(endpoints, "budget") == 1)
    await asyncio.sleep(0.05)
    assert fast.calls == 1
    slow.gate.set()
    assert await call == (200, "slow")


async def test_with_streams_a_stream_is_hedged_on_its_first_chunk(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app, answers=False, streams=True)
    slow.gate = asyncio.Event()  # its head comes at once; its first token never does
    body = json.dumps({"model": "m", "stream": True}).encode()
    endpoints._next = 0
    reply = await endpoints.send(backend, "POST", "/v1/chat/completions", [], body, streaming=True)
    assert reply.stream is not None and reply.close is not None
    relayed = b"".join([chunk async for chunk in reply.stream])
    await reply.close()
    assert b'"fast"' in relayed and relayed.endswith(b"data: [DONE]\n\n")
    await until(lambda: slow.left == 1)  # cancelled at the winner's first chunk
    assert counted(endpoints, "won", "stream") == 1
    whole = asyncio.ensure_future(send(endpoints, backend))  # answers: false
    await until(lambda: slow.calls == 2)
    await asyncio.sleep(0.1)
    assert fast.calls == 1  # not hedged
    slow.gate.set()
    assert await whole == (200, "slow")
    await until(lambda: endpoints.inflight == 0)


async def test_streams_pins_and_calls_that_change_something_are_never_hedged(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app, after_ms=1)
    slow.gate = asyncio.Event()
    calls = [
        endpoints.send(backend, "POST", "/admin/reset", [], b"{}", streaming=False),
        endpoints.send(  # sent twice one after the other, yes; at once by two replicas, no
            backend, "POST", "/admin/reset", [("Idempotency-Key", "k1")], b"{}", streaming=False
        ),
        endpoints.send(backend, "POST", "/v1/chat/completions", [], b"{}", streaming=True),
        endpoints.send(
            backend, "POST", "/v1/embeddings", [], EMBED, streaming=False, pin=slow_url(endpoints)
        ),
    ]
    for made in calls:
        endpoints._next = 0
        task = asyncio.ensure_future(made)
        await asyncio.sleep(0.05)
        assert fast.calls == 0 and not task.done()
        task.cancel()
    assert counted(endpoints, "won") + counted(endpoints, "no_endpoint") == 0


def slow_url(endpoints: EndpointSet) -> Any:
    url = endpoints.endpoints[1].url
    return lambda candidate: candidate == url


async def test_no_hedge_goes_to_an_ejected_endpoint(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app)
    slow.gate = asyncio.Event()
    endpoints.endpoints[0].ejected_until = endpoints._clock.now() + 60  # the fast one
    call = asyncio.ensure_future(send(endpoints, backend))
    await until(lambda: counted(endpoints, "no_endpoint") == 1)
    assert fast.calls == 0
    slow.gate.set()
    assert await call == (200, "slow")


async def test_without_after_ms_the_delay_is_the_percentile_of_recent_answer_times(serve_app):
    _, slow, backend, endpoints = await pair(serve_app, after_ms=None, percentile=90)
    hedger = endpoints.calls.hedger = hedging.Hedger("m", endpoints._metrics)
    settings = backend.hedge
    assert settings is not None
    assert hedger.delay_s(settings, "answer") is None  # nothing timed yet: no hedging
    for ms in range(1, hedging.MIN_SAMPLES + 9):  # 1 .. 40 ms
        hedger.windows["answer"].timed(ms / 1000)
    assert hedger.delay_s(settings, "answer") == 0.037  # the 90th percentile of 1 .. 40 ms
    assert hedger.delay_s(settings, "stream") is None  # streams are timed apart
    gauge = endpoints._metrics.hedge_delay.labels("m", "answer")._value.get()
    assert gauge == 0.037
    slow.gate = asyncio.Event()
    assert await send(endpoints, backend) == (200, "fast")  # hedged after 37 ms


def test_hedge_settings_are_checked():
    backends = {"one": {"url": "http://127.0.0.1:1", "hedge": {}}}
    assert any("hedge: needs several instances" in p for p in problems(backends))
    bad = {"after_ms": 0, "percentile": 40, "max_ratio": 0}
    backends = {"two": {"endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "hedge": bad}}
    found = problems(backends)
    for key in ("hedge.after_ms", "hedge.percentile", "hedge.max_ratio"):
        assert any(key in p for p in found), (key, found)
    nothing = {"answers": False}
    backends = {
        "two": {"endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "hedge": nothing}
    }
    assert any("hedges nothing" in p for p in problems(backends))
    ok = {"endpoints": ["http://127.0.0.1:1", "http://127.0.0.1:2"], "hedge": {"after_ms": 20}}
    loaded = parse_policy_text(yaml.safe_dump(policy({"two": ok})), "p.yaml")
    assert loaded.backend("two").hedge == Hedge(after_ms=20)


def problems(backends: dict[str, Any]) -> list[str]:
    return problems_of(yaml.safe_dump(policy(backends), sort_keys=False))


async def test_through_the_gateway_the_openai_sdk_gets_the_fast_endpoints_answer(
    serve_app, start_gateway, tmp_path
):
    fast, slow = Server("fast"), Server("slow")
    urls = [await serve_app(fast.app()), await serve_app(slow.app())]
    doc = policy(
        {"m": {"endpoints": urls, "balance": "round_robin", "hedge": {"after_ms": 30}}},
        {"name": "embed"},
    )
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    slow.gate = asyncio.Event()
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    try:
        answers = [await client.embeddings.create(model="m", input=f"q{i}") for i in range(4)]
    finally:
        await client.close()
    assert {a.model for a in answers} == {"fast"}
    assert slow.calls == 2  # round robin sent it every other call; each was hedged
    await until(lambda: slow.left == 2)
    async with httpx.AsyncClient() as http:
        text = (await http.get(gw.admin_url + "/metrics")).text
    assert metric(text, "gateway_hedges_total", backend="m", kind="answer", outcome="won") == 2
    assert metric(text, "gateway_hedge_delay_seconds", backend="m", kind="answer") == 0.03


async def test_through_the_gateway_a_streamed_chat_gets_the_first_token_of_the_fast_endpoint(
    serve_app, start_gateway, tmp_path
):
    fast, slow = Server("fast"), Server("slow")
    urls = [await serve_app(fast.app()), await serve_app(slow.app())]
    hedge = {"after_ms": 30, "answers": False, "streams": True}
    doc = policy({"m": {"endpoints": urls, "balance": "round_robin", "hedge": hedge}})
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    slow.gate = asyncio.Event()  # its head at once, its first token never
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    try:
        for i in range(2):
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"q{i}"}], stream=True
            )
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert text == "fast"
    finally:
        await client.close()
    await until(lambda: slow.left == 1)
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(gw.admin_url + "/metrics")).text
    assert metric(metrics, "gateway_hedges_total", backend="m", kind="stream", outcome="won") == 1


async def test_only_answers_are_timed_for_the_percentile_not_quick_refusals(serve_app):
    fast, slow, backend, endpoints = await pair(serve_app, after_ms=None)
    slow.status = fast.status = 503
    for _ in range(3):
        assert (await send(endpoints, backend))[0] == 503
    hedger = endpoints.calls.hedger
    assert hedger is not None and len(hedger.windows["answer"].times) == 0
    slow.status = fast.status = 200
    await send(endpoints, backend)
    assert len(hedger.windows["answer"].times) == 1


def test_a_route_sending_generations_to_a_backend_hedging_whole_answers_is_warned_of(tmp_path):
    two = ["http://127.0.0.1:1", "http://127.0.0.1:2"]

    def warnings(hedge: dict[str, Any], path: str) -> list[str]:
        doc = policy({"m": {"endpoints": two, "hedge": hedge}}, {"match": {"path": path}})
        file = write_policy(tmp_path, doc)
        return [f"{w.path}: {w.message}" for w in load_policy(file).warnings]

    (warning,) = warnings({}, "/v1/*")
    assert warning.startswith("routes[0].backend: hedges whole answers")
    assert "/v1/chat/completions" in warning
    assert warnings({}, "/v1/embeddings") == []
    assert warnings({"answers": False, "streams": True}, "/v1/*") == []
