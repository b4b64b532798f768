"""The fakes a user's tests share with ours: ``FakeTransport`` answers calls without
sockets, ``Pipeline`` runs the real gateway (edge, stages, metrics) in front of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from gateway.errors import UpstreamTimeout
from gateway.pipeline import Reply
from gateway.testing import FakeTransport, Sent, json_reply, stream_reply
from gateway.testing.harness import Pipeline

POLICY = """
backends: {main: {url: "http://main.test"}, spare: {url: "http://spare.test"}}
routes: [{name: chat, match: {path: "/v1/*"}, backend: main, fallback: [spare]}]
"""
ASK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_a_fake_backend_sees_what_the_gateway_sends_and_the_client_gets_its_answer():
    def main(sent: Sent) -> Reply:
        assert sent.json() == ASK and sent.header("x-request-id") == "r-1"
        return json_reply({"id": "c1", "choices": []}, headers=[("X-Model", "m@1")])

    async with Pipeline(POLICY, main) as gw:
        answer = await gw.post("/v1/chat/completions", ASK, headers={"X-Request-ID": "r-1"})
    assert answer.status_code == 200 and answer.complete
    assert answer.json() == {"id": "c1", "choices": []}
    assert answer.headers["x-model"] == "m@1" and answer.headers["X-Gateway-Backend"] == "main"
    assert [(s.backend, s.method, s.target) for s in gw.transport.sent] == [
        ("main", "POST", "/v1/chat/completions")
    ]


async def test_transport_failures_are_the_gateways_to_handle_and_render():
    def main(sent: Sent) -> Reply:
        raise UpstreamTimeout("the backend did not answer in time", backend="main")

    async with Pipeline(POLICY, {"main": main, "spare": main}) as gw:
        answer = await gw.post("/v1/chat/completions", ASK)
    assert answer.status_code == 504
    assert answer.json()["error"]["code"] == "upstream_timeout"
    assert [s.backend for s in gw.transport.sent] == ["main", "spare"]


async def test_a_client_that_leaves_mid_stream_leaves_nothing_held_upstream():
    more = asyncio.Event()

    async def events() -> AsyncIterator[bytes]:
        yield b"data: one\n\n"
        await more.wait()
        yield b"data: two\n\n"

    transport = FakeTransport(lambda sent: stream_reply(events()))
    async with Pipeline(POLICY, transport) as gw:
        exchange = gw.send("POST", "/v1/chat/completions", json={**ASK, "stream": True})
        first = await exchange.until(lambda a: b"one" in a.body)
        assert first.status_code == 200 and not first.complete
        assert transport.open_streams == 1
        await exchange.disconnect()
    assert transport.open_streams == 0
    assert gw.metric("gateway_requests_total", route="chat", backend="main", status="499") == 1
