"""Bounded work per request, against what a cheap input could otherwise cost: a body in
2-byte chunks costs its size, a wide JSON body is refused before it is parsed, slow uploads
cannot lock the body buffer or the connection slots, a body trickling after a fast start
is cut by its pace and every body by its deadline, chunk extensions and trailers are
bounded and trailers never become headers, invalid ``Host`` values, methods outside the
list and non-UTF-8 JSON are refused.  On real sockets; the gateway's own memory is read
from a separate ``gateway serve`` process.  Waits are for the gateway to act, bounded
generously; nothing asserts on how fast."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any, cast

import httpx
import pytest

from gateway.metrics import Metrics
from gateway.policy.model import Server as Limits
from gateway.server.connection import ClientConnection
from gateway.server.listener import HttpServer
from gateway.testing import FakeSocket
from tests.helpers import CHAT, parse_responses, until, write_policy
from tests.test_client_limits import closed, open_raw
from tests.test_lifecycle import serve_process, wait_ready  # noqa: F401
from tests.upstreams import RawExchange, Recorder

MiB = 1024 * 1024
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


@pytest.fixture
async def gateway(serve_app, start_gateway, tmp_path):
    """``await gateway(server_yaml)``: a gateway with those ``server:`` settings in front of
    a recording backend."""

    async def start(server: str = "{}") -> tuple[Recorder, Any]:
        recorder = Recorder()
        url = await serve_app(recorder.app())
        policy = write_policy(
            tmp_path,
            f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
            f"server: {server}\n",
        )
        return recorder, await start_gateway(policy=policy)

    return start


async def exchange(url: str, raw: bytes) -> list[Any]:
    reader, writer = await open_raw(url)
    writer.write(raw)
    data = await closed(reader)
    writer.close()
    return parse_responses(data)


# -- memory ------------------------------------------------------------------------------------
def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field}")


async def test_bodies_in_two_byte_chunks_cost_their_size_not_an_object_each(
    serve_app,
    serve_process,  # noqa: F811
    tmp_path,
):
    """Four 3 MiB bodies sent at once in 2-byte chunks: the gateway's peak RSS grows by far
    less than 150 MiB (when each chunk was kept as its own object it grew by about 20 to 75
    times the bodies' size).  The gateway holds each body whole before it forwards it; the
    backend's own 413 (aiohttp takes 1 MiB) is relayed."""
    url = await serve_app(Recorder().app())
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
        "server: {max_body_bytes: 8388608}\n",
    )
    gw = await serve_process("--policy", str(policy))
    async with httpx.AsyncClient() as client:
        await wait_ready(client, gw.admin_url)
        await client.post(gw.url + "/v1/chat/completions", json=CHAT)  # warm
    before = memory_kib(gw.proc.pid, "VmRSS")
    text = json.dumps({**CHAT, "metadata": {"note": "x" * (3 * MiB)}}).encode()
    chunked = b"".join(
        b"%x\r\n%s\r\n" % (len(text[i : i + 2]), text[i : i + 2]) for i in range(0, len(text), 2)
    )
    raw = HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunked + b"0\r\n\r\n"
    answers = await asyncio.gather(*(exchange(gw.url, raw) for _ in range(4)))
    peak = memory_kib(gw.proc.pid, "VmHWM")
    assert [a[0].status for a in answers] == [413] * 4  # the backend's
    grown_mib = (peak - before) / 1024
    assert grown_mib < 150, f"peak RSS grew by {grown_mib:.0f} MiB"


