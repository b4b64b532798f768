"""Single flight on Anthropic's Messages API (and the Responses API when the server stores
nothing): identical in-flight requests at temperature 0 share one upstream call, a stream with streams and a whole answer with whole answers, each
handed as the backend sent it; another ``anthropic-beta``, another tenant or a sampled
request makes its own call.  The upstream holds its answers behind a gate, so the test
decides when the shared call ends; the ``anthropic`` SDK reads the shared streams."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import anthropic
import httpx
import pytest
from aiohttp import web

from gateway.coalesce.singleflight import SingleFlight
from gateway.coalesce.stage import FLIGHTS
from tests.helpers import metric, scrape_when_recorded, until, write_policy
from tests.test_responses_messages import HI, message_object, messages_stream, response_object

KEYS = {"acme": "acme-secret-key", "umbrella": "umbrella-secret-key"}


class Gated:
    """Anthropic's Messages API, answering only once ``gate`` is set; records each call."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], str]] = []
        self.gate = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/responses", self.responses)
        return app

    async def responses(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls.append((body, ""))
        await self.gate.wait()
        return web.json_response(response_object(body["model"]))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((body, request.headers.get("anthropic-beta", "")))
        if not body.get("stream"):
            await self.gate.wait()
            return web.json_response(message_object(body["model"]))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        events = messages_stream(body["model"])
        first = events.index(b"\n\n") + 2
        await response.write(events[:first])  # message_start, then the rest at the gate
        await self.gate.wait()
        await response.write(events[first:])
        await response.write_eof()
        return response


POLICY = """
backends: {{claude: {{url: "{url}"}}}}
routes: [{{name: messages, backend: claude, coalesce: true}}]
tenants:
  keys:
{keys}
"""


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    upstream = Gated()
    url = await serve_app(upstream.app())
    keys = "\n".join(
        f"    - {{name: {name}, sha256: {hashlib.sha256(key.encode()).hexdigest()}}}"
        for name, key in KEYS.items()
    )
    gw = await start_gateway(policy=write_policy(tmp_path, POLICY.format(url=url, keys=keys)))
    yield upstream, gw
    upstream.gate.set()


ASK = {"model": "claude-1", "messages": HI, "max_tokens": 8, "temperature": 0}


async def post(
    gw: Any, body: dict[str, Any], tenant: str = "acme", beta: str = ""
) -> httpx.Response:
    headers = {"x-api-key": KEYS[tenant], "anthropic-version": "2023-06-01"}
    if beta:
        headers["anthropic-beta"] = beta
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(gw.url + "/v1/messages", json=body, headers=headers)


async def test_identical_messages_share_one_call_each_in_its_own_shape(served):
    upstream, gw = served
    streamed = {**ASK, "stream": True}
    asks = [
        *[post(gw, ASK) for _ in range(3)],
        *[post(gw, streamed) for _ in range(3)],
        post(gw, ASK, beta="some-feature-2026-01-01"),  # another answer: its own call
        post(gw, ASK, tenant="umbrella"),  # another tenant: its own call
        post(gw, {**ASK, "temperature": 1}),  # sampled: its own call
    ]
    tasks = [asyncio.create_task(ask) for ask in asks]
    await until(lambda: len(upstream.calls) == 5)
    upstream.gate.set()
    replies = await asyncio.gather(*tasks)
    assert all(reply.status_code == 200 for reply in replies)
    assert len(upstream.calls) == 5
    whole, streams = replies[:3], replies[3:6]
    assert {r.content for r in whole} == {json.dumps(message_object("claude-1")).encode()}
    assert {r.content for r in streams} == {messages_stream("claude-1")}  # byte for byte
    assert all(r.headers["Content-Type"].startswith("text/event-stream") for r in streams)
    for shape in (whole, streams):
        marks = sorted(r.headers.get("X-Gateway-Coalesced", "") for r in shape)
        assert marks == ["", "1", "1"]
    assert all("X-Gateway-Coalesced" not in r.headers for r in replies[6:])
    text = await scrape_when_recorded(gw.admin_url, 9)
    assert metric(text, "gateway_coalesced_requests_total", route="messages") == 4
    joined = metric(
        text, "gateway_tenant_tokens_total", tenant="acme", kind="prompt", source="coalesced"
    )
    assert joined == 4 * 10  # Anthropic's three input counts, for each joiner


async def test_the_sdks_streams_read_one_shared_call(served):
    upstream, gw = served

    async def ask() -> str:
        async with anthropic.AsyncAnthropic(
            base_url=gw.url, api_key=KEYS["acme"], max_retries=0
        ) as claude:
            async with claude.messages.stream(
                model="claude-1", max_tokens=8, messages=HI, extra_body={"temperature": 0}
            ) as stream:
                return await stream.get_final_text()

    tasks = [asyncio.create_task(ask()) for _ in range(4)]
    flights = gw.gateway.registry.peek(FLIGHTS, "messages")
    assert isinstance(flights, SingleFlight)
    await until(lambda: flights.coalesced == 3)
    upstream.gate.set()
    assert await asyncio.gather(*tasks) == ["ok"] * 4
    assert len(upstream.calls) == 1


async def test_identical_responses_the_server_does_not_store_share_one_call(served):
    """``store: false``: nothing on the server to keep apart, so identical requests in
    flight share one call; stored ones each make their own (each is the server's)."""
    upstream, gw = served
    ask = {"model": "m", "input": "hi", "temperature": 0}
    headers = {"Authorization": f"Bearer {KEYS['acme']}"}

    async def post_response(body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=10) as client:
            return await client.post(gw.url + "/v1/responses", json=body, headers=headers)

    tasks = [asyncio.create_task(post_response({**ask, "store": False})) for _ in range(3)]
    tasks += [asyncio.create_task(post_response(ask)) for _ in range(2)]
    await until(lambda: len(upstream.calls) == 3)
    upstream.gate.set()
    replies = await asyncio.gather(*tasks)
    assert all(reply.status_code == 200 for reply in replies)
    assert len(upstream.calls) == 3
    marks = [reply.headers.get("X-Gateway-Coalesced", "") for reply in replies]
    assert sorted(marks[:3]) == ["", "1", "1"] and marks[3:] == ["", ""]
