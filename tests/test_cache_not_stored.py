"""Why an answer a caching route got was not stored, counted in
``gateway_cache_not_stored_total{route, reason}`` beside the backend's own reasons
(``Cache-Control``, ``Vary``): ``unfinished`` (a stream cut off, or ended without its end or
after an error), ``too_large`` (a stream over the 4 MiB an entry records), ``id_framed`` (a
KServe answer echoing an id it frames by length).  Each such answer reaches its client as
the backend sent it, and the next asking is a miss."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.cache.replies import MAX_RECORDED_BYTES
from gateway.pipeline import Reply
from gateway.testing import Sent, json_reply, stream_reply
from tests.helpers import policy

URL = "http://main.test"
NOT_STORED = "gateway_cache_not_stored_total"
CHAT = {
    "model": "m",
    "temperature": 0,
    "stream": True,
    "messages": [{"role": "user", "content": "Hi"}],
}
MESSAGES = {
    "model": "claude",
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
    "messages": CHAT["messages"],
}


def chunk(content: str | None = None, finish: str | None = None) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    event = {"id": "c1", "object": "chat.completion.chunk", "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(event).encode() + b"\n\n"


WHOLE = (chunk("Hel"), chunk("lo"), chunk(None, "stop"), b"data: [DONE]\n\n")


def anthropic(*names: str) -> tuple[bytes, ...]:
    return tuple(f'event: {name}\ndata: {{"type": "{name}"}}\n\n'.encode() for name in names)


class Backend:
    """Answers every call with ``chunks`` as a stream (``cut``: broken after them)."""

    def __init__(
        self, chunks: tuple[bytes, ...], cut: bool = False, kind: str = "text/event-stream"
    ) -> None:
        self.chunks, self.cut, self.kind, self.calls = chunks, cut, kind, 0

    async def __call__(self, sent: Sent) -> Reply:
        self.calls += 1
        return stream_reply(self._relay(), content_type=self.kind)

    async def _relay(self) -> AsyncIterator[bytes]:
        for piece in self.chunks:
            yield piece
        if self.cut:
            raise ConnectionResetError("the server went away")


async def twice(pipeline: Any, backend: Any, path: str, body: Any) -> Any:
    """Two askings through a caching route, both misses; the gateway."""
    gw = await pipeline(policy({"main": {"url": URL}}, {"cache": {"ttl_s": 60}}), backend)
    for _ in range(2):
        answer = await gw.post(path, body)
        assert answer.headers["X-Gateway-Cache"] == "miss"
    return gw


@pytest.mark.parametrize(
    ("chunks", "cut"),
    [
        (WHOLE[:2], True),  # cut off mid-stream
        (WHOLE[:2], False),  # ended without a finish_reason or [DONE]
        ((chunk("Hel"), b'data: {"error": {"message": "boom"}}\n\n'), False),
    ],
)
async def test_an_openai_stream_that_did_not_end_well_is_counted_unfinished(pipeline, chunks, cut):
    backend = Backend(chunks, cut)
    gw = await twice(pipeline, backend, "/v1/chat/completions", CHAT)
    assert backend.calls == 2
    assert gw.metric(NOT_STORED, route="chat", reason="unfinished") == 2


async def test_a_stream_past_what_an_entry_records_is_counted_too_large(pipeline):
    piece = "x" * 64_000
    big = tuple(chunk(piece) for _ in range(MAX_RECORDED_BYTES // 64_000 + 2)) + WHOLE[2:]
    gw = await twice(pipeline, Backend(big), "/v1/chat/completions", CHAT)
    assert gw.metric(NOT_STORED, route="chat", reason="too_large") == 2
    assert gw.metric(NOT_STORED, route="chat", reason="unfinished") is None


async def test_a_servers_own_stream_past_what_an_entry_records_is_counted_too_large(pipeline):
    """Ollama's greedy stream, recorded as it came (not as events): past 4 MiB it is relayed
    whole and not kept, the recording dropped."""
    line = b'{"message":{"role":"assistant","content":"' + b"x" * 64_000 + b'"},"done":false}\n'
    lines = (line,) * (MAX_RECORDED_BYTES // len(line) + 2) + (b'{"done":true}\n',)
    backend = Backend(lines, kind="application/x-ndjson")
    routes = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, routes), backend)
    body = {"model": "m", "messages": CHAT["messages"], "options": {"temperature": 0}}
    for _ in range(2):
        answer = await gw.post("/api/chat", body)
        assert answer.headers["X-Gateway-Cache"] == "miss" and answer.body == b"".join(lines)
    assert gw.metric(NOT_STORED, route="chat", reason="too_large") == 2


async def test_an_anthropic_stream_without_its_end_is_counted_unfinished(pipeline):
    events = anthropic("message_start", "content_block_delta", "message_delta")
    gw = await twice(pipeline, Backend(events), "/v1/messages", MESSAGES)
    assert gw.metric(NOT_STORED, route="chat", reason="unfinished") == 2


async def test_a_kserve_answer_framing_an_echoed_id_is_counted_id_framed(pipeline):
    def framed(sent: Sent) -> Reply:
        answer = {"id": "a-1", "outputs": []}
        return json_reply(answer, headers=[("Inference-Header-Content-Length", "24")])

    routes = {"match": {"path": "*"}, "cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, routes), framed)
    body = json.dumps({"id": "a-1", "inputs": []}).encode()
    for _ in range(2):
        answer = await gw.request("POST", "/v2/models/m/infer", body=body)
        assert answer.headers["X-Gateway-Cache"] == "miss"
    assert gw.metric(NOT_STORED, route="chat", reason="id_framed") == 2


async def test_a_stream_that_ended_well_is_stored_and_counted_nowhere(pipeline):
    backend = Backend(WHOLE)
    gw = await pipeline(policy({"main": {"url": URL}}, {"cache": {"ttl_s": 60}}), backend)
    states = [(await gw.post("/v1/chat/completions", CHAT)).headers["X-Gateway-Cache"]]
    states.append((await gw.post("/v1/chat/completions", CHAT)).headers["X-Gateway-Cache"])
    assert states == ["miss", "hit"] and backend.calls == 1
    exposition = gw.gateway.metrics.exposition().decode()
    assert NOT_STORED + "{" not in exposition
