"""SSE streams: relayed event by event, cancelled upstream when the client leaves, cut
cleanly (never passed off as whole) when the backend breaks off, and counted."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp import web

from tests.helpers import CHAT, write_policy
from tests.upstreams import Recorder


@pytest.fixture
async def upstream(serve_app):
    recorder = Recorder()
    return recorder, await serve_app(recorder.app())


async def test_first_event_arrives_before_upstream_finishes(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", gw.url + "/gated", json={"x": 1}) as r:
            chunks = r.aiter_raw()
            first = await asyncio.wait_for(chunks.__anext__(), 5)
            assert first == b'data: {"part": 1}\n\n'
            assert not recorder.release.is_set()  # the upstream is still holding the rest
            recorder.release.set()
            rest = b"".join([c async for c in chunks])
    assert rest == b'data: {"part": 2}\n\ndata: [DONE]\n\n'
    assert r.headers["Content-Type"] == "text/event-stream"


async def test_client_disconnect_cancels_upstream_stream(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", gw.url + "/gated", json={"x": 1}) as r:
            await asyncio.wait_for(r.aiter_raw().__anext__(), 5)
        # leaving the block closes the client's connection mid-stream
    await asyncio.wait_for(recorder.cancelled.wait(), 5)
    assert gw.gateway.transport.pool(gw.gateway.snapshot.policy.backends[0]).inflight == 0


async def test_client_disconnect_while_waiting_cancels_upstream(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        task = asyncio.create_task(client.get(gw.url + "/slow"))
        await asyncio.wait_for(recorder.arrived.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    await asyncio.wait_for(recorder.cancelled.wait(), 5)


async def test_openai_stream_matches_direct_and_counts_usage_tokens(upstream, start_gateway):
    _, url = upstream
    gw = await start_gateway(upstream=url)
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient() as client:
        direct = await client.post(url + "/v1/chat/completions", json=body)
        proxied = await client.post(gw.url + "/v1/chat/completions", json=body)
    assert proxied.content == direct.content
    metrics = gw.gateway.metrics.exposition().decode()
    assert 'gateway_tokens_total{backend="upstream",kind="prompt"} 3.0' in metrics
    assert 'gateway_tokens_total{backend="upstream",kind="completion"} 3.0' in metrics
    assert "gateway_stream_first_byte_seconds_count" in metrics


async def test_backend_breaking_off_mid_stream_cuts_the_client_stream(serve_app, start_gateway):
    async def broken(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b'data: {"part": 1}\n\n')
        assert request.transport is not None
        request.transport.close()  # dies without the terminating chunk
        return response

    app = web.Application()
    app.router.add_post("/broken", broken)
    url = await serve_app(app)
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", gw.url + "/broken", json={}) as r:
                async for _ in r.aiter_raw():
                    pass


async def test_idle_gap_between_chunks_past_limit_cuts_the_stream(
    upstream, start_gateway, tmp_path
):
    recorder, url = upstream
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", idle_timeout_s: 0.2}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        with pytest.raises(httpx.RemoteProtocolError):
            async with client.stream("POST", gw.url + "/gated", json={}) as r:
                async for _ in r.aiter_raw():
                    pass
    await asyncio.wait_for(recorder.cancelled.wait(), 5)


async def test_slow_client_gets_back_pressure_not_unbounded_buffers(serve_app, start_gateway):
    """A client that stops reading stalls the upstream's writes instead of the gateway
    buffering the whole stream."""
    sent = 0
    blocked = asyncio.Event()
    chunk = b"x" * 65536

    async def firehose(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(2000):  # 128 MiB if nothing pushed back
            try:
                await asyncio.wait_for(response.write(chunk), 0.5)
            except TimeoutError:
                blocked.set()
                return response
            sent += len(chunk)
        return response

    app = web.Application()
    app.router.add_get("/firehose", firehose)
    url = await serve_app(app)
    gw = await start_gateway(upstream=url)
    host, port = gw.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port), limit=1024)
    writer.write(b"GET /firehose HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(blocked.wait(), 30)
    writer.close()
    assert sent < 32 * 1024 * 1024


async def test_a_client_slower_than_the_idle_timeout_is_not_the_backends_silence(
    serve_app, start_gateway, tmp_path
):
    """Back-pressure pauses reading from the backend; that pause must not count as the
    backend going quiet."""
    chunk = b"y" * 65536
    total = 512  # 32 MiB: far past the socket buffers in between

    async def firehose(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        for _ in range(total):
            await response.write(chunk)
        return response

    app = web.Application()
    app.router.add_get("/firehose", firehose)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", idle_timeout_s: 0.3}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    received = 0
    async with httpx.AsyncClient() as client:
        async with client.stream("GET", gw.url + "/firehose") as r:
            pauses = 3
            async for piece in r.aiter_raw():
                received += len(piece)
                if pauses:  # a slow reader: each pause is longer than the idle limit
                    pauses -= 1
                    await asyncio.sleep(0.5)
    assert received == total * len(chunk)
