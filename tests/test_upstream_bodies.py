"""Response bodies of every framing relayed intact: large with a length, chunked,
close-delimited (no length), empty (204), and HEAD."""

from __future__ import annotations

import asyncio
import hashlib

import httpx
from aiohttp import web


async def test_large_and_chunked_bodies_are_relayed_byte_for_byte(serve_app, start_gateway):
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: past the size read whole

    async def large(request: web.Request) -> web.Response:
        return web.Response(body=big, content_type="application/octet-stream")

    async def chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(0, len(big), 100_003):
            await response.write(big[i : i + 100_003])
        return response

    async def small(request: web.Request) -> web.Response:
        return web.Response(body=b"0123456789")

    async def empty(request: web.Request) -> web.Response:
        return web.Response(status=204)

    app = web.Application()
    app.router.add_get("/large", large)
    app.router.add_get("/chunked", chunked)
    app.router.add_get("/small", small)
    app.router.add_route("*", "/empty", empty)
    gw = await start_gateway(upstream=await serve_app(app))
    async with httpx.AsyncClient() as client:
        large_r = await client.get(gw.url + "/large")
        chunked_r = await client.get(gw.url + "/chunked")
        empty_r = await client.delete(gw.url + "/empty")
        head_r = await client.head(gw.url + "/large")
        small_head = await client.head(gw.url + "/small")
    digest = hashlib.sha256(big).hexdigest()
    assert hashlib.sha256(large_r.content).hexdigest() == digest
    assert int(large_r.headers["Content-Length"]) == len(big)
    assert hashlib.sha256(chunked_r.content).hexdigest() == digest
    assert empty_r.status_code == 204 and empty_r.content == b""
    assert head_r.status_code == 200 and head_r.content == b""
    assert int(head_r.headers["Content-Length"]) == len(big)
    assert small_head.content == b"" and small_head.headers["Content-Length"] == "10"


async def test_close_delimited_body_without_length_is_relayed_whole(start_gateway):
    payload = b"x" * 200_000 + b"end"

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n" + payload)
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(upstream=f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient() as client:
            first = await client.get(gw.url + "/legacy")
            second = await client.get(gw.url + "/legacy")  # the closed socket is not reused
        assert first.content == payload and second.content == payload
    finally:
        server.close()
        await server.wait_closed()
