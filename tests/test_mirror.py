"""A route's ``mirror``: shadow traffic.  Each call the route sends its backend is copied to
another backend, whose answer is read and dropped; the client never waits for it or sees it.
Two model servers on real sockets, the official ``openai`` SDK and httpx as clients."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from aiohttp import web

from gateway.coalesce.stage import FLIGHTS
from gateway.mirror.compare import agree
from gateway.mirror.stage import MIRROR_HEADER, SHADOWS
from tests.helpers import chat, metric, policy, problems_of, until, write_policy

SHADOW_KEY = "shadow-only-key"
RELOADING = {"reload_interval_s": 0.05, "reload_settle_s": 0}


class Server:
    """A model server that records each call; ``gate``, when set, holds every answer until
    it opens; ``status`` is what it answers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.gate: asyncio.Event | None = None
        self.status = 200
        self.streams_ended = 0
        self.voice = name  # who the answer says it is from
        self.vector = [0.6, 0.8]  # what it embeds every input as
        self.split = 5  # where a streamed answer's text is cut into its two chunks
        self.stream_gate: asyncio.Event | None = None  # holds a stream after its first chunk

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/embeddings", self.embed)
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        """A KServe V2 model scoring its input as ``vector`` says, naming itself and its
        version (the mirror is another)."""
        body = await request.json()
        self.calls.append(({k.lower(): v for k, v in request.headers.items()}, body))
        scores = {"name": "y", "shape": [1, 2], "datatype": "FP32", "data": self.vector}
        version = {"model_name": request.match_info["model"], "model_version": self.name}
        return web.json_response({**version, "id": body.get("id"), "outputs": [scores]})

    async def embed(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append(({k.lower(): v for k, v in request.headers.items()}, body))
        data = [{"object": "embedding", "index": 0, "embedding": self.vector}]
        usage = {"prompt_tokens": 1, "total_tokens": 1}
        return web.json_response(
            {"object": "list", "data": data, "model": body["model"], "usage": usage}
        )

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [body for _, body in self.calls]

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append(({k.lower(): v for k, v in request.headers.items()}, body))
        if self.gate is not None:
            await self.gate.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "no"}}, status=self.status)
        text = f"{self.voice} says hi to {body['model']}"
        if body.get("stream"):
            stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await stream.prepare(request)
            for at, piece in enumerate((text[: self.split], text[self.split :])):
                if at == 1 and self.stream_gate is not None:
                    await self.stream_gate.wait()
                end = "stop" if at == 1 else None
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": end}
                delta = {"object": "chat.completion.chunk", "choices": [choice]}
                await stream.write(f"data: {json.dumps(delta)}\n\n".encode())
            await stream.write(b"data: [DONE]\n\n")
            self.streams_ended += 1
            return stream
        message = {"role": "assistant", "content": text}
        return web.json_response(
            {
                "id": f"{self.name}-{len(self.calls)}",
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
            }
        )


def mirrored(primary: str, shadow: str, route: dict[str, Any] | None = None, **more: Any) -> Any:
    backends: dict[str, dict[str, Any]] = {
        "main": {"url": primary},
        "canary": {"url": shadow, "headers": {"Authorization": f"Bearer {SHADOW_KEY}"}},
    }
    mirror = {"backend": "canary", **(route or {}).pop("mirror", {})}
    return policy(backends, {"mirror": mirror, **(route or {})}, server=RELOADING, **more)


@pytest.fixture
async def servers(serve_app):
    main, canary = Server("main"), Server("canary")
    return main, canary, await serve_app(main.app()), await serve_app(canary.app())


async def start(start_gateway, tmp_path, doc: Any) -> Any:
    return await start_gateway(policy=write_policy(tmp_path, doc))


async def scrape(gw: Any) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(gw.admin_url + "/metrics")).text


def outcome(text: str, value: str) -> float:
    found = metric(
        text, "gateway_mirror_requests_total", route="chat", backend="canary", outcome=value
    )
    return found or 0.0


