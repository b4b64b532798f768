"""A minimal, fast HTTP/1.1 backend for proxy benchmarks (so the backend is not the
bottleneck): answers a fixed OpenAI chat completion, or an SSE stream when the body asks
for ``"stream": true``, and ``GET /v1/models`` with its one model (for ``model_version:
auto``).  Run: ``python -m bench.backend PORT``."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import cast

CHAT = json.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1,
        "model": "bench",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(CHAT)
) + CHAT
MODELS = b'{"object":"list","data":[{"id":"bench","root":"/models/bench-v1"}]}'
MODELS_RESPONSE = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(MODELS)
) + MODELS
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class Backend(asyncio.Protocol):
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            i = head.find(b"content-length:")
            if i >= 0:
                length = int(
                    head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]
                )
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[end + 4 : total]
            self.buf = self.buf[total:]
            if head.startswith(b"get /v1/models "):
                self.transport.write(MODELS_RESPONSE)
            elif b'"stream": true' in body or b'"stream":true' in body:
                asyncio.get_running_loop().create_task(self.stream())
            else:
                self.transport.write(RESPONSE)

    async def stream(self) -> None:
        t = self.transport
        t.write(STREAM_HEAD + _chunk(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'))
        await asyncio.sleep(0.005)
        t.write(
            _chunk(b'data: {"choices":[{"delta":{"content":"b"}}]}\n\n')
            + _chunk(b"data: [DONE]\n\n")
            + b"0\r\n\r\n"
        )


async def main(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        Backend, "127.0.0.1", port, backlog=1024
    )
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    import uvloop

    uvloop.run(main(int(sys.argv[1])))
