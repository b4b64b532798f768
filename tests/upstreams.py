"""Small aiohttp upstreams the proxy tests talk to, recording what reached them."""

from __future__ import annotations

import asyncio
import gzip
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Seen:
    """One request as the upstream received it."""

    method: str
    path_qs: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Recorder:
    """An OpenAI-ish upstream that records requests and answers predictably."""

    seen: list[Seen] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    stream_started: asyncio.Event = field(default_factory=asyncio.Event)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/embeddings", self.echo)
        app.router.add_post("/v1/completions", self.echo)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/gated", self.gated_stream)
        app.router.add_get("/gzip", self.gzipped)
        app.router.add_get("/slow", self.slow)
        app.router.add_route("*", "/{tail:.*}", self.echo)
        return app

    async def _record(self, request: web.Request) -> bytes:
        body = await request.read()
        self.seen.append(Seen(request.method, request.path_qs, dict(request.headers), body))
        self.arrived.set()
        return body

    async def echo(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        return web.json_response(
            {"path": request.path_qs, "len": len(body), "method": request.method},
            headers={"X-Upstream": "yes"},
        )

    async def models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": "llama-3", "object": "model", "created": 0, "owned_by": "test"}],
            }
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        raw = await self._record(request)
        data = json.loads(raw)
        if data.get("model") == "bad-request":
            return web.json_response(
                {
                    "error": {
                        "message": "upstream says no",
                        "type": "invalid_request_error",
                        "code": "upstream_no",
                    }
                },
                status=422,
            )
        text = "echo: " + str(data["messages"][-1].get("content"))
        if not data.get("stream"):
            return web.json_response(chat_completion(data.get("model", "m"), text))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in chat_chunks(data.get("model", "m"), text.split(" ")):
            await response.write(event)
        return response

    async def gated_stream(self, request: web.Request) -> web.StreamResponse:
        """Sends one event, then waits for ``release`` before finishing."""
        await self._record(request)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"part": 1}\n\n')
        self.stream_started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        await response.write(b'data: {"part": 2}\n\ndata: [DONE]\n\n')
        return response

    async def slow(self, request: web.Request) -> web.Response:
        await self._record(request)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return web.json_response({"slow": True})

    async def gzipped(self, request: web.Request) -> web.Response:
        await self._record(request)
        payload = gzip.compress(b'{"compressed": true}')
        return web.Response(
            body=payload, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}
        )


def chat_completion(model: str, text: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {
            "prompt_tokens": 3,
            "completion_tokens": len(text.split()),
            "total_tokens": 3 + len(text.split()),
        },
    }


def chat_chunks(model: str, words: list[str]) -> list[bytes]:
    def chunk(
        delta: dict[str, Any], finish: str | None = None, usage: dict[str, int] | None = None
    ) -> bytes:
        body: dict[str, Any] = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
            if usage is None
            else [],
        }
        if usage is not None:
            body["usage"] = usage
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": (" " if i else "") + w}) for i, w in enumerate(words)]
    events.append(chunk({}, "stop"))
    events.append(
        chunk(
            {},
            usage={
                "prompt_tokens": 3,
                "completion_tokens": len(words),
                "total_tokens": 3 + len(words),
            },
        )
    )
    events.append(b"data: [DONE]\n\n")
    return events