async def test_each_call_is_copied_to_the_mirror_and_its_answer_dropped(
    servers, start_gateway, tmp_path
):
    main, canary, main_url, canary_url = servers
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    async with openai.AsyncOpenAI(
        base_url=gw.url + "/v1", api_key="client-key", max_retries=0
    ) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="m",
            messages=[{"role": "user", "content": "hello"}],
            extra_headers={MIRROR_HEADER: "forged", "X-Request-ID": "req-26"},
        )
    answer = raw.parse()
    assert answer.choices[0].message.content == "main says hi to m"  # the route's answer
    await until(lambda: len(canary.calls) == 1)
    (main_headers, main_body), (copy_headers, copy_body) = main.calls[0], canary.calls[0]
    assert copy_body == main_body
    assert copy_headers[MIRROR_HEADER.lower()] == "chat"
    assert MIRROR_HEADER.lower() not in main_headers  # a client's own is never passed on
    assert copy_headers["x-request-id"] == main_headers["x-request-id"] == "req-26"
    assert copy_headers["authorization"] == f"Bearer {SHADOW_KEY}"  # the mirror's headers
    assert main_headers["authorization"] == "Bearer client-key"
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    await until(lambda: shadow.in_flight == 0)
    text = await scrape(gw)
    assert outcome(text, "2xx") == 1
    assert metric(text, "gateway_mirror_duration_seconds_count", route="chat", backend="canary")
    assert metric(text, "gateway_mirror_in_flight", route="chat") == 0
    assert repr(shadow) == "<Shadow chat -> canary in_flight=0/16 fraction=1>"


async def test_the_client_never_waits_for_the_mirror(servers, start_gateway, tmp_path):
    _main, canary, main_url, canary_url = servers
    canary.gate = asyncio.Event()
    doc = mirrored(main_url, canary_url, {"mirror": {"max_in_flight": 2}})
    gw = await start(start_gateway, tmp_path, doc)
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
            for i in range(5):  # each answered while the mirror holds the copies
                answer = await client.post("/v1/chat/completions", json=chat(f"q{i}"))
                assert answer.status_code == 200
                assert answer.json()["choices"][0]["message"]["content"] == "main says hi to m"
        await until(lambda: len(canary.calls) == 2)
        assert shadow.in_flight == 2
        assert "in_flight=2/2" in repr(shadow)
        text = await scrape(gw)
        assert outcome(text, "shed") == 3
        assert metric(text, "gateway_mirror_in_flight", route="chat") == 2
    finally:
        canary.gate.set()
    await until(lambda: shadow.in_flight == 0)
    assert outcome(await scrape(gw), "2xx") == 2


async def test_only_calls_that_reach_the_backend_are_copied(servers, start_gateway, tmp_path):
    """A cache hit, a coalesced joiner and a call over its rate limit never reach the
    route's backend, so none reaches its mirror."""
    main, canary, main_url, canary_url = servers
    main.gate = asyncio.Event()
    route = {"cache": {"ttl_s": 60}, "rate_limit": {"requests_per_s": 0.01, "burst": 2}}
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url, route))
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        ask = chat("same", temperature=0)
        first = asyncio.ensure_future(client.post("/v1/chat/completions", json=ask))
        await until(lambda: len(main.calls) == 1)
        joiner = asyncio.ensure_future(client.post("/v1/chat/completions", json=ask))
        flights = gw.gateway.registry.peek(FLIGHTS, "chat")
        await until(lambda: flights.coalesced == 1)  # the joiner is in the flight
        main.gate.set()
        answers = [await first, await joiner]
        hit = await client.post("/v1/chat/completions", json=ask)
        other = await client.post("/v1/chat/completions", json=chat("other", temperature=0))
        over = await client.post("/v1/chat/completions", json=chat("over", temperature=0))
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[1].headers.get("x-gateway-coalesced") == "1"
    assert hit.headers["x-gateway-cache"] == "hit"
    assert other.status_code == 200
    assert over.status_code == 429
    assert [b["messages"][0]["content"] for b in main.bodies] == ["same", "other"]
    await until(lambda: len(canary.calls) == 2)
    assert canary.bodies == main.bodies


