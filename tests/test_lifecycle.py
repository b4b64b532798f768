"""The gateway as a process: `gateway serve` from the command line, SIGHUP reload, and
graceful shutdown on SIGTERM with a stream in flight."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import CHAT, until
from tests.upstreams import Recorder


@dataclass
class Process:
    proc: asyncio.subprocess.Process
    url: str
    admin_url: str


@pytest.fixture
async def serve_process() -> AsyncIterator:
    procs: list[asyncio.subprocess.Process] = []

    async def start(*args: str) -> Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--port",
            "0",
            "--admin-port",
            "0",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        found = re.search(r"listening on (\S+) \(admin (\S+)\)", line)
        assert found, line
        return Process(proc, found.group(1), found.group(2))

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def wait_ready(client: httpx.AsyncClient, admin_url: str) -> None:
    for _ in range(500):
        if (await client.get(admin_url + "/readyz")).status_code == 200:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("never ready")


async def test_zero_config_upstream_mode_from_the_command_line(serve_app, serve_process):
    rec = Recorder()
    url = await serve_app(rec.app())
    gw = await serve_process("--upstream", url)
    async with httpx.AsyncClient() as client:
        await wait_ready(client, gw.admin_url)
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        bad = await client.post(gw.url + "/v1/chat/completions", content=b"{")
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert bad.status_code == 400 and len(rec.seen) == 1


async def test_sigterm_drains_a_stream_in_flight_then_exits(serve_app, serve_process):
    rec = Recorder()
    url = await serve_app(rec.app())
    gw = await serve_process("--upstream", url)
    async with httpx.AsyncClient() as client:
        await wait_ready(client, gw.admin_url)
        async with client.stream("POST", gw.url + "/gated", json={}) as r:
            chunks = r.aiter_raw()
            assert await chunks.__anext__() == b'data: {"part": 1}\n\n'
            gw.proc.send_signal(signal.SIGTERM)
            for _ in range(200):  # unready at once
                ready = await client.get(gw.admin_url + "/readyz")
                if ready.status_code == 503:
                    break
                await asyncio.sleep(0.01)
            assert ready.json() == {"ready": False, "reason": "shutting down"}
            with pytest.raises(httpx.ConnectError):  # no new connections
                async with httpx.AsyncClient() as fresh:
                    await fresh.get(gw.url + "/v1/models")
            rec.release.set()
            rest = b"".join([c async for c in chunks])
    assert rest == b'data: {"part": 2}\n\ndata: [DONE]\n\n'
    assert await asyncio.wait_for(gw.proc.wait(), 10) == 0


async def raw_connection(gw: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection to the gateway process ``gw``, once it is ready."""
    async with httpx.AsyncClient() as client:
        await wait_ready(client, gw.admin_url)
    host, port = gw.url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def gated_stream(gw: Any) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw connection whose streamed answer to ``/gated`` (held by the ``Recorder`` until
    released) has sent its head, keep-alive and chunked."""
    reader, writer = await raw_connection(gw)
    writer.write(b"POST /gated HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    assert b"Connection: close" not in head and b"chunked" in head
    return reader, writer


async def test_the_drain_dispatches_nothing_pipelined_behind_a_closing_answer(
    serve_app, serve_process
):
    """Two requests pipelined on one connection and a SIGTERM while the first is upstream:
    the first is answered with ``Connection: close``, and the second, behind it, is never
    sent upstream nor answered (RFC 9112 9.6: its client may safely send it again)."""
    rec = Recorder()
    url = await serve_app(rec.app())
    gw = await serve_process("--upstream", url)
    reader, writer = await raw_connection(gw)
    writer.write(
        b"GET /slow HTTP/1.1\r\nHost: gw\r\n\r\n"
        b"POST /second HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}"
    )
    await until(lambda: len(rec.seen) == 1)  # the first is upstream, the second waits
    gw.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)  # the drain has begun: every answer from now closes
    rec.release.set()
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert data.count(b"HTTP/1.1 ") == 1 and b"\r\nConnection: close\r\n" in data
    assert [seen.path_qs for seen in rec.seen] == ["/slow"]
    assert await asyncio.wait_for(gw.proc.wait(), 10) == 0


async def test_the_drain_serves_the_next_request_after_a_stream_it_could_not_mark_closing(
    serve_app, serve_process
):
    """A stream whose head went out before SIGTERM ends during the drain: its client was
    never told the connection closes, so it sends its next request at once.  That request
    is served like any on an open connection, its answer with ``Connection: close``, where
    closing the connection as the stream ended met it with a reset or nothing."""
    rec = Recorder()
    url = await serve_app(rec.app())
    gw = await serve_process("--upstream", url)
    reader, writer = await gated_stream(gw)
    gw.proc.send_signal(signal.SIGTERM)
    await asyncio.sleep(0.2)  # the drain has begun
    rec.release.set()
    stream = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)
    assert b"[DONE]" in stream
    writer.write(b"POST /next HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert b"\r\nConnection: close\r\n" in answer
    assert [seen.path_qs for seen in rec.seen] == ["/gated", "/next"]
    assert await asyncio.wait_for(gw.proc.wait(), 10) == 0


async def test_the_request_sent_as_the_drain_cuts_a_stream_short_gets_a_503_not_a_reset(
    serve_app, serve_process, tmp_path: Path
):
    """The grace runs out on a stream whose head (sent before SIGTERM) said keep-alive: the
    drain ends it with an error event, and its client, which reads that event and sends its
    next request on the same connection at once, gets a 503 with ``Connection: close``,
    never sent upstream (before, the connection closed as the event went out, and that
    request met a reset or nothing)."""
    rec = Recorder()
    url = await serve_app(rec.app())
    grace_s = 0.5
    path = tmp_path / "policy.yaml"
    path.write_text(
        f'backends:\n  main: {{url: "{url}"}}\nroutes:\n  - {{backend: main}}\n'
        f"server: {{shutdown_grace_s: {grace_s}}}\n"
    )
    gw = await serve_process("--policy", str(path))
    reader, writer = await gated_stream(gw)
    gw.proc.send_signal(signal.SIGTERM)
    stream = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 10)
    assert b"shut down before this answer was complete" in stream
    writer.write(b"POST /next HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}")
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert answer.startswith(b"HTTP/1.1 503 "), answer
    assert b"\r\nConnection: close\r\n" in answer and b"shutting down" in answer
    assert [seen.path_qs for seen in rec.seen] == ["/gated"]
    assert await asyncio.wait_for(gw.proc.wait(), 10) == 0


async def test_sighup_reloads_the_policy(serve_app, serve_process, tmp_path: Path):
    a, b = Recorder(), Recorder()
    url_a, url_b = await serve_app(a.app()), await serve_app(b.app())
    path = tmp_path / "policy.yaml"
    body = 'backends: {main: {url: "%s"}}\nroutes: [{backend: main}]\nserver: {reload_interval_s: 3600}\n'
    path.write_text(body % url_a)
    gw = await serve_process("--policy", str(path))
    async with httpx.AsyncClient() as client:
        await wait_ready(client, gw.admin_url)
        path.write_text(body % url_b)
        gw.proc.send_signal(signal.SIGHUP)
        for _ in range(500):
            if (await client.get(gw.admin_url + "/policy")).json()["generation"] == 2:
                break
            await asyncio.sleep(0.01)
        await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert len(b.seen) == 1 and not a.seen


async def test_sigterm_refuses_the_queued_ends_the_rest_with_answers_and_exits_in_time(
    serve_app, serve_process, tmp_path: Path
):
    """A real SIGTERM to a real process, with 4 streams and a slow call in flight and 5
    calls queued behind it: the queued get 503 with Retry-After at once and never reach the
    backend; when ``shutdown_grace_s`` runs out the streams end with an OpenAI error event
    and the slow call gets a 503 (no bare close for anything whose head was read); the
    process exits within the grace plus a second."""
    rec = Recorder()
    url = await serve_app(rec.app())
    grace_s = 1.5
    path = tmp_path / "policy.yaml"
    path.write_text(
        f'backends:\n  streams: {{url: "{url}"}}\n'
        f'  slow: {{url: "{url}", max_concurrency: 1, queue: {{capacity: 20, timeout_ms: 60000}}}}\n'
        'routes:\n  - {match: {path: "/gated"}, backend: streams}\n'
        '  - {match: {path: "/slow"}, backend: slow}\n'
        f"server: {{shutdown_grace_s: {grace_s}}}\n"
    )
    gw = await serve_process("--policy", str(path))
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=30) as client:
        await wait_ready(client, gw.admin_url)
        streams = []
        for _ in range(4):
            request = client.build_request("POST", gw.url + "/gated", json={})
            response = await client.send(request, stream=True)
            chunks = response.aiter_raw()
            assert await chunks.__anext__() == b'data: {"part": 1}\n\n'
            streams.append((response, chunks))
        in_flight = asyncio.create_task(client.get(gw.url + "/slow"))
        await until(lambda: sum(s.path_qs == "/slow" for s in rec.seen) == 1)
        queued = [asyncio.create_task(client.get(gw.url + "/slow")) for _ in range(5)]
        for _ in range(500):
            text = (await client.get(gw.admin_url + "/metrics")).text
            if 'gateway_queue_depth{backend="slow"} 5.0' in text:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the calls never queued")
        sent = loop.time()
        gw.proc.send_signal(signal.SIGTERM)
        refused = await asyncio.gather(*queued)
        refused_at = loop.time() - sent
        for r in refused:
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert "shutting down" in r.json()["error"]["message"]
        ends = []
        for response, chunks in streams:
            ends.append(b"".join([c async for c in chunks]))  # a clean end, no cut
            await response.aclose()
        slow = await in_flight
        exit_code = await asyncio.wait_for(gw.proc.wait(), 10)
        took = loop.time() - sent
    assert refused_at < grace_s, "the queued waited for the grace to run out"
    for rest in ends:
        event = json.loads(rest.removeprefix(b"data: ").strip())
        assert event["error"]["code"] == "overloaded"
        assert "shut down before this answer was complete" in event["error"]["message"]
    assert slow.status_code == 503 and slow.json()["error"]["code"] == "overloaded"
    assert sum(s.path_qs == "/slow" for s in rec.seen) == 1  # the queued never went upstream
    assert exit_code == 0
    assert took <= grace_s + 1.0, f"exited {took:.2f} s after SIGTERM"
