"""The access log (one JSON line per request on stderr when enabled, never credentials or
bodies) and the per-backend pool size taken from the policy."""

from __future__ import annotations

import asyncio
import functools
import json
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from gateway.resilience.stage import GUARDS
from tests.helpers import CHAT, until, write_policy
from tests.upstreams import Recorder


async def logged_gateway(
    serve_app: Any, start_gateway: Any, tmp_path: Path, route: str, options: str = ""
) -> tuple[Any, Recorder]:
    """A gateway with the access log on, its one route ``route`` (with ``options``) in front
    of a ``Recorder``."""
    rec = Recorder()
    url = await serve_app(rec.app())
    extra = f", {options}" if options else ""
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{name: {route}, match: {{path: "*"}}, backend: main{extra}}}]
        server: {{access_log: true}}
        """,
    )
    return await start_gateway(policy=policy), rec


async def test_access_log_writes_one_json_line_per_request_without_secrets(
    serve_app, start_gateway, tmp_path, capsys
):
    gw, _ = await logged_gateway(serve_app, start_gateway, tmp_path, "chat")
    async with httpx.AsyncClient() as client:
        await client.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={"Authorization": "Bearer sk-very-secret", "X-Request-ID": "log-1"},
        )
        await client.post(gw.url + "/v1/chat/completions", content=b"{")
    lines = [
        json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")
    ]
    assert len(lines) == 2
    first, second = lines
    assert first["id"] == "log-1" and first["route"] == "chat" and first["backend"] == "main"
    assert first["status"] == 200 and first["duration_ms"] > 0
    assert (first["prompt_tokens"], first["completion_tokens"]) == (3, 3)
    assert second["status"] == 400
    text = json.dumps(lines)
    assert "sk-very-secret" not in text and "hello there" not in text


async def test_a_stream_its_client_dropped_is_logged_and_counted_as_499_with_the_bytes_sent(
    serve_app, start_gateway, tmp_path, capsys
):
    gw, rec = await logged_gateway(serve_app, start_gateway, tmp_path, "gated")
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", gw.url + "/gated", json={}) as r:
            assert await r.aiter_raw().__anext__() == b'data: {"part": 1}\n\n'
    await rec.cancelled.wait()  # the client left: the upstream call was cancelled
    await asyncio.sleep(0)
    for _ in range(100):
        lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
        if lines:
            break
        await asyncio.sleep(0.01)
    [entry] = lines
    assert (entry["status"], entry["bytes_sent"]) == (499, len(b'data: {"part": 1}\n\n'))
    assert gw.gateway.metrics.requests.labels("gated", "main", "499")._value.get() == 1


async def test_access_log_is_off_by_default(serve_app, start_gateway, capsys):
    rec = Recorder()
    gw = await start_gateway(upstream=await serve_app(rec.app()))
    async with httpx.AsyncClient() as client:
        await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert not [line for line in capsys.readouterr().err.splitlines() if line.startswith("{")]


async def test_pool_opens_at_most_max_connections_to_a_backend(serve_app, start_gateway, tmp_path):
    concurrent = 0
    peak = 0
    gate = asyncio.Event()

    async def slow(request: web.Request) -> web.Response:
        nonlocal concurrent, peak
        concurrent += 1
        peak = max(peak, concurrent)
        await gate.wait()
        concurrent -= 1
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_get("/slow", slow)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", max_connections: 3}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=20)) as client:
        tasks = [asyncio.create_task(client.get(gw.url + "/slow")) for _ in range(10)]
        pool = gw.gateway.transport.pool(gw.gateway.snapshot.policy.backend("main"))
        await until(lambda: concurrent == 3 and pool.waiting == 7)  # the rest wait their turn
        assert peak == 3
        gate.set()
        results = await asyncio.gather(*tasks)
    assert [r.status_code for r in results] == [200] * 10


async def test_waiting_for_a_pooled_connection_is_bounded_by_the_timeout(
    serve_app, start_gateway, tmp_path
):
    gate = asyncio.Event()

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: {}\n\n")
        await gate.wait()
        return response

    async def quick(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    app.router.add_get("/quick", quick)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", max_connections: 1, timeout_s: 0.3}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        async with client.stream(
            "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as held:
            chunks = held.aiter_raw()
            await chunks.__anext__()  # the stream holds the only connection
            waiting = await client.get(gw.url + "/quick")
            gate.set()
        after = await client.get(gw.url + "/quick")
    assert waiting.status_code == 504
    assert "no free connection" in waiting.json()["error"]["message"]
    assert after.status_code == 200


async def test_the_access_log_tells_the_cache_result_of_each_request(
    serve_app, start_gateway, tmp_path, capsys
):
    gw, _ = await logged_gateway(serve_app, start_gateway, tmp_path, "chat", "cache: {ttl_s: 60}")
    asked = {**CHAT, "temperature": 0}
    async with httpx.AsyncClient() as client:
        for headers in ({}, {}, {"Cache-Control": "no-cache"}):
            await client.post(gw.url + "/v1/chat/completions", json=asked, headers=headers)
        await client.get(gw.url + "/v1/models")
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert [line.get("log_cache") for line in lines] == ["miss", "hit:exact", "bypass", "bypass"]


async def test_the_access_log_tells_each_calls_priority_and_queue_wait(
    serve_app, start_gateway, tmp_path, capsys
):
    """A call that waited for the backend's one slot is logged with its wait; each with the
    priority it got (``X-Priority``, else the route's)."""
    gate, arrived = asyncio.Event(), asyncio.Event()

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        arrived.set()
        await gate.wait()
        return web.json_response({"id": "c", "object": "chat.completion", "choices": []})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", max_concurrency: 1}}}}
        routes: [{{name: chat, match: {{path: "*"}}, backend: main}}]
        server: {{access_log: true}}
        """,
    )
    gw = await start_gateway(policy=policy)
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient() as client:
        ask = functools.partial(client.post, gw.url + "/v1/chat/completions", json=CHAT)
        first = asyncio.ensure_future(ask())
        await arrived.wait()  # the first holds the slot
        second = asyncio.ensure_future(ask(headers={"X-Priority": "high"}))
        await until(lambda: admission.depth == 1)
        await asyncio.sleep(0.05)  # the second has waited at least this long
        gate.set()
        assert [(await r).status_code for r in (first, second)] == [200, 200]
    written = ""
    for _ in range(100):  # each line is written once its answer is out
        written += capsys.readouterr().err
        if written.count('"priority"') == 2:
            break
        await asyncio.sleep(0.01)
    lines = [json.loads(x) for x in written.splitlines() if x.startswith("{")]
    assert [line["priority"] for line in lines] == ["normal", "high"]
    assert lines[1]["queue_wait_ms"] >= 50 > lines[0]["queue_wait_ms"] >= 0


async def test_the_access_log_tells_why_a_fallback_served(
    serve_app, start_gateway, tmp_path, capsys
):
    async def fail(_: web.Request) -> web.Response:
        return web.json_response({"error": "x"}, status=500)

    failing = web.Application()
    failing.router.add_post("/{tail:.*}", fail)
    rec = Recorder()
    primary, spare = await serve_app(failing), await serve_app(rec.app())
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{primary}"}}, spare: {{url: "{spare}"}}}}
        routes: [{{name: chat, match: {{path: "*"}}, backend: main, fallback: [spare]}}]
        server: {{access_log: true}}
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    assert lines[-1]["fallback"] == "upstream_5xx"
    assert lines[-1]["backend"] == "spare" and lines[-1]["endpoint"] == spare


async def test_the_access_log_tells_what_the_generation_bounds_did(
    serve_app, start_gateway, tmp_path, capsys
):
    gw, _ = await logged_gateway(
        serve_app, start_gateway, tmp_path, "chat", "generation: {max_tokens: 64, max_choices: 1}"
    )
    async with httpx.AsyncClient() as client:
        for extra in ({"max_tokens": 500}, {}, {"n": 2}, {"max_tokens": 10}):
            await client.post(gw.url + "/v1/chat/completions", json={**CHAT, **extra})
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    told = [(line.get("generation"), line.get("max_tokens_sent")) for line in lines]
    assert told == [("clamped", 64), ("defaulted", 64), ("refused", 0), (None, None)]
    assert [line["status"] for line in lines] == [200, 200, 400, 200]


async def test_the_access_log_never_shows_the_credentials_of_an_endpoints_url(
    serve_app, start_gateway, tmp_path, capsys
):
    url = (await serve_app(Recorder().app())).replace("http://", "http://svc-user:hunter2@")
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{name: chat, match: {{path: "*"}}, backend: main}}]
        server: {{access_log: true}}
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        assert (await client.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
    err = capsys.readouterr().err
    line = json.loads(next(x for x in err.splitlines() if x.startswith("{")))
    assert line["endpoint"].startswith("http://***@127.0.0.1:")
    assert "hunter2" not in err and "svc-user" not in err
