"""The hand-written HTTP/1.1 upstream client against raw sockets: interim responses,
chunk extensions and trailers, malformed framing (a 502, never a hang or a wrong body),
and connections reused only after a cleanly framed response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

Responder = Callable[[int], bytes]


@pytest.fixture
async def raw_backend() -> AsyncIterator[Callable[[Responder], Awaitable[tuple[str, list[int]]]]]:
    """A backend answering each request with the bytes ``respond(n)`` returns (n counts
    requests on the connection); returns its URL and the list of connections' counts."""
    servers: list[asyncio.Server] = []

    async def start(respond: Responder) -> tuple[str, list[int]]:
        connections: list[int] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(0)
            index = len(connections) - 1
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        (
                            int(line.split(b":")[1])
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        ),
                        0,
                    )
                    await reader.readexactly(length)
                    connections[index] += 1
                    writer.write(respond(connections[index]))
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", connections

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def test_interim_103_is_skipped_and_the_final_answer_relayed(raw_backend, start_gateway):
    url, _ = await raw_backend(
        lambda n: (
            b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n"
            b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        )
    )
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.url + "/x")
    assert (r.status_code, r.content) == (200, b"ok")


async def test_chunk_extensions_and_trailers_are_understood_and_the_connection_reused(
    raw_backend, start_gateway
):
    body = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    url, connections = await raw_backend(lambda n: body)
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        first = await client.get(gw.url + "/x")
        second = await client.get(gw.url + "/x")
    assert first.content == second.content == b"hello world"
    assert connections == [2]


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n0123456789",
        b"NOT-HTTP 200 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    ],
    ids=["bad-chunk-size", "bad-length", "bad-status-line", "head-too-large"],
)
async def test_malformed_framing_is_a_502_not_a_hang_or_a_wrong_body(
    raw_backend, start_gateway, answer
):
    url, _ = await raw_backend(lambda n: answer)
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient(timeout=10) as client:
        try:
            r = await client.get(gw.url + "/x")
        except httpx.RemoteProtocolError:
            return  # a chunked answer already under way is cut, never completed
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unavailable"


async def test_bytes_after_a_complete_answer_keep_that_connection_out_of_the_pool(
    raw_backend, start_gateway
):
    url, connections = await raw_backend(
        lambda n: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokGARBAGE"
    )
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        first = await client.get(gw.url + "/x")
        second = await client.get(gw.url + "/x")
    assert first.content == second.content == b"ok"
    assert connections == [1, 1]
