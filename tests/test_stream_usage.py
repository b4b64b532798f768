"""A route's ``stream_usage: ask``: a stream whose client did not ask for its usage chunk is
asked for one anyway, its tokens are counted (per backend and per tenant), and the chunk
is taken out of what that client receives, every other byte as the backend sent it, even
when the backend splits events across writes.  The official ``openai`` SDK and raw HTTP as
clients, a streaming model server on a real socket."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.openai.stream_usage import MAX_PENDING_BYTES, _without_usage, without_usage_events
from gateway.openai.usage import StreamUsage
from tests.helpers import metric, scrape_when_recorded, write_policy
from tests.llama import chat

KEY = "acme-secret-key"
WORDS = ["Hello", " from", " a", " stream"]
USAGE = {"prompt_tokens": 9, "completion_tokens": len(WORDS), "total_tokens": 9 + len(WORDS)}


def event(payload: dict[str, Any], end: bytes = b"\n\n") -> bytes:
    return b"data: " + json.dumps(payload).encode() + end


def chunk(delta: dict[str, Any], finish: str | None, usage: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    if usage:
        payload["usage"] = None  # OpenAI's shape once include_usage is asked
    return payload


class Streamer:
    """Streams an answer; with ``include_usage`` each chunk has ``usage: null`` and a last
    chunk has the usage.  ``pieces`` splits its bytes into that many writes at odd places,
    ``end`` is the blank line its events end with."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.pieces = 1
        self.end = b"\n\n"

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def stream_bytes(self, include_usage: bool) -> bytes:
        events = [event(chunk({"role": "assistant", "content": ""}, None, include_usage), self.end)]
        events += [event(chunk({"content": w}, None, include_usage), self.end) for w in WORDS]
        events.append(event(chunk({}, "stop", include_usage), self.end))
        if include_usage:
            last = {**chunk({}, None, False), "choices": [], "usage": USAGE}
            events.append(event(last, self.end))
        events.append(b"data: [DONE]" + self.end)
        return b"".join(events)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if body.get("model") == "bad":
            return web.json_response({"error": {"message": "no such model"}}, status=404)
        options = body.get("stream_options") or {}
        data = self.stream_bytes(bool(options.get("include_usage")))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        step = -(-len(data) // self.pieces)
        for start in range(0, len(data), step):
            await response.write(data[start : start + step])
            await asyncio.sleep(0.001)
        await response.write_eof()
        return response


def policy(url: str, stream_usage: str = "ask") -> str:
    digest = hashlib.sha256(KEY.encode()).hexdigest()
    return f"""
backends: {{main: {{url: "{url}"}}}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    backend: main
    stream_usage: {stream_usage}
    cache: {{ttl_s: 60}}
tenants:
  keys:
    - {{name: acme, sha256: {digest}}}
"""


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    server = Streamer()
    url = await serve_app(server.app())
    gw = await start_gateway(policy=write_policy(tmp_path, policy(url)))
    return server, gw


def ask(question: str = "hi", **more: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "user", "content": question}],
        "temperature": 0,  # cacheable
        **more,
    }


async def raw_stream(gw: Any, body: dict[str, Any]) -> tuple[int, bytes, httpx.Headers]:
    async with httpx.AsyncClient(base_url=gw.url) as client:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as answer:
            return answer.status_code, await answer.aread(), answer.headers


async def test_a_stream_not_asking_for_usage_is_counted_and_receives_none(served):
    server, gw = served
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], stream=True, temperature=0
        )
        chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "".join(WORDS)
    assert all(c.choices for c in chunks)  # no usage-only chunk reached the client
    assert server.bodies[0]["stream_options"] == {"include_usage": True}
    text = await scrape_when_recorded(gw.admin_url, 1)
    assert metric(text, "gateway_tokens_total", backend="main", kind="completion") == 4
    assert metric(text, "gateway_tokens_total", backend="main", kind="prompt") == 9
    assert (
        metric(text, "gateway_tenant_tokens_total", tenant="acme", kind="prompt", source="backend")
        == 9
    )


@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("pieces", [1, 7, 61])
async def test_the_client_gets_every_other_byte_as_sent_however_the_events_are_split(
    served, end, pieces
):
    server, gw = served
    server.pieces, server.end = pieces, end
    status, received, headers = await raw_stream(gw, ask(f"split {pieces}", stream=True))
    sent = server.stream_bytes(include_usage=True)
    usage_event = event({**chunk({}, None, False), "choices": [], "usage": USAGE}, end)
    assert status == 200
    assert usage_event in sent
    assert received == sent.replace(usage_event, b"")
    assert headers["x-gateway-cache"] == "miss"


async def test_a_client_that_asks_gets_its_usage_and_its_body_goes_as_sent(served):
    server, gw = served
    options = {"include_usage": True}
    status, received, _ = await raw_stream(gw, ask(stream=True, stream_options=options))
    assert status == 200
    assert received == server.stream_bytes(include_usage=True)
    assert server.bodies[0]["stream_options"] == options