# -- wide JSON ---------------------------------------------------------------------------------
async def test_a_wide_json_body_is_refused_before_it_is_parsed(gateway):
    """15 MiB of ``{}`` elements (5 million values) is a 400 naming the limit; a small
    request beside it is answered."""
    recorder, gw = await gateway()
    wide = (
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "x": ['
        + (b"{}," * (5 * MiB))
        + b"{}]}"
    )
    async with httpx.AsyncClient(timeout=60) as client:
        big = asyncio.ensure_future(
            client.post(gw.url + "/v1/chat/completions", content=wide, headers=JSON_TYPE)
        )
        small = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        refused = await big
    assert small.status_code == 200
    assert refused.status_code == 400
    assert "server.max_json_values" in refused.json()["error"]["message"]
    assert len(recorder.seen) == 1


JSON_TYPE = {"Content-Type": "application/json"}


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-le", "utf-32", "utf-8-sig"])
async def test_a_json_body_that_is_not_utf8_is_a_400(gateway, encoding):
    recorder, gw = await gateway()
    body = json.dumps(CHAT).encode(encoding)
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", content=body, headers=JSON_TYPE)
    assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
    assert recorder.seen == []


# -- slow bodies -----------------------------------------------------------------------------
SLOW = (
    "{max_buffered_body_bytes: 1048576, max_body_bytes: 307200, body_timeout_s: 20,"
    " min_body_rate_bytes_s: 1024}"
)


async def start_upload(url: str, size: int, sent: int) -> tuple[Any, Any]:
    """An upload of ``size`` bytes that sends ``sent`` of them at once and then stalls."""
    reader, writer = await open_raw(url)
    writer.write(HEAD + b"Content-Length: %d\r\n\r\n" % size + b"x" * sent)
    await writer.drain()
    return reader, writer


def stalled(gw: Any, count: int) -> bool:
    """Whether ``count`` connections hold a body a second or more behind its pace."""
    conns = gw.gateway._server._connections
    return sum(1 for c in conns if c.held_bytes() and c.body_stall_s() >= 1.0) >= count


async def test_stalled_uploads_cannot_lock_other_clients_bodies_out(gateway):
    """Four uploads that sent 256 KiB each and stalled fill the 1 MiB body buffer; a normal
    POST is answered 200 (it used to get 503 for as long as they trickled): the most stalled
    upload holding more than its share is cut with a 408 to make room."""
    recorder, gw = await gateway(SLOW)
    uploads = [await start_upload(gw.url, 300 * 1024, 256 * 1024) for _ in range(4)]
    await until(lambda: gw.gateway._server.body_bytes == 1024 * 1024)
    await until(lambda: stalled(gw, 4), timeout_s=10)
    async with httpx.AsyncClient() as client:
        normal = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert normal.status_code == 200
    cut = 0
    for reader, writer in uploads:
        try:
            data = await asyncio.wait_for(reader.read(), 0.5)
        except TimeoutError:
            data = b""
        if data:
            [answer] = parse_responses(data)
            assert answer.status == 408
            cut += 1
        writer.close()
    assert cut == 1
    assert len(recorder.seen) == 1


async def test_a_body_that_trickles_after_a_fast_start_is_cut_by_its_pace(gateway):
    """100 KiB at once, then a byte every 0.3 s (never silent for 1 s, the old limit): the
    body falls 1 s behind 1 KiB/s and is a 408."""
    recorder, gw = await gateway("{body_timeout_s: 1, min_body_rate_bytes_s: 1024}")
    reader, writer = await start_upload(gw.url, 200 * 1024, 100 * 1024)
    answer = asyncio.ensure_future(closed(reader, within_s=30))
    for _ in range(60):  # 18 s of trickle at most
        if answer.done():
            break
        writer.write(b"x")
        await asyncio.sleep(0.3)
    [refused] = parse_responses(await answer)
    writer.close()
    assert refused.status == 408 and "behind" in refused.json()["error"]["message"]
    assert recorder.seen == []


async def test_a_body_must_be_whole_within_its_deadline(gateway):
    """A body kept to its pace still ends at ``body_deadline_s``."""
    _, gw = await gateway("{body_deadline_s: 1, min_body_rate_bytes_s: 1024}")
    reader, writer = await start_upload(gw.url, 10 * MiB, 4096)
    answer = asyncio.ensure_future(closed(reader, within_s=30))
    for _ in range(100):
        if answer.done():
            break
        writer.write(b"x" * 4096)  # 20 KiB/s: well above the pace
        await asyncio.sleep(0.2)
    [refused] = parse_responses(await answer)
    writer.close()
    assert refused.status == 408 and "longer than 1 s" in refused.json()["error"]["message"]


async def test_slow_clients_cannot_hold_every_connection_slot(gateway):
    """Eight connections trickling heads fill ``max_connections: 8``; a new client is
    served (the most stalled is cut with a 408) instead of being refused."""
    _, gw = await gateway("{max_connections: 8, header_timeout_s: 30}")
    slow = []
    for _ in range(8):
        reader, writer = await open_raw(gw.url)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Slow: a")
        slow.append((reader, writer))
    await until(lambda: len(gw.gateway._server._connections) == 8)
    await until(
        lambda: all(c.head_stall_s() >= 1.0 for c in gw.gateway._server._connections),
        timeout_s=10,
    )
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.url + "/v1/models")
    assert r.status_code == 200
    statuses = []
    for reader, writer in slow:
        try:
            data = await asyncio.wait_for(reader.read(), 0.2)
        except TimeoutError:
            data = b""
        if data:
            statuses.append(parse_responses(data)[0].status)
        writer.close()
    assert statuses == [408]


