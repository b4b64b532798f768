"""Slow and hostile clients against the data plane's limits (set small here): a trickled
head, a stalled body, an idle keep-alive connection, a client that never reads, heads and
bodies too large, too many connections.  Each connection is closed at its limit, the
gateway's memory stays bounded, and it serves on.  Waits are for the gateway to act,
bounded generously; nothing asserts on how fast."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from tests.helpers import CHAT, parse_responses, until, write_policy
from tests.upstreams import Recorder

LIMITS = """
server:
  header_timeout_s: 0.5
  body_timeout_s: 0.5
  min_body_rate_bytes_s: 64
  keepalive_timeout_s: 0.5
  client_send_timeout_s: 0.5
  max_header_bytes: 16384
  max_header_count: 20
  max_connections: 64
  max_buffered_body_bytes: 1048576
"""


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


async def open_raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def closed(reader: asyncio.StreamReader, within_s: float = 10.0) -> bytes:
    """What the gateway sent until it closed the connection (within a generous bound)."""
    return await asyncio.wait_for(reader.read(), within_s)


def timeouts(gw, phase: str) -> float:
    return gw.gateway.metrics.client_timeouts.labels(phase)._value.get()


@pytest.fixture
async def limited(serve_app, start_gateway, tmp_path):
    recorder = Recorder()
    url = await serve_app(recorder.app())
    policy = write_policy(
        tmp_path, f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n' + LIMITS
    )
    return recorder, await start_gateway(policy=policy)


async def test_a_trickled_head_is_answered_408_at_its_limit(limited):
    """Slowloris: 40 connections sending a head a few bytes at a time never complete it;
    each is answered 408 and closed once ``header_timeout_s`` passes."""
    recorder, gw = limited
    head = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Slow: " + b"a" * 200

    async def trickle() -> bytes:
        reader, writer = await open_raw(gw.url)
        answer = asyncio.create_task(closed(reader))
        for i in range(0, len(head), 4):
            if answer.done():
                break
            writer.write(head[i : i + 4])
            await asyncio.sleep(0.05)
        data = await answer
        writer.close()
        return data

    answers = await asyncio.gather(*(trickle() for _ in range(40)))
    for data in answers:
        [answer] = parse_responses(data)
        assert answer.status == 408
        assert answer.json()["error"]["code"] == "request_timeout"
    assert timeouts(gw, "head") == 40
    assert recorder.seen == []


async def test_a_connection_that_never_speaks_is_closed_at_the_head_limit(limited):
    _, gw = limited
    readers = [await open_raw(gw.url) for _ in range(20)]
    for reader, writer in readers:
        assert await closed(reader) == b""  # closed without an answer: nothing was asked
        writer.close()
    assert timeouts(gw, "head") == 20


async def test_a_stalled_body_is_answered_408_at_its_limit(limited):
    recorder, gw = limited
    reader, writer = await open_raw(gw.url)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"model": "m", '
    )
    [answer] = parse_responses(await closed(reader))
    writer.close()
    assert answer.status == 408 and "request body" in answer.json()["error"]["message"]
    assert timeouts(gw, "body") == 1
    assert recorder.seen == []


async def test_a_slow_but_steady_body_is_not_a_timeout(limited):
    """A body at its minimum pace (here 64 bytes/s; this one is about 100) is never a
    timeout, however long it takes in all: the limit is on falling behind, not on the
    whole body."""
    recorder, gw = limited
    body = json.dumps(CHAT).encode()
    reader, writer = await open_raw(gw.url)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    for i in range(0, len(body), len(body) // 5 + 1):
        writer.write(body[i : i + len(body) // 5 + 1])
        await asyncio.sleep(0.2)  # 1 s in all, 0.2 s of silence at a time: within 0.5 s
    [answer] = parse_responses(await closed(reader))
    writer.close()
    assert answer.status == 200
    assert recorder.seen[-1].body == body


async def test_an_idle_keepalive_connection_is_closed_at_its_limit(limited):
    _, gw = limited
    reader, writer = await open_raw(gw.url)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
    [answer] = parse_responses(await closed(reader))  # answered, then closed once idle
    writer.close()
    assert answer.status == 200
    assert timeouts(gw, "idle") == 1


async def test_heads_too_large_are_431_and_memory_stays_bounded(limited):
    """20 clients each sending a 7 MB head: each is answered 431 at 16 KiB and closed, so
    the gateway (in this process) holds no more than a read buffer of each."""
    recorder, gw = limited
    piece = b"a" * 65536
    before = rss_bytes()

    async def flood() -> bytes:
        reader, writer = await open_raw(gw.url)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Big: ")
        try:
            for _ in range(7 * 16):  # 7 MiB
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            pass
        data = await closed(reader)
        writer.close()
        return data

    answers = await asyncio.gather(*(flood() for _ in range(20)))
    grown = rss_bytes() - before
    for data in answers:
        [answer] = parse_responses(data)
        assert answer.status == 431
    assert grown < 48 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB"
    assert recorder.seen == []


async def test_a_request_target_too_long_is_414(limited):
    _, gw = limited
    reader, writer = await open_raw(gw.url)
    writer.write(b"GET /v1/models?q=" + b"a" * 20000 + b" HTTP/1.1\r\nHost: gw\r\n\r\n")
    [answer] = parse_responses(await closed(reader))
    writer.close()
    assert answer.status == 414


async def test_too_many_header_lines_are_431(limited):
    _, gw = limited
    reader, writer = await open_raw(gw.url)
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n"
        + b"".join(b"X-%d: v\r\n" % i for i in range(30))
        + b"\r\n"
    )
    [answer] = parse_responses(await closed(reader))
    writer.close()
    assert answer.status == 431 and "header lines" in answer.json()["error"]["message"]


async def test_bodies_past_the_shared_buffer_are_503_with_retry_after(limited):
    """Stalled bodies of 600 KiB each: the first fits in the 1 MiB shared budget, the
    second would pass it and is answered 503 with Retry-After; once the first completes,
    a third fits again."""
    _recorder, gw = limited
    part = b'{"model": "m", "pad": "' + b"x" * (600 * 1024)
    rest = b'", "messages": [{"role": "user", "content": "hi"}]}'
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n" % (len(part) + len(rest))
    )
    first_r, first_w = await open_raw(gw.url)
    first_w.write(head + part)
    await first_w.drain()
    await until(lambda: gw.gateway._server.body_bytes >= len(part))
    second_r, second_w = await open_raw(gw.url)
    second_w.write(head + part)
    with_refusal = parse_responses(await closed(second_r))
    second_w.close()
    assert [a.status for a in with_refusal] == [503]
    assert with_refusal[0].headers["retry-after"] == "1"
    assert with_refusal[0].json()["error"]["code"] == "overloaded"
    first_w.write(rest)
    [done] = parse_responses(await closed(first_r))
    first_w.close()
    assert done.status == 200
    assert gw.gateway._server.body_bytes == 0
    third_r, third_w = await open_raw(gw.url)
    third_w.write(head + part + rest)
    [third] = parse_responses(await closed(third_r))
    third_w.close()
    assert third.status == 200


async def test_max_connections_reclaims_idle_ones_then_refuses(serve_app, start_gateway, tmp_path):
    """At the limit, the connection idle longest makes room; with none idle, a new
    connection is closed at once and counted as refused."""
    recorder = Recorder()
    url = await serve_app(recorder.app())
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
        "server: {max_connections: 4, header_timeout_s: 30}\n",
    )
    gw = await start_gateway(policy=policy)
    idle = []
    for _ in range(4):
        reader, writer = await open_raw(gw.url)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n")
        await reader.readuntil(b'"object": "list"')
        idle.append((reader, writer))
    reader, writer = await open_raw(gw.url)  # the fifth: the oldest idle one is closed
    await closed(idle[0][0])  # reaches its end: closed to make room
    assert not any(r.at_eof() for r, _ in idle[1:])
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n")
    [answer] = parse_responses(await closed(reader))
    assert answer.status == 200
    # Four connections busy reading a head: nothing is idle, so a fifth is refused.
    for _, w in idle:
        w.close()
    busy = []
    for _ in range(4):
        r, w = await open_raw(gw.url)
        w.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n")
        busy.append((r, w))
    await until(lambda: gw.gateway.metrics.connections.states().get("reading", 0) == 4)
    async with httpx.AsyncClient() as client:
        exposition = (await client.get(gw.admin_url + "/metrics")).text
    assert 'gateway_connections{state="reading"} 4.0' in exposition
    refused_r, refused_w = await open_raw(gw.url)
    assert await closed(refused_r) == b""
    refused_w.close()
    assert gw.gateway.metrics.refused_connections.labels("max_connections")._value.get() == 1
    for r, w in busy:
        w.write(b"Connection: close\r\n\r\n")
        [ok] = parse_responses(await closed(r))
        assert ok.status == 200
        w.close()


async def test_a_client_that_never_reads_is_cut_and_its_upstream_connection_released(
    serve_app, start_gateway, tmp_path
):
    """Clients that stop reading a long stream hold an upstream connection each; past
    ``client_send_timeout_s`` their answers are cut, so the next request is served."""
    chunk = b"data: " + b"x" * 65536 + b"\n\n"

    async def flood(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while True:
            await response.write(chunk)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    app = web.Application()
    app.router.add_get("/flood", flood)
    app.router.add_get("/v1/models", models)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}", max_connections: 2, timeout_s: 20}}}}\n'
        "routes: [{backend: main}]\nserver: {client_send_timeout_s: 0.5}\n",
    )
    gw = await start_gateway(policy=policy)
    stalled = []
    for _ in range(2):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = gw.url.removeprefix("http://").split(":")
        sock.connect((host, int(port)))
        sock.sendall(b"GET /flood HTTP/1.1\r\nHost: gw\r\n\r\n")
        stalled.append(sock)  # never read
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.get(gw.url + "/v1/models")
    assert r.status_code == 200
    assert timeouts(gw, "send") == 2
    for sock in stalled:
        sock.close()


async def test_stalled_large_bodies_are_held_to_the_shared_budget(limited):
    """Ten clients each start an 8 MB body and stall: the gateway holds at most the 1 MiB
    shared budget of them (plus a read buffer each); the rest are answered 503 or 408."""
    recorder, gw = limited
    piece = b"x" * 65536
    before = rss_bytes()

    async def stall() -> bytes:
        reader, writer = await open_raw(gw.url)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (8 * 1024 * 1024)
        )
        try:
            for _ in range(64):  # 4 MiB of the 8, then silence
                writer.write(piece)
                await writer.drain()
        except ConnectionError:
            pass
        data = await closed(reader)
        writer.close()
        return data

    answers = await asyncio.gather(*(stall() for _ in range(10)))
    grown = rss_bytes() - before
    statuses = sorted(parse_responses(data)[0].status for data in answers)
    assert set(statuses) <= {408, 413, 503} and 503 in statuses
    assert grown < 48 * 1024 * 1024, f"RSS grew by {grown / 2**20:.0f} MiB"
    assert gw.gateway._server.body_bytes == 0
    assert recorder.seen == []