async def test_a_cached_stream_replays_without_the_usage_its_client_did_not_ask_for(served):
    server, gw = served
    first = await raw_stream(gw, ask("again", stream=True))
    second = await raw_stream(gw, ask("again", stream=True))
    asked = await raw_stream(gw, ask("again", stream=True, stream_options={"include_usage": True}))
    assert (first[2]["x-gateway-cache"], second[2]["x-gateway-cache"]) == ("miss", "hit")
    assert b'"usage": {' not in first[1] and b'"usage":{' not in second[1]
    assert b'"completion_tokens"' in asked[1]  # the one that asked gets it, from the cache
    assert len(server.bodies) == 1
    text = await scrape_when_recorded(gw.admin_url, 3)
    cached = metric(
        text, "gateway_tenant_tokens_total", tenant="acme", kind="completion", source="cache"
    )
    assert cached == 8  # both hits were counted


async def test_stream_options_that_are_not_an_object_go_as_sent(served):
    """``stream_options: null`` (or any non-object) is the backend's to judge: not replaced."""
    server, gw = served
    status, received, _ = await raw_stream(
        gw, ask("null options", stream=True, stream_options=None)
    )
    assert status == 200
    assert server.bodies[0]["stream_options"] is None
    assert received == server.stream_bytes(include_usage=False)


async def test_an_error_answer_passes_through_untouched(served):
    _, gw = served
    body = {**ask(stream=True), "model": "bad"}
    status, received, _ = await raw_stream(gw, body)
    assert status == 404
    assert json.loads(received) == {"error": {"message": "no such model"}}


async def test_a_route_that_passes_streams_leaves_the_body_alone(
    serve_app, start_gateway, tmp_path
):
    server = Streamer()
    url = await serve_app(server.app())
    gw = await start_gateway(policy=write_policy(tmp_path, policy(url, "pass")))
    status, received, _ = await raw_stream(gw, ask(stream=True))
    assert status == 200
    assert received == server.stream_bytes(include_usage=False)
    assert "stream_options" not in server.bodies[0]
    assert (
        metric(
            await scrape_when_recorded(gw.admin_url, 1),
            "gateway_tokens_total",
            backend="main",
            kind="prompt",
        )
        is None
    )


def test_only_whole_usage_only_events_are_dropped():
    usage = b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n'
    content = b'data: {"choices":[{"delta":{"content":"\\"usage\\""}}],"usage":null}\n\n'
    comment = b': "usage" in a comment\n\n'
    tail = b'data: {"choices":[],"usage":{"prompt'
    assert without_usage_events(content + usage + comment + tail) == content + comment + tail
    assert without_usage_events(b"data: [DONE]\n\n") == b"data: [DONE]\n\n"


@pytest.mark.llm
async def test_llama_cpps_streams_are_counted_without_the_client_asking(
    llama, start_gateway, tmp_path
):
    """llama.cpp's server, asked for the usage by the gateway: the client's stream is the
    server's own stream for a client that did not ask, and the tokens counted are the ones
    the server reports when asked."""
    gw = await start_gateway(policy=write_policy(tmp_path, policy(llama.url)))
    body = {**chat("Count to three", max_tokens=6), "stream": True}
    # llama-server may close a kept-alive connection after a stream; httpx would then send
    # the next POST on a dead connection and not retry it: one connection per request
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=fresh) as client:
        direct = await client.post(llama.url + "/v1/chat/completions", json=body)
        asked = await client.post(
            llama.url + "/v1/chat/completions",
            json={**body, "stream_options": {"include_usage": True}},
        )
        _, via, _ = await raw_stream(gw, body)
    reported = json.loads(
        next(
            line[5:]
            for line in asked.content.splitlines()
            if line.startswith(b"data:") and b'"usage":{' in line.replace(b" ", b"")
        )
    )["usage"]

    def contents(stream: bytes) -> list[str]:
        found = []
        for line in stream.splitlines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                for choice in json.loads(line[5:])["choices"]:
                    found.append(choice["delta"].get("content") or "")
        return found

    assert contents(via) == contents(direct.content)  # the same tokens, and no usage chunk
    assert all(
        json.loads(line[5:]).get("choices")
        for line in via.splitlines()
        if line.startswith(b"data:") and line[5:].strip() != b"[DONE]"
    )
    text = await scrape_when_recorded(gw.admin_url, 1)
    counted = (
        metric(text, "gateway_tokens_total", backend="main", kind="prompt"),
        metric(text, "gateway_tokens_total", backend="main", kind="completion"),
    )
    assert counted == (reported["prompt_tokens"], reported["completion_tokens"])


async def test_a_stream_that_never_ends_an_event_is_passed_on_not_held():
    """A backend that never writes a blank line: the filter holds at most
    ``MAX_PENDING_BYTES`` of it, then passes the bytes on as they came, none lost."""
    piece = b"data: " + b"x" * (64 * 1024)
    pieces = 40  # 2.5 MiB, no event ever ended

    async def unended() -> AsyncIterator[bytes]:
        for _ in range(pieces):
            yield piece

    held: list[int] = []
    out = bytearray()
    async for part in _without_usage(unended(), StreamUsage()):
        held.append(len(part))
        out += part
    assert bytes(out) == piece * pieces
    assert len(held) > 1 and max(held) <= MAX_PENDING_BYTES + len(piece)
