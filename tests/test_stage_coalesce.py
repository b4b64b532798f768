"""Single flight through a running gateway: identical in-flight requests share one upstream call.

The chat upstream here holds its answers behind a ``gate`` (a stream sends its first events,
then waits), so every test decides when the shared call finishes, and can have clients join
or leave while it is in flight.  It records each call and whether the gateway cancelled it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.coalesce.singleflight import SingleFlight
from gateway.coalesce.stage import FLIGHTS
from tests.conftest import Running
from tests.helpers import until

WORDS = ["Hello", " from", " the", " one", " shared", " call"]
USAGE = {"prompt_tokens": 5, "completion_tokens": len(WORDS), "total_tokens": 5 + len(WORDS)}


def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
    event = {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


EVENTS = [
    chunk({"role": "assistant", "content": ""}),
    *[chunk({"content": w}) for w in WORDS],
    chunk({}, "stop"),
    b"data: "
    + json.dumps(
        {
            "id": "chatcmpl-7",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [],
            "usage": USAGE,
        }
    ).encode()
    + b"\n\n",
    b"data: [DONE]\n\n",
]
HEAD = 3  # events a stream sends before it waits for the gate


class Chat:
    """A chat upstream whose answers wait for ``gate``; ``cut`` breaks them off instead."""

    def __init__(self) -> None:
        self.calls: list[tuple[dict[str, Any], str]] = []
        self.gate = asyncio.Event()
        self.cut = False
        self.cancelled = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/chat/completions", self.chat)

    async def _wait(self) -> None:
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.calls.append((body, request.headers.get("Authorization", "")))
        if not body.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "application/json"})
            answer = json.dumps(
                {
                    "id": "chatcmpl-7",
                    "object": "chat.completion",
                    "created": 1,
                    "model": "m",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(WORDS)},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": USAGE,
                }
            ).encode()
            response.content_length = len(answer)
            await response.prepare(request)
            await response.write(answer[:10])
            await self._wait()
            if self.cut:
                assert request.transport is not None
                request.transport.abort()
                return response
            await response.write(answer[10:])
            return response
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in EVENTS[:HEAD]:
            await response.write(event)
        await self._wait()
        if self.cut:
            assert request.transport is not None
            request.transport.abort()
            return response
        for event in EVENTS[HEAD:]:
            await response.write(event)
        await response.write_eof()
        return response


POLICY = """
backends:
  chat: {{url: "{url}"}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    backend: chat
    coalesce: true
"""


def request(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "user", "content": content}],
        **fields,
    }


STREAM: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}}


@dataclass
class Setup:
    chat: Chat
    running: Running
    session: aiohttp.ClientSession

    @property
    def flights(self) -> SingleFlight:
        found = self.running.gateway.registry.peek(FLIGHTS, "chat")
        assert isinstance(found, SingleFlight)
        return found

    def readers(self) -> int:
        match = re.search(r"readers=(\d+)", repr(self.flights))
        assert match is not None
        return int(match.group(1))

    async def post(self, body: Any, auth: str = "Bearer a") -> tuple[int, bytes, Any]:
        async with self.session.post(
            self.running.url + "/v1/chat/completions", json=body, headers={"Authorization": auth}
        ) as resp:
            return resp.status, await resp.read(), resp.headers

    async def open_stream(self, body: Any, auth: str = "Bearer a") -> aiohttp.ClientResponse:
        return await self.session.post(
            self.running.url + "/v1/chat/completions", json=body, headers={"Authorization": auth}
        )

    async def metric(self, name: str, **labels: str) -> float:
        async with self.session.get(self.running.admin_url + "/metrics") as resp:
            text = await resp.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0


async def read_events(resp: aiohttp.ClientResponse, n: int) -> bytes:
    buf = b""
    while buf.count(b"\n\n") < n:
        part = await resp.content.readany()
        assert part, buf
        buf += part
    return buf


@pytest.fixture
async def setup(serve_app, start_gateway, tmp_path) -> AsyncIterator[Setup]:
    chat = Chat()
    url = await serve_app(chat.app)
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(url=url))
    running = await start_gateway(policy=path)
    async with aiohttp.ClientSession() as session:
        yield Setup(chat, running, session)
        chat.gate.set()


async def test_ten_identical_concurrent_requests_make_one_upstream_call(setup):
    tasks = [asyncio.create_task(setup.post(request())) for _ in range(10)]
    await until(lambda: setup.flights.coalesced == 9 and len(setup.chat.calls) == 1)
    setup.chat.gate.set()
    results = await asyncio.gather(*tasks)

    assert len(setup.chat.calls) == 1
    bodies = {body for _, body, _ in results}
    assert len(bodies) == 1 and json.loads(bodies.pop())["choices"][0]["message"][
        "content"
    ] == "".join(WORDS)
    marks = sorted(headers.get("X-Gateway-Coalesced", "") for _, _, headers in results)
    assert marks == [""] + ["1"] * 9  # every joiner marked, the one that made the call not
    assert await setup.metric("gateway_coalesced_requests_total", route="chat") == 9


async def test_a_late_joiner_of_a_stream_gets_the_events_already_sent_then_the_live_ones(setup):
    leader = await setup.open_stream(request(**STREAM))
    seen_by_leader = await read_events(leader, HEAD)
    late = await setup.open_stream(request(**STREAM))
    whole = asyncio.create_task(setup.post(request()))  # non-streaming: the assembled answer
    await until(lambda: setup.flights.coalesced == 2)
    setup.chat.gate.set()
    rest_of_leader = await leader.read()
    late_bytes = await late.read()
    status, body, headers = await whole

    expected = b"".join(EVENTS)
    assert seen_by_leader + rest_of_leader == expected
    assert late_bytes == expected
    assert (
        late.headers["X-Gateway-Coalesced"] == "1" and "X-Gateway-Coalesced" not in leader.headers
    )
    assert status == 200 and headers["Content-Type"] == "application/json"
    answer = json.loads(body)
    assert answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "".join(WORDS)}
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"] == USAGE
    assert len(setup.chat.calls) == 1
    leader.close()
    late.close()


async def test_a_stream_without_usage_is_not_shared_with_callers_whose_answer_has_usage(setup):
    plain = await setup.open_stream(request(stream=True))
    await read_events(plain, HEAD)
    with_usage = asyncio.create_task(setup.post(request()))
    await until(lambda: len(setup.chat.calls) == 2)
    setup.chat.gate.set()
    status, body, _ = await with_usage
    assert status == 200 and json.loads(body)["usage"] == USAGE
    assert setup.flights.coalesced == 0
    plain.close()


async def test_the_upstream_call_runs_on_while_any_client_is_left(setup):
    leader = await setup.open_stream(request(**STREAM))
    await read_events(leader, HEAD)
    joiner = await setup.open_stream(request(**STREAM))
    await until(lambda: setup.readers() == 2)
    leader.close()
    await until(lambda: setup.readers() == 1)
    assert not setup.chat.cancelled.is_set()
    setup.chat.gate.set()

    assert await joiner.read() == b"".join(EVENTS)
    assert not setup.chat.cancelled.is_set() and len(setup.chat.calls) == 1
    joiner.close()


async def test_the_upstream_call_is_cancelled_once_every_client_has_left(setup):
    leader = await setup.open_stream(request(**STREAM))
    await read_events(leader, HEAD)
    joiner = await setup.open_stream(request(**STREAM))
    await read_events(joiner, HEAD)
    waiting = asyncio.create_task(setup.post(request()))
    await until(lambda: setup.readers() == 3)
    leader.close()
    joiner.close()
    await until(lambda: setup.readers() == 1)
    assert not setup.chat.cancelled.is_set()
    waiting.cancel()

    await asyncio.wait_for(setup.chat.cancelled.wait(), 5)
    await until(lambda: len(setup.flights) == 0)


async def test_a_stream_cut_off_reaches_every_joiner_as_an_error_never_as_a_whole_answer(setup):
    setup.chat.cut = True
    leader = await setup.open_stream(request(**STREAM))
    await read_events(leader, HEAD)
    joiner = await setup.open_stream(request(**STREAM))
    whole = asyncio.create_task(setup.post(request()))
    await until(lambda: setup.readers() == 3)
    setup.chat.gate.set()

    for resp in (leader, joiner):
        with pytest.raises(aiohttp.ClientPayloadError):
            await resp.read()  # the gateway closed the connection without the final chunk
        resp.close()
    status, body, _ = await whole
    assert status == 502 and json.loads(body)["error"]["type"] == "server_error"
    assert len(setup.chat.calls) == 1


async def test_a_failed_shared_call_fails_every_joiner(setup):
    setup.chat.cut = True
    tasks = [asyncio.create_task(setup.post(request())) for _ in range(4)]
    await until(lambda: setup.flights.coalesced == 3 and len(setup.chat.calls) == 1)
    setup.chat.gate.set()
    results = await asyncio.gather(*tasks)

    assert [status for status, _, _ in results] == [502] * 4
    assert len(setup.chat.calls) == 1


async def test_requests_of_different_tenants_are_never_coalesced(setup):
    tasks = [
        asyncio.create_task(setup.post(request(), auth=f"Bearer {t}")) for t in ("a", "b", "a")
    ]
    await until(lambda: len(setup.chat.calls) == 2 and setup.flights.coalesced == 1)
    setup.chat.gate.set()
    results = await asyncio.gather(*tasks)

    assert all(status == 200 for status, _, _ in results)
    assert sorted(auth for _, auth in setup.chat.calls) == ["Bearer a", "Bearer b"]


async def test_sampled_requests_are_never_coalesced(setup):
    body = request(temperature=0.7)
    tasks = [asyncio.create_task(setup.post(body)) for _ in range(3)]
    await until(lambda: len(setup.chat.calls) == 3)
    setup.chat.gate.set()
    results = await asyncio.gather(*tasks)

    assert all(status == 200 for status, _, _ in results)
    assert setup.flights.coalesced == 0
