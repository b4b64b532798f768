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

from gateway.transport.connection import Connection
from gateway.transport.pool import SETTLE_S, heard
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


class KeepAliveServer:
    """Closes a connection idle past ``expires_s`` when the next request comes: a server
    whose keep-alive timer ran out as the request crossed the wire (the race a gateway
    meets when it reuses a connection the server is closing).  ``hint`` is the
    ``Keep-Alive: timeout`` it sends, if any."""

    def __init__(self, expires_s: float, hint: str = "") -> None:
        self.expires_s = expires_s
        self.answer = OK
        if hint:
            self.answer = OK.replace(b"\r\n\r\n", f"\r\nKeep-Alive: {hint}\r\n\r\n".encode())
        self.seen: list[tuple[int, str]] = []
        self.connections = 0

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number, answered = self.connections, None
        loop = asyncio.get_running_loop()
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            lines = head.lower().split(b"\r\n")
            length = [int(x.split(b":")[1]) for x in lines if x.startswith(b"content-length:")]
            await reader.readexactly(length[0] if length else 0)
            if answered is not None and loop.time() - answered > self.expires_s:
                break  # timed out: closed unanswered
            self.seen.append((number, head.split(b" ")[1].decode()))
            writer.write(self.answer)
            await writer.drain()
            answered = loop.time()
        writer.close()


async def serve_keep_alive(server: KeepAliveServer) -> tuple[asyncio.Server, str]:
    running = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    return running, f"http://127.0.0.1:{running.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("keepalive", ["keepalive_s: 0.3", ""])
async def test_a_connection_idle_past_keepalive_s_is_never_written_on(
    start_gateway, tmp_path, keepalive
):
    """A backend that closes idle connections after 1 s: with ``keepalive_s`` under it,
    a POST that may not be sent twice goes on a new connection after 1.2 s idle; with the
    default (4 s, for uvicorn's 5) the gateway writes it on the connection the backend is
    closing, and it is lost (a 502): the race the setting is there to avoid."""
    backend = KeepAliveServer(expires_s=1.0)
    server, url = await serve_keep_alive(backend)
    text = f"backends: {{main: {{url: '{url}', {keepalive}}}}}\nroutes: [{{backend: main}}]\n"
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    try:
        async with httpx.AsyncClient() as client:
            assert (await client.get(gw.url + "/v1/models")).status_code == 200
            await asyncio.sleep(0.05)
            assert (await client.post(gw.url + "/v1/orders", json={"n": 1})).status_code == 200
            await asyncio.sleep(1.2)
            late = await client.post(gw.url + "/v1/orders", json={"n": 2})
    finally:
        server.close()
        await server.wait_closed()
    connections = gw.gateway.metrics.upstream_connections
    counted = [connections.labels("main", e)._value.get() for e in ("opened", "retired")]
    if keepalive:
        assert late.status_code == 200
        assert backend.seen == [(1, "/v1/models"), (1, "/v1/orders"), (2, "/v1/orders")]
        assert counted == [2, 1]
    else:
        assert counted == [1, 0]
        assert late.status_code == 502
        assert backend.seen == [(1, "/v1/models"), (1, "/v1/orders")]


async def test_a_servers_keep_alive_hint_shortens_the_reuse(start_gateway, tmp_path):
    """A server saying ``Keep-Alive: timeout=2`` (and closing after 1.5 s idle, early, as
    its clock started before the gateway's): its connection is reused for 1 s at most.
    The margins are wide enough for a loaded machine."""
    backend = KeepAliveServer(expires_s=1.5, hint="timeout=2, max=100")
    server, url = await serve_keep_alive(backend)
    text = f"backends: {{main: {{url: '{url}'}}}}\nroutes: [{{backend: main}}]\n"
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    try:
        async with httpx.AsyncClient() as client:
            for pause in (0.05, 0.1, 1.6):
                await asyncio.sleep(pause)
                reply = await client.post(gw.url + "/v1/orders", json={"n": 1})
                assert reply.status_code == 200
    finally:
        server.close()
        await server.wait_closed()
    assert [number for number, _ in backend.seen] == [1, 1, 2]


@pytest.mark.parametrize(
    ("value", "keep_s"),
    [
        ("timeout=5, max=100", 4.0),  # llama.cpp's server
        ("max=3, Timeout = 2.5", 1.5),
        ("timeout=1", 0.5),  # half of a short hint, never nothing
        ("timeout=0", 0.0),  # reuse nothing idle
        ("timeout=abc", float("inf")),  # unreadable: the backend's keepalive_s holds
        ("notimeout=5", float("inf")),
        ("timeout=" + "9" * 400, float("inf")),  # absurd: read, and no shorter than ours
    ],
)
async def test_a_servers_keep_alive_hint_is_read_and_a_broken_one_ignored(value, keep_s):
    conn = Connection("main", asyncio.get_running_loop())
    heard(conn, [("Content-Type", "application/json"), ("Keep-Alive", value)])
    assert conn.keep_s == keep_s
