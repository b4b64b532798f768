"""The llhttp upstream client against raw-socket backends: one backend per framing that
parsers read differently, each a 502 ``bad_upstream_response`` on a connection that is
closed and never reused; interim answers, chunk extensions and trailers understood; bodies
delimited by the close complete only on a clean close; and a connection pooled only after a
clean exchange, so a misframed answer never reaches the next client."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import write_policy
from tests.upstreams import RawExchange

OK = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{"ok": 1}\r\n'

BAD_FRAMINGS = {
    "content-length twice, differing": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\nhello",
    "content-length twice, equal": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "content-length +5": b"HTTP/1.1 200 OK\r\nContent-Length: +5\r\n\r\nhello",
    "content-length 1_0": b"HTTP/1.1 200 OK\r\nContent-Length: 1_0\r\n\r\nhellohello",
    "content-length -1": b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\nhello",
    "content-length 5, 5": b"HTTP/1.1 200 OK\r\nContent-Length: 5, 5\r\n\r\nhello",
    "content-length ten": b"HTTP/1.1 200 OK\r\nContent-Length: ten\r\n\r\n0123456789",
    "content-length overflow": b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\nhello",
    "space before the colon": b"HTTP/1.1 200 OK\r\nContent-Length : 5\r\n\r\nhello",
    "folded header line": b"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 5\r\n\r\nhello",
    "header line starting with a space": b"HTTP/1.1 200 OK\r\n Content-Length: 5\r\n\r\nhello",
    "bare LF in a header": b"HTTP/1.1 200 OK\r\nX-A: a\nContent-Length: 5\r\n\r\nhello",
    "bare LF line ends": b"HTTP/1.1 200 OK\nContent-Length: 5\n\nhello",
    "NUL in a value": b"HTTP/1.1 200 OK\r\nX-A: a\x00b\r\nContent-Length: 5\r\n\r\nhello",
    "CR in a value": b"HTTP/1.1 200 OK\r\nX-A: a\rb\r\nContent-Length: 5\r\n\r\nhello",
    "header without a name": b"HTTP/1.1 200 OK\r\n: v\r\nContent-Length: 5\r\n\r\nhello",
    "transfer-encoding xchunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: xchunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "transfer-encoding gzip": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nhello",
    "transfer-encoding gzip, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "transfer-encoding chunked, chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "transfer-encoding twice": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "content-length with transfer-encoding": b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "chunk size 0x5": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n",
    "chunk size -2": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n-2\r\nhello\r\n0\r\n\r\n",
    "chunk size zz": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    "chunk size with a space": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5 \r\nhello\r\n0\r\n\r\n",
    "chunk size overflow": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\nhello\r\n0\r\n\r\n",
    "chunk without its CRLF": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    "status 2000": b"HTTP/1.1 2000 OK\r\nContent-Length: 5\r\n\r\nhello",
    "status 600": b"HTTP/1.1 600 Odd\r\nContent-Length: 5\r\n\r\nhello",
    "status 099": b"HTTP/1.1 099 Odd\r\nContent-Length: 5\r\n\r\nhello",
    "version HTTP/2.0": b"HTTP/2.0 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    "version HTTP/1.9": b"HTTP/1.9 200 OK\r\nContent-Length: 5\r\n\r\nhello",
    "not HTTP": b"NOT-HTTP 200 OK\r\n\r\n",
    "unasked upgrade": b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nxx",
    "head too large": b"HTTP/1.1 200 OK\r\nX-Big: "
    + b"a" * 70_000
    + b"\r\nContent-Length: 5\r\n\r\nhello",
    "too many header bytes": b"HTTP/1.1 200 OK\r\n"
    + b"X-A: b\r\n" * 9000
    + b"Content-Length: 5\r\n\r\nhello",
}


@pytest.mark.parametrize("answer", BAD_FRAMINGS.values(), ids=BAD_FRAMINGS.keys())
async def test_a_misframed_answer_is_a_502_and_its_connection_is_never_reused(
    raw_backend, start_gateway, answer
):
    """Each framing nginx and Envoy refuse: a 502 with code ``bad_upstream_response``, and
    the next request goes out on a new connection."""
    url, backend = await raw_backend(lambda ex: answer if ex.connection == 1 else OK)
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient(timeout=10) as client:
        first = await client.get(gw.url + "/x")
        second = await client.get(gw.url + "/x")
    assert first.status_code == 502
    error = first.json()["error"]
    assert (error["code"], error["type"]) == ("bad_upstream_response", "server_error")
    assert "invalid response" in error["message"]
    assert second.status_code == 200 and second.json() == {"ok": 1}
    assert [ex.connection for ex in backend.exchanges] == [1, 2]


async def test_bytes_after_a_complete_answer_retire_its_connection(raw_backend, start_gateway):
    url, backend = await raw_backend(
        lambda ex: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n"
    )
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        first = await client.get(gw.url + "/x")
        second = await client.get(gw.url + "/x")
    assert first.content == second.content == b"ok"
    assert [ex.connection for ex in backend.exchanges] == [1, 2]


async def test_bytes_after_a_head_answer_retire_its_connection(raw_backend, start_gateway):
    """A HEAD answer has no body, whatever its Content-Length says: a body sent anyway is
    bytes nobody asked for."""
    url, backend = await raw_backend(
        lambda ex: b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"
    )
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        head = await client.head(gw.url + "/x")
        get = await client.get(gw.url + "/x")
    assert (head.status_code, head.headers["content-length"], head.content) == (200, "5", b"")
    assert get.content == b"hello"
    assert [ex.connection for ex in backend.exchanges] == [1, 2]


async def test_a_connection_is_not_reused_after_a_5xx(raw_backend, start_gateway):
    """uvicorn under Starlette's error middleware (MLServer, FastAPI apps) closes the
    connection after a 500 without saying so: the next request must not go out on it."""
    url, backend = await raw_backend(
        lambda ex: (
            b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops"
            if ex.connection == 1
            else OK
        )
    )
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        failed = await client.post(gw.url + "/v1/orders", json={})
        ok = await client.post(gw.url + "/v1/orders", json={})
    assert (failed.status_code, ok.status_code) == (500, 200)
    assert [ex.connection for ex in backend.exchanges] == [1, 2]


async def test_interim_103_is_skipped_and_the_final_answer_relayed(raw_backend, start_gateway):
    url, _ = await raw_backend(
        lambda ex: (
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
    url, backend = await raw_backend(lambda ex: body)
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        first = await client.get(gw.url + "/x")
        second = await client.get(gw.url + "/x")
    assert first.content == second.content == b"hello world"
    assert [ex.connection for ex in backend.exchanges] == [1, 1]


async def test_a_body_ended_by_a_clean_close_is_complete(raw_backend, start_gateway):
    url, _ = await raw_backend(lambda ex: (b"HTTP/1.1 200 OK\r\n\r\nuntil the end", "close"))
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.url + "/x")
    assert (r.status_code, r.content) == (200, b"until the end")


async def test_a_body_ended_by_a_reset_is_a_502_and_never_cached(
    raw_backend, start_gateway, tmp_path
):
    """A close-delimited answer that a reset ends is not whole: a 502 while nothing was sent
    to the client, and the cache keeps nothing of it."""
    url, backend = await raw_backend(
        lambda ex: (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n"
            b'{"choices": [{"message": {"content": "cut',
            "reset",
        )
    )
    gw = await start_gateway(policy=caching_policy(tmp_path, url))
    async with httpx.AsyncClient() as client:
        for _ in range(2):
            r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert r.json()["error"]["code"] == "upstream_unavailable"
    assert len(backend.exchanges) == 2  # nothing was stored: the second asked again


async def test_a_stream_ended_by_a_reset_is_cut_and_never_cached(
    raw_backend, start_gateway, tmp_path
):
    """The same for an SSE stream, relayed as it arrives: the client sees it cut (no final
    chunk), and nothing is stored."""
    url, backend = await raw_backend(
        lambda ex: (
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n"
            b'data: {"choices": [{"delta": {"content": "cut"}}]}\n\n',
            "reset",
        )
    )
    gw = await start_gateway(policy=caching_policy(tmp_path, url))
    async with httpx.AsyncClient() as client:
        for _ in range(2):
            with pytest.raises(httpx.RemoteProtocolError):
                await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert len(backend.exchanges) == 2


def caching_policy(tmp_path, url: str):
    return write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{backend: main, cache: {{ttl_s: 60}}}}]
        """,
    )


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


