"""A stream is replayed from the cache byte for byte as it was recorded: every field of
every event (``event:``, ``id:``, ``retry:``, comments, several ``data:`` lines), its line
endings and its ``[DONE]``.  On real sockets."""

from __future__ import annotations

import json
import struct

import httpx
from aiohttp import web

from gateway.cache.entry import CachedResponse, dumps, loads
from gateway.openai.sse import events_to_json, render_sse
from tests.helpers import write_policy

CHUNK = {
    "id": "c-1",
    "object": "chat.completion.chunk",
    "model": "m",
    "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}],
}
LAST = {**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
USAGE = {**CHUNK, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
STREAM = (
    ": a comment the server sent\r\n\r\n"
    "event: message\r\nid: 1\r\nretry: 3000\r\n"
    # one event, its JSON split over two data lines (legal SSE)
    'data: {"id": "c-1", "object": "chat.completion.chunk", "model": "m",\r\n'
    'data:  "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": null}]}\r\n'
    "\r\n"
    f"id: 2\ndata: {json.dumps(LAST)}\n\n"
    f"data: {json.dumps(USAGE)}\n\n"
    "data: [DONE]\n\n"
).encode()


async def test_a_multi_line_stream_with_every_field_replays_byte_for_byte(
    serve_app, start_gateway, tmp_path
):
    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(0, len(STREAM), 17):  # any network chunking
            await response.write(STREAM[i : i + 17])
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f'backends: {{m: {{url: "{url}"}}}}\nroutes: [{{backend: m, cache: {{ttl_s: 60}}}}]\n',
    )
    gw = await start_gateway(policy=policy)
    ask = {
        "model": "m",
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
    }
    async with httpx.AsyncClient(base_url=gw.url) as client:
        first = await client.post("/v1/chat/completions", json=ask)
        replay = await client.post("/v1/chat/completions", json=ask)
        whole = await client.post("/v1/chat/completions", json={**ask, "stream": False})
    assert first.headers["X-Gateway-Cache"] == "miss" and first.content == STREAM
    assert replay.headers["X-Gateway-Cache"] == "hit" and replay.content == STREAM
    assert whole.headers["X-Gateway-Cache"] == "hit"
    assert whole.json()["choices"][0]["message"]["content"] == "Hi"


def test_an_entry_stored_before_events_were_kept_as_sent_replays_as_its_payloads():
    """Older entries hold the data payloads only (no [DONE]): read, they become blocks."""
    entry = CachedResponse(200, (), None, (json.dumps(LAST),), 0.0, "m", "", "r", "s")
    data = dumps(entry)
    magic, flags, size = struct.unpack_from(">4sBI", data)
    head = json.loads(data[9 : 9 + size])
    head.pop("v")  # as written before
    old_head = json.dumps(head, separators=(",", ":")).encode()
    legacy = struct.pack(">4sBI", magic, flags, len(old_head)) + old_head + data[9 + size :]
    events = loads(legacy).events
    assert events is not None
    assert render_sse(events) == f"data: {json.dumps(LAST)}\n\ndata: [DONE]\n\n".encode()
    assert events_to_json(events)["choices"][0]["finish_reason"] == "stop"


async def test_a_stream_cached_without_usage_never_answers_a_client_that_needs_usage(
    serve_app, start_gateway, tmp_path
):
    """Stored from a client that did not ask for usage, a stream has no usage chunk: a
    client asking for one (or a non-streaming client, whose answer always has usage) is a
    miss, and the answer stored then carries usage for everyone after it."""
    usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(f"data: {json.dumps(CHUNK)}\n\ndata: {json.dumps(LAST)}\n\n".encode())
        if (body.get("stream_options") or {}).get("include_usage"):
            tail = {**CHUNK, "choices": [], "usage": usage}
            await response.write(f"data: {json.dumps(tail)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f'backends: {{m: {{url: "{url}"}}}}\nroutes: [{{backend: m, cache: {{ttl_s: 60}}}}]\n',
    )
    gw = await start_gateway(policy=policy)
    ask = {
        "model": "m",
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    with_usage = {**ask, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        plain = await client.post("/v1/chat/completions", json=ask)
        asked = await client.post("/v1/chat/completions", json=with_usage)
        again = await client.post("/v1/chat/completions", json=with_usage)
        whole = await client.post("/v1/chat/completions", json={**ask, "stream": False})
    assert plain.headers["X-Gateway-Cache"] == "miss" and b'"usage"' not in plain.content
    assert asked.headers["X-Gateway-Cache"] == "miss" and b'"usage"' in asked.content
    assert again.headers["X-Gateway-Cache"] == "hit" and again.content == asked.content
    assert whole.headers["X-Gateway-Cache"] == "hit" and whole.json()["usage"] == usage