async def test_a_failing_mirror_never_reaches_the_client(servers, start_gateway, tmp_path):
    _main, canary, main_url, canary_url = servers
    canary.status = 500
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        answered = await client.post("/v1/chat/completions", json=chat("a"))
        await until(lambda: shadow.in_flight == 0 and len(canary.calls) == 1)
        # the mirror gone: nothing listens on its port any more
        doc = mirrored(main_url, "http://127.0.0.1:9", {"mirror": {"max_in_flight": 3}})
        write_policy(tmp_path, doc)
        await until(lambda: gw.gateway.registry.peek(SHADOWS, "chat") is not shadow)
        refused = await client.post("/v1/chat/completions", json=chat("b"))
    assert (answered.status_code, refused.status_code) == (200, 200)
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    await until(lambda: shadow.in_flight == 0)
    text = await scrape(gw)
    assert outcome(text, "5xx") == 1
    assert outcome(text, "error") == 1


async def test_a_call_the_backend_failed_is_copied_too(servers, start_gateway, tmp_path):
    _main, canary, _main_url, canary_url = servers
    gw = await start(start_gateway, tmp_path, mirrored("http://127.0.0.1:9", canary_url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        failed = await client.post("/v1/chat/completions", json=chat("down"))
    assert failed.status_code == 502
    await until(lambda: len(canary.calls) == 1)
    assert canary.bodies[0]["messages"][0]["content"] == "down"


async def test_the_mirror_is_asked_for_its_own_model(servers, start_gateway, tmp_path):
    main, canary, main_url, canary_url = servers
    doc = mirrored(main_url, canary_url, {"mirror": {"model": "m-v2"}})
    gw = await start(start_gateway, tmp_path, doc)
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        answer = await client.post("/v1/chat/completions", json=chat("which?", temperature=0))
    assert answer.json()["model"] == "m"
    await until(lambda: len(canary.calls) == 1)
    assert [b["model"] for b in main.bodies] == ["m"]
    assert canary.bodies[0] == {**main.bodies[0], "model": "m-v2"}


async def test_a_client_never_sets_its_copies_place_in_a_vllm_mirrors_queue(
    servers, start_gateway, tmp_path
):
    """A mirror with ``upstream_priority: vllm`` gets each copy at vLLM's lowest priority,
    whatever priority the client wrote into its body."""
    main, canary, main_url, canary_url = servers
    doc = mirrored(main_url, canary_url)
    doc["backends"]["canary"]["upstream_priority"] = "vllm"
    gw = await start(start_gateway, tmp_path, doc)
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        for priority in (-1, "high", None):
            body = chat("first!") if priority is None else chat("first!", priority=priority)
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
    await until(lambda: len(canary.calls) == 3)
    assert [b["priority"] for b in canary.bodies] == [1, 1, 1]
    assert [b.get("priority") for b in main.bodies] == [-1, "high", None]  # as the client wrote


async def comparisons(gw: Any, canary: Server, copies: int) -> tuple[float | None, ...]:
    """(same, different) once the mirror has answered ``copies`` copies."""
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    await until(lambda: len(canary.calls) == copies and shadow.in_flight == 0)
    text = await scrape(gw)
    labels = {"route": "chat", "backend": "canary"}
    return tuple(
        metric(text, "gateway_mirror_comparisons_total", result=result, **labels)
        for result in ("same", "different")
    )


async def test_a_deterministic_calls_two_answers_are_compared(servers, start_gateway, tmp_path):
    """Same but for their ids, times, model names and token counts; a sampled call and a
    stream are not compared."""
    _main, canary, main_url, canary_url = servers
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        canary.voice = "main"  # it answers as the route's backend does
        await client.post("/v1/chat/completions", json=chat("one", temperature=0))
        await until(lambda: len(canary.calls) == 1)
        canary.voice = "canary"
        await client.post("/v1/chat/completions", json=chat("two", temperature=0))
        await client.post("/v1/chat/completions", json=chat("sampled"))
        await client.post("/v1/chat/completions", json=chat("streamed", stream=True))
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    await until(lambda: len(canary.calls) == 4 and shadow.in_flight == 0)
    text = await scrape(gw)

    def compared(result: str) -> float | None:
        return metric(
            text, "gateway_mirror_comparisons_total", route="chat", backend="canary", result=result
        )

    assert (compared("same"), compared("different")) == (1, 1)
    assert outcome(text, "2xx") == 4


async def test_embeddings_from_another_gpu_agree_and_from_another_model_do_not(
    servers, start_gateway, tmp_path
):
    _main, canary, main_url, canary_url = servers
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        canary.vector = [0.6003, 0.7998]  # the same direction, other last bits
        await client.post("/v1/embeddings", json={"model": "e", "input": "one"})
        await until(lambda: len(canary.calls) == 1)
        canary.vector = [0.8, 0.6]  # another model
        await client.post("/v1/embeddings", json={"model": "e", "input": "two"})
    assert await comparisons(gw, canary, 2) == (1, 1)


async def test_a_stream_is_copied_and_the_mirrors_stream_read_to_its_end(
    servers, start_gateway, tmp_path
):
    _main, canary, main_url, canary_url = servers
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "stream"}], stream=True
        )
        text = "".join([c.choices[0].delta.content or "" async for c in stream])
    assert text == "main says hi to m"
    await until(lambda: canary.streams_ended == 1)
    assert canary.bodies[0]["stream"] is True
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    await until(lambda: shadow.in_flight == 0)
    assert outcome(await scrape(gw), "2xx") == 1


