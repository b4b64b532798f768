"""Small upstreams the proxy tests talk to, recording what reached them: aiohttp apps, and
a raw-socket backend whose answers are exactly the bytes a test gives it."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
from collections.abc import Callable
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


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), not a FIN: SO_LINGER with a zero timeout."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


@dataclass
class RawExchange:
    """One request as a raw backend read it: its connection's number and its bytes."""

    connection: int
    head: bytes
    body: bytes

    @property
    def request_line(self) -> str:
        return self.head.split(b"\r\n", 1)[0].decode("latin-1")

    def header(self, name: str) -> str | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.decode("latin-1").partition(":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


Answer = bytes | tuple[bytes, str]
"""What a raw backend sends: bytes, or (bytes, then "keep" | "close" | "reset" | "hang")."""


class RawBackend:
    """A backend on a raw socket that answers each request with exactly the bytes
    ``respond(exchange)`` returns (framing, mistakes and all), then keeps the connection,
    closes it, resets it or leaves it hanging; ``exchanges`` records every request."""

    def __init__(self, respond: Callable[[RawExchange], Answer]) -> None:
        self.respond = respond
        self.exchanges: list[RawExchange] = []
        self.connections = 0
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        self._writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                body = await reader.readexactly(length)
                exchange = RawExchange(number, head, body)
                self.exchanges.append(exchange)
                answer = self.respond(exchange)
                data, then = answer if isinstance(answer, tuple) else (answer, "keep")
                writer.write(data)
                await writer.drain()
                if then == "close":
                    writer.close()
                    return
                if then == "reset":
                    reset(writer)
                    return
                if then == "hang":
                    await asyncio.Event().wait()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        writer.close()

    def drop_connections(self) -> None:
        """Abort every connection (a backend that restarted)."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.drop_connections()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class Exporter:
    """A DCGM exporter and a vLLM ``/metrics`` in one; the test sets the values, and
    ``broken`` makes the scrape answer 500."""

    def __init__(self) -> None:
        self.temperature = 50.0
        self.fb_used_mib = 10000
        self.fb_free_mib = 70000
        self.kv_cache = 0.1
        self.waiting = 0
        self.broken = False
        self.scrapes = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.broken:
            return web.Response(status=500, text="exporter down")
        labels = 'gpu="0",UUID="GPU-1",device="nvidia0",modelName="H100",Hostname="n"'
        lines = [
            f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} {self.temperature}",
            f"DCGM_FI_DEV_FB_USED{{{labels}}} {self.fb_used_mib}",
            f"DCGM_FI_DEV_FB_FREE{{{labels}}} {self.fb_free_mib}",
            f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 90",
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_cache}',
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}',
        ]
        return web.Response(text="\n".join(lines) + "\n")