# -- chunk framing and trailers ----------------------------------------------------------------
def chunked_request(body: bytes, *, extension: bytes = b"", trailers: bytes = b"") -> bytes:
    return (
        HEAD
        + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        + b"%x%s\r\n%s\r\n0\r\n%s\r\n" % (len(body), extension, body, trailers)
    )


async def test_a_chunk_extension_without_bound_is_a_400(gateway):
    recorder, gw = await gateway()
    body = json.dumps(CHAT).encode()
    [answer] = await exchange(gw.url, chunked_request(body, extension=b";x=" + b"e" * MiB))
    assert answer.status == 400 and "chunk framing" in answer.json()["error"]["message"]
    [fine] = await exchange(gw.url, chunked_request(body, extension=b";name=value"))
    assert fine.status == 200 and len(recorder.seen) == 1


async def test_request_trailers_never_become_headers(gateway):
    """A harmless trailer is dropped; one that may not be a trailer (a second
    ``Authorization``, ``Host``, ``Content-Length``) is a 400 and nothing goes upstream."""
    recorder, gw = await gateway()
    body = json.dumps(CHAT).encode()
    [ok] = await exchange(gw.url, chunked_request(body, trailers=b"X-Checksum: abc\r\n"))
    assert ok.status == 200
    assert "X-Checksum" not in recorder.seen[0].headers
    for field in (b"Authorization: Bearer other", b"Host: evil", b"Cookie: a=b"):
        [refused] = await exchange(gw.url, chunked_request(body, trailers=field + b"\r\n"))
        assert refused.status == 400 and "trailer" in refused.json()["error"]["message"]
    [framing] = await exchange(gw.url, chunked_request(body, trailers=b"Content-Length: 5\r\n"))
    assert framing.status == 400  # llhttp's own refusal
    [big] = await exchange(
        gw.url, chunked_request(body, trailers=b"X-Big: " + b"a" * 70000 + b"\r\n")
    )
    assert big.status == 431
    assert len(recorder.seen) == 1


async def test_response_trailers_are_dropped_and_bounded(raw_backend, start_gateway):
    """A backend's trailer never reaches the client as a header (``Set-Cookie``), and
    200 MiB of them end the answer as a 502 instead of growing the gateway's memory."""
    trailer_size = {"bytes": 0}

    def answer(exchange: RawExchange) -> bytes:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        body = b'{"ok": true}'
        trailers = b"Set-Cookie: session=evil\r\n"
        if trailer_size["bytes"]:
            trailers = b"X-Pad: " + b"p" * trailer_size["bytes"] + b"\r\n"
        return head + b"%x\r\n%s\r\n0\r\n%s\r\n" % (len(body), body, trailers)

    url, _ = await raw_backend(answer)
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        ok = await client.get(gw.url + "/data")
        assert ok.status_code == 200 and ok.json() == {"ok": True}
        assert "set-cookie" not in ok.headers
        trailer_size["bytes"] = 200 * MiB
        big = await client.get(gw.url + "/data")
    assert big.status_code == 502