async def test_a_deterministic_streams_answer_is_compared_once_both_have_ended(
    servers, start_gateway, tmp_path
):
    """Two servers cut the same text into other chunks: the same answer; another text: a
    different one.  A stream its client leaves is not compared, and its copy ends."""
    main, canary, main_url, canary_url = servers
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")

    def compared(text: str, result: str) -> float:
        labels = {"route": "chat", "backend": "canary", "result": result}
        return metric(text, "gateway_mirror_comparisons_total", **labels) or 0.0

    body = chat("streamed", temperature=0, stream=True)
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        canary.voice, canary.split = "main", 9  # the same words, cut elsewhere
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await until(lambda: len(canary.calls) == 1 and shadow.in_flight == 0)
        canary.voice = "canary"
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        await until(lambda: len(canary.calls) == 2 and shadow.in_flight == 0)
        text = await scrape(gw)
        assert (compared(text, "same"), compared(text, "different")) == (1, 1)
        main.stream_gate = asyncio.Event()  # the client leaves after the first chunk
        async with client.stream("POST", "/v1/chat/completions", json=body) as answer:
            async for _ in answer.aiter_bytes():
                break
        main.stream_gate.set()
        await until(lambda: len(canary.calls) == 3 and shadow.in_flight == 0)
    text = await scrape(gw)
    assert (compared(text, "same"), compared(text, "different")) == (1, 1)
    assert outcome(text, "2xx") == 3


async def test_a_fraction_of_the_calls_is_copied(servers, start_gateway, tmp_path):
    main, canary, main_url, canary_url = servers
    doc = mirrored(main_url, canary_url, {"mirror": {"fraction": 0.25}})
    gw = await start(start_gateway, tmp_path, doc)
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        for i in range(200):
            await client.post("/v1/chat/completions", json=chat(f"q{i}"))
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    await until(lambda: shadow.in_flight == 0)
    # 200 draws at 0.25: 50 copies, with a standard deviation of 6.1
    assert 20 <= len(canary.calls) <= 80
    assert len(main.calls) == 200


async def test_a_reload_that_drops_the_mirror_stops_the_copies(servers, start_gateway, tmp_path):
    _main, canary, main_url, canary_url = servers
    canary.gate = asyncio.Event()
    gw = await start(start_gateway, tmp_path, mirrored(main_url, canary_url))
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        await client.post("/v1/chat/completions", json=chat("before"))
        await until(lambda: shadow.in_flight == 1)
        backends = {"main": {"url": main_url}, "canary": {"url": canary_url}}
        write_policy(tmp_path, policy(backends, server=RELOADING))
        await until(lambda: gw.gateway.registry.peek(SHADOWS, "chat") is None)
        await until(lambda: shadow.in_flight == 0)  # the copy in flight was cancelled
        after = await client.post("/v1/chat/completions", json=chat("after"))
    canary.gate.set()
    assert after.status_code == 200
    assert [b["messages"][0]["content"] for b in canary.bodies] == ["before"]


