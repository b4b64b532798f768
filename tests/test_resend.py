"""The one resend: a pooled keep-alive connection the backend closes without answering.
The backend may have run the request before closing, so only a request that may be
repeated is sent again: safe methods, inference calls (OpenAI, KServe V2, TF Serving, TEI),
and any request with an ``Idempotency-Key``; any other POST, a PUT, PATCH or DELETE gets a
502 instead."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from gateway.transport.pool import SETTLE_S
from tests.helpers import CHAT, until, write_policy
from tests.upstreams import RawExchange

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def closes_its_second_request(exchanges: list[RawExchange]):
    """Answer the first request of connection 1, then close it on the second unanswered."""

    def respond(ex: RawExchange):
        on_first = [e for e in exchanges if e.connection == 1]
        if ex.connection == 1 and len(on_first) == 2:
            return b"", "close"
        return OK

    return respond


@pytest.mark.parametrize(
    ("method", "path", "headers", "resent"),
    [
        ("GET", "/v1/models", {}, True),
        ("HEAD", "/v1/models", {}, True),
        ("OPTIONS", "/v1/models", {}, True),
        ("POST", "/v1/chat/completions", {}, True),
        ("POST", "/v1/embeddings", {}, True),
        ("POST", "/v2/models/rowsum/infer", {}, True),
        ("POST", "/v1/models/sum:predict", {}, True),
        ("POST", "/embed", {}, True),
        ("POST", "/v1/orders", {}, False),
        ("POST", "/v1/orders", {"Idempotency-Key": "k-1"}, True),
        ("PUT", "/v1/files/a", {}, False),
        ("PATCH", "/v1/files/a", {}, False),
        ("DELETE", "/v1/files/a", {}, False),
    ],
)
async def test_a_stale_connection_resends_only_what_may_be_repeated(
    raw_backend, start_gateway, method, path, headers, resent
):
    exchanges: list[RawExchange] = []
    url, backend = await raw_backend(closes_its_second_request(exchanges))
    backend.exchanges = exchanges
    gw = await start_gateway(upstream=url)
    body = CHAT if path == "/v1/chat/completions" else {"model": "m", "input": "x"}
    async with httpx.AsyncClient() as client:
        assert (await client.get(gw.url + "/v1/models")).status_code == 200
        await asyncio.sleep(SETTLE_S * 3)  # a connection idle this long is reused for any
        kwargs: dict[str, Any] = {"json": body} if method in ("POST", "PUT", "PATCH") else {}
        r = await client.request(method, gw.url + path, headers=headers, **kwargs)
    if resent:
        assert r.status_code == 200
        assert [e.connection for e in exchanges] == [1, 1, 2]
        assert gw.gateway.metrics.upstream_retries.labels("upstream")._value.get() == 1
    else:
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unavailable"
        assert f"a {method} is not sent twice" in r.json()["error"]["message"]
        assert [e.connection for e in exchanges] == [1, 1]


async def test_a_request_sent_once_is_never_written_on_a_connection_that_may_be_closing(
    start_gateway, tmp_path
):
    """llama.cpp's server closes a connection right after a stream it framed as kept
    alive.  A POST that may not be sent twice, waiting for the pool's one connection, is
    not written on it the moment it comes back (it would be lost with it: a 502); it gets a
    new one.  An idle connection that stayed open is still reused."""
    gate, seen = asyncio.Event(), list[tuple[int, str]]()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        number = len({c for c, _ in seen}) + 1
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = [
                int(x.split(b":")[1])
                for x in head.lower().split(b"\r\n")
                if x.startswith(b"content-length:")
            ]
            await reader.readexactly(length[0] if length else 0)
            seen.append((number, head.split(b" ")[1].decode()))
            if len(seen) == 1:
                await gate.wait()
            writer.write(OK)
            await writer.drain()
            if len(seen) == 1:  # the answer, then the close, as llama-server after a stream
                break
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    text = (
        f"backends: {{main: {{url: '{url}', max_connections: 1}}}}\nroutes: [{{backend: main}}]\n"
    )
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    try:
        async with httpx.AsyncClient() as client:
            first = asyncio.create_task(client.get(gw.url + "/v1/models"))
            await until(lambda: len(seen) == 1)
            order = asyncio.create_task(client.post(gw.url + "/v1/orders", json={"n": 1}))
            await asyncio.sleep(0.05)  # waiting for the pool's only connection
            gate.set()
            assert (await first).status_code == 200
            assert (await order).status_code == 200
            await asyncio.sleep(SETTLE_S * 3)
            again = await client.post(gw.url + "/v1/orders", json={"n": 2})
        assert again.status_code == 200
        assert seen == [(1, "/v1/models"), (2, "/v1/orders"), (2, "/v1/orders")]
    finally:
        server.close()
        await server.wait_closed()