async def test_one_tenants_misframed_answer_never_reaches_another(
    raw_backend, start_gateway, tmp_path
):
    """The attack that mixed tenants: a backend answers the first tenant with a
    Content-Length shorter than its body, the rest shaped like a second answer.  The second
    tenant gets its own answer, on a new connection, and the cache stores nothing wrong."""

    def respond(ex: RawExchange) -> bytes:
        if ex.header("authorization") == "Bearer tenant-a":
            smuggled = b'{"answer": "for b? no: a\'s"}'
            return (
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
                b'{"answer": "a"}'
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(smuggled)).encode()
                + b"\r\n\r\n"
                + smuggled
            )
        body = b'{"answer": "b"}'
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
            + body
        )

    url, backend = await raw_backend(respond)
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", max_connections: 1}}}}
        routes: [{{backend: main, cache: {{ttl_s: 60}}}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            a = await client.post(
                gw.url + "/v1/chat/completions",
                json=chat,
                headers={"Authorization": "Bearer tenant-a"},
            )
            b = await client.post(
                gw.url + "/v1/chat/completions",
                json=chat,
                headers={"Authorization": "Bearer tenant-b"},
            )
            assert a.json() == {"answer": "a"}
            assert b.json() == {"answer": "b"}
    # Each tenant asked once (the rest were cache hits), each on its own connection.
    assert [ex.header("authorization") for ex in backend.exchanges] == [
        "Bearer tenant-a",
        "Bearer tenant-b",
    ]
    assert [ex.connection for ex in backend.exchanges] == [1, 2]
