"""Requests aiohttp cannot parse (a garbled request line, a bad header, a head too large)
are refused in the gateway's OpenAI shape, the connection is closed, nothing reaches the
backend, and the gateway goes on serving."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from tests.helpers import CHAT
from tests.upstreams import Recorder


@pytest.fixture
async def upstream(serve_app):
    recorder = Recorder()
    return recorder, await serve_app(recorder.app())


async def send_raw(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Write ``data`` on a fresh connection; the status, headers and body of the answer,
    read to the connection's close."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 5)  # to EOF: the gateway closes
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        pytest.param(b"HELLO THERE\r\n\r\n", 400, id="garbled request line"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n", 400, id="bad header"),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
            431,
            id="header value too large",
        ),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: x\r\nX-Path: /" + b"a" * 70_000 + b"\r\n\r\n",
            431,
            id="header value like a path, too large",
        ),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: x\r\nX-" + b"a" * 70_000 + b": 1\r\n\r\n",
            431,
            id="header name too large",
        ),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: x\r\n"
            + b"".join(b"X-%d: v\r\n" % i for i in range(1000))
            + b"\r\n",
            431,
            id="too many headers",
        ),
        pytest.param(
            b"GET / HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"a" * 70_000 + b"\r\n\r\n",
            431,
            id="header value like a request line, too large",
        ),
        pytest.param(
            b"GET /v1/models?q=" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            414,
            id="request target too long",
        ),
        pytest.param(
            b"M-SEARCH /" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n",
            414,
            id="request target too long, another method",
        ),
        pytest.param(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            b"Content-Length: 5\r\nContent-Length: 6\r\n\r\nhello",
            400,
            id="conflicting content-length",
        ),
    ],
)
async def test_unparsable_requests_get_an_openai_shaped_4xx_and_the_gateway_serves_on(
    data, expected, upstream, start_gateway, caplog
):
    """400 for what cannot be read, 431 for a head too large, 414 for a target too long."""
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    with caplog.at_level(logging.WARNING):
        status, headers, body = await send_raw(gw.url, data)
    assert status == expected
    assert headers["content-type"].startswith("application/json")
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "malformed_request"
    assert error["message"] and "\n" not in error["message"]
    assert recorder.seen == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    async with httpx.AsyncClient() as client:
        ok = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200