# -- heads -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("host", "status"),
    [
        (b"user@evil:1", 400),
        (b"evil/path", 400),
        (b"a b", 400),
        (b"example.com:80:90", 400),
        (b"[::1", 400),
        (b"example.com:8080", 200),
        (b"[::1]:80", 200),
        (b"127.0.0.1", 200),
        (b"xn--bcher-kva.example", 200),
    ],
)
async def test_the_host_header_must_be_a_host_and_port(gateway, host, status):
    recorder, gw = await gateway()
    raw = b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\nConnection: close\r\n\r\n"
    [answer] = await exchange(gw.url, raw)
    assert answer.status == status
    if status == 400:
        assert recorder.seen == []
    else:
        assert recorder.seen[0].headers["X-Forwarded-Host"] == host.decode()


async def test_methods_outside_the_allowed_list_are_405(gateway):
    recorder, gw = await gateway("{allowed_methods: [GET, POST]}")
    for method in (b"PROPFIND", b"DELETE", b"OPTIONS"):
        raw = method + b" /v1/models HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n\r\n"
        [answer] = await exchange(gw.url, raw)
        assert answer.status == 405, method
        assert answer.headers["allow"] == "GET, POST"
    assert recorder.seen == []


def test_the_defaults_are_what_the_docs_promise():
    from gateway.policy.model import Server

    server = Server()
    assert server.min_body_rate_bytes_s == 1024 and server.body_deadline_s == 300
    assert server.max_json_values == 500_000
    assert "PROPFIND" not in server.allowed_methods and "OPTIONS" in server.allowed_methods


# -- the loop's turn ---------------------------------------------------------------------------
async def test_a_read_of_many_tiny_chunks_gives_the_loop_a_turn():
    """A read that brought thousands of 2-byte chunks (a callback each) pauses the
    connection's reading until the loop has run once: libuv would otherwise read the same
    socket up to 32 times in one go, holding every other connection and timer.  A pause of
    its own (here: the answer's back-pressure) is not lifted by that turn's end.  The
    server's real connection over a ``FakeSocket``."""
    answered: list[bytes] = []

    async def handler(request: Any) -> None:
        answered.append(request.body)
        request.respond(200, [("Content-Type", "application/json")], b"{}")

    server = HttpServer(handler, Limits, Metrics())
    conn = ClientConnection(server)
    sock = FakeSocket()
    conn.connection_made(cast(asyncio.Transport, sock))
    text = json.dumps({**CHAT, "note": "x" * 9000}).encode()
    chunks = [
        b"%x\r\n%s\r\n" % (len(text[i : i + 2]), text[i : i + 2]) for i in range(0, len(text), 2)
    ]
    third = len(chunks) // 3  # 1,500 chunks
    conn.data_received(HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(chunks[:third]))
    assert not sock.reading
    await asyncio.sleep(0)
    assert sock.reading  # one turn of the loop, and it reads again

    conn.data_received(b"".join(chunks[third : third + 10]))  # few pieces: no turn given
    assert sock.reading
    conn.data_received(b"".join(chunks[third + 10 : 2 * third]))
    assert not sock.reading
    conn._pause_reading()  # back-pressure of its own during the turn
    await asyncio.sleep(0)
    assert not sock.reading  # the turn's end leaves that pause in place
    conn._resume_reading()
    assert sock.reading
    conn.data_received(b"".join(chunks[2 * third :]) + b"0\r\n\r\n")
    await until(lambda: answered != [])
    assert answered == [text]
    conn.close(abort=True)