@pytest.mark.parametrize(
    ("mirror", "problem"),
    [
        ({"backend": "nowhere"}, "routes[0].mirror.backend: unknown backend 'nowhere'"),
        ({"backend": "main"}, "routes[0].mirror.backend: the route's own backend cannot"),
        ({"backend": "canary", "fraction": 1.5}, "routes[0].mirror.fraction: must be between"),
        ({"backend": "canary", "max_in_flight": 0}, "routes[0].mirror.max_in_flight: must be"),
        ({"backend": "canary", "model": " "}, "routes[0].mirror.model: must name a model"),
    ],
)
def test_a_mirror_is_checked(tmp_path, mirror, problem):
    backends = {"main": {"url": "http://127.0.0.1:1"}, "canary": {"url": "http://127.0.0.1:2"}}
    path = write_policy(tmp_path, policy(backends, {"mirror": mirror}))
    assert any(problem in p for p in problems_of(path.read_text()))


async def test_a_kserve_models_scores_are_compared_to_three_digits(
    servers, start_gateway, tmp_path
):
    """A new model version shadowed on real traffic: its scores within a thousandth of the
    route's backend's agree (another GPU's last bits), other scores do not, whatever the
    model name and version each answer names."""
    _main, canary, main_url, canary_url = servers
    gw = await start(
        start_gateway, tmp_path, mirrored(main_url, canary_url, {"match": {"path": "*"}})
    )
    row = {"inputs": [{"name": "x", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        canary.vector = [0.6002, 0.8]  # the same scores, other last bits
        await client.post("/v2/models/recs/infer", json=row)
        await until(lambda: len(canary.calls) == 1)
        canary.vector = [0.7, 0.3]  # a model that ranks otherwise
        await client.post("/v2/models/recs/infer", json=row)
    assert await comparisons(gw, canary, 2) == (1, 1)


@pytest.mark.parametrize("depth", [900, 100_000])
def test_an_answer_nested_past_the_strict_readers_depth_is_not_compared(depth):
    """A broken server's answer, ``[[[...]]]`` under 256 KiB: read by the gateway's strict
    reader (at most 64 deep), never by recursion as deep as it goes (before: a
    RecursionError out of the copy's task)."""
    deep = b"[" * depth + b"]" * depth
    assert agree(deep, deep) is None
    assert agree(b'{"a": NaN}', b'{"a": NaN}') is None  # not JSON either


def test_numbers_agree_within_a_thousandth_and_nothing_else_does():
    def scores(*data: Any, **more: Any) -> bytes:
        return json.dumps({"model_name": "m", "outputs": [{"data": list(data)}], **more}).encode()

    ours = scores(0.5, 2, 1e-9)
    assert agree(ours, scores(0.5004, 2.0, 0.0, model_name="m2", model_version="7")) is True
    assert agree(ours, scores(0.501, 2, 1e-9)) is False
    assert agree(ours, scores(0.5, 3, 1e-9)) is False
    assert agree(ours, scores(0.5, 2)) is False
    assert agree(ours, scores(0.5, "2", 1e-9)) is False
    assert agree(ours, scores(0.5, True, 1e-9)) is False
    assert agree(scores(1), scores(True)) is False


def test_two_answers_agree_whatever_their_ids_times_and_token_counts():
    def chat_answer(id_: str, content: str, **more: Any) -> bytes:
        message = {"role": "assistant", "content": content, "tool_calls": [{"id": id_}]}
        answer = {"id": id_, "created": len(id_), "model": id_, "usage": {"total": len(id_)}}
        return json.dumps({**answer, "choices": [{"message": message}], **more}).encode()

    ours = chat_answer("chatcmpl-1", "Paris")
    assert agree(ours, chat_answer("x-99", "Paris", timings={"ms": 3})) is True
    assert agree(ours, chat_answer("chatcmpl-1", "Lyon")) is False
    assert agree(ours, b"not json") is None
    assert agree(b"\xff", ours) is None


def test_two_embeddings_agree_when_each_inputs_vectors_point_the_same_way():
    def embeddings(*vectors: Any) -> bytes:
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        return json.dumps({"object": "list", "data": data, "model": "m"}).encode()

    first, second = [0.6, 0.8, 0.0], [0.0, 0.6, 0.8]
    ours = embeddings(first, second)
    nudged = [x + 0.0004 for x in first]  # another GPU's last bits
    as_base64 = base64.b64encode(np.asarray(second, dtype="<f4").tobytes()).decode()
    assert agree(ours, embeddings(nudged, as_base64)) is True
    assert agree(ours, embeddings(second, first)) is False  # each input is its own
    assert agree(ours, embeddings(first)) is False
    assert agree(ours, embeddings(first, [0.0, 0.8, 0.6])) is False
