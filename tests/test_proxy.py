"""The proxy's HTTP behaviour: parity with the backend reached directly, headers, routing,
body handling and every error shape the gateway itself produces."""

from __future__ import annotations

import asyncio
import gzip
import json

import httpx
import pytest

from tests.helpers import CHAT, write_policy
from tests.upstreams import Recorder


@pytest.fixture
async def upstream(serve_app):
    recorder = Recorder()
    url = await serve_app(recorder.app())
    return recorder, url


async def test_chat_through_gateway_equals_direct(upstream, start_gateway):
    _, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        direct = await client.post(url + "/v1/chat/completions", json=CHAT)
        proxied = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert proxied.status_code == direct.status_code == 200
    assert proxied.json() == direct.json()
    assert proxied.headers["X-Gateway-Backend"] == "upstream"
    assert len(proxied.headers["X-Request-ID"]) >= 16


async def test_client_request_id_is_kept_forwarded_and_returned(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        r = await client.post(
            gw.url + "/v1/chat/completions", json=CHAT, headers={"X-Request-ID": "req-42"}
        )
    assert r.headers["X-Request-ID"] == "req-42"
    assert recorder.seen[-1].headers["X-Request-ID"] == "req-42"


async def test_hop_by_hop_headers_stripped_and_forwarding_headers_set(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        await client.post(
            gw.url + "/v1/chat/completions",
            json=CHAT,
            headers={
                "Connection": "keep-alive, X-Drop-Me",
                "X-Drop-Me": "1",
                "Keep-Alive": "timeout=5",
                "TE": "trailers",
                "Proxy-Authorization": "Basic abc",
                "Authorization": "Bearer k",
                "X-Forwarded-For": "10.0.0.9",
                "X-Custom": "kept",
            },
        )
    seen = {k.lower(): v for k, v in recorder.seen[-1].headers.items()}
    for dropped in ("x-drop-me", "keep-alive", "te", "proxy-authorization"):
        assert dropped not in seen
    assert seen["authorization"] == "Bearer k"
    assert seen["x-custom"] == "kept"
    assert seen["x-forwarded-for"] == "127.0.0.1"  # a client-sent hop is not believed
    assert seen["x-forwarded-proto"] == "http"


async def test_first_matching_route_wins_on_path_and_model_glob(serve_app, start_gateway, tmp_path):
    a, b = Recorder(), Recorder()
    url_a, url_b = await serve_app(a.app()), await serve_app(b.app())
    policy = write_policy(
        tmp_path,
        f"""
        backends:
          small: {{url: "{url_a}"}}
          big: {{url: "{url_b}"}}
        routes:
          - match: {{path: "/v1/*", model: "llama*"}}
            backend: small
          - match: {{path: "/v1/*"}}
            backend: big
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        r1 = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        r2 = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "model": "gpt"})
        r3 = await client.get(gw.url + "/v1/models")
    assert (r1.headers["X-Gateway-Backend"], r2.headers["X-Gateway-Backend"]) == ("small", "big")
    assert r3.headers["X-Gateway-Backend"] == "big"
    assert len(a.seen) == 1 and len(b.seen) == 2


async def test_no_matching_route_is_an_openai_shaped_404(upstream, start_gateway, tmp_path):
    _, url = upstream
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{match: {{path: "/v1/*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.url + "/elsewhere")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "no_route"
    assert set(r.json()["error"]) >= {"message", "type", "code"}


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b"",
        b'{"model": "m"}',
        b'{"model": 7, "messages": []}',
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
        b'{"model": "m", "messages": []}',
        b"\xff\xfe",
    ],
)
async def test_malformed_openai_body_is_400_and_never_reaches_backend(
    upstream, start_gateway, body
):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        r = await client.post(
            gw.url + "/v1/chat/completions",
            content=body,
            headers={"Content-Type": "application/json"},
        )
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert recorder.seen == []


async def test_other_paths_pass_through_with_body_unread(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    payload = b"\x00not json at all\xff" * 100
    async with httpx.AsyncClient() as client:
        r = await client.post(
            gw.url + "/generate?stream=false&x=1",
            content=payload,
            headers={"Content-Type": "application/octet-stream"},
        )
    assert r.status_code == 200
    assert r.json() == {"path": "/generate?stream=false&x=1", "len": len(payload), "method": "POST"}
    assert recorder.seen[-1].body == payload
    assert r.headers["X-Upstream"] == "yes"


async def test_chunked_request_body_is_forwarded_whole(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    body = json.dumps(CHAT).encode()

    async def chunks():
        for i in range(0, len(body), 7):
            yield body[i : i + 7]

    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", content=chunks())
    assert r.status_code == 200
    assert recorder.seen[-1].body == body


async def test_expect_100_continue_is_honoured(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    host, port = gw.url.removeprefix("http://").split(":")
    body = json.dumps(CHAT).encode()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    await writer.drain()
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim.startswith(b"HTTP/1.1 100")
    writer.write(body)
    await writer.drain()
    final = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert final.startswith(b"HTTP/1.1 200")
    writer.close()
    assert recorder.seen[-1].body == body
    assert "Expect" not in recorder.seen[-1].headers


async def test_body_over_limit_is_413(upstream, start_gateway, tmp_path):
    recorder, url = upstream
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        server: {{max_body_bytes: 1000}}
        """,
    )
    gw = await start_gateway(policy=policy)

    async def chunked():
        for _ in range(10):
            yield b"x" * 200

    async with httpx.AsyncClient() as client:
        sized = await client.post(gw.url + "/upload", content=b"x" * 1001)
        streamed = await client.post(gw.url + "/upload", content=chunked())
        fine = await client.post(gw.url + "/upload", content=b"x" * 1000)
    assert sized.status_code == streamed.status_code == 413
    assert sized.json()["error"]["code"] == "request_too_large"
    assert fine.status_code == 200
    assert len(recorder.seen) == 1


async def test_refused_upstream_is_502(start_gateway, unused_tcp_port):
    gw = await start_gateway(upstream=f"http://127.0.0.1:{unused_tcp_port}")
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert r.json()["error"]["code"] == "upstream_unavailable"
    assert r.headers["X-Gateway-Backend"] == "upstream"


async def test_upstream_timeout_is_504_and_cancels_upstream(upstream, start_gateway, tmp_path):
    recorder, url = upstream
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", timeout_s: 0.2}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.url + "/slow")
    assert r.status_code == 504
    assert r.json()["error"]["code"] == "upstream_timeout"
    await asyncio.wait_for(recorder.cancelled.wait(), 5)


async def test_upstream_error_responses_pass_through_untouched(upstream, start_gateway):
    _, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        direct = await client.post(
            url + "/v1/chat/completions", json={**CHAT, "model": "bad-request"}
        )
        proxied = await client.post(
            gw.url + "/v1/chat/completions", json={**CHAT, "model": "bad-request"}
        )
    assert proxied.status_code == direct.status_code == 422
    assert proxied.content == direct.content


async def test_content_encoding_and_length_relayed_as_sent(upstream, start_gateway):
    _, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        async with client.stream("GET", gw.url + "/gzip", headers={"Accept-Encoding": "gzip"}) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
    assert r.headers["Content-Encoding"] == "gzip"
    assert int(r.headers["Content-Length"]) == len(raw)
    assert gzip.decompress(raw) == b'{"compressed": true}'


async def test_backend_headers_take_env_values_and_are_redacted(
    upstream, start_gateway, tmp_path, monkeypatch
):
    recorder, url = upstream
    monkeypatch.setenv("UPSTREAM_KEY", "sk-secret-123")
    policy = write_policy(
        tmp_path,
        f"""
        backends:
          main:
            url: "{url}"
            headers: {{Authorization: "Bearer ${{UPSTREAM_KEY}}"}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        await client.post(
            gw.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer client"}
        )
        shown = await client.get(gw.admin_url + "/policy")
    assert recorder.seen[-1].headers["Authorization"] == "Bearer sk-secret-123"
    assert "sk-secret-123" not in shown.text
    assert shown.json()["policy"]["backends"]["main"]["headers"]["Authorization"] == "***"


async def test_path_and_query_go_upstream_exactly_as_sent(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    target = "/v2/models/my%20model/infer?x=%2F&y=a+b&z=%E2%9C%93"
    async with httpx.AsyncClient() as client:
        r = await client.post(gw.url + target, content=b"{}")
    assert r.status_code == 200
    assert recorder.seen[-1].path_qs == target
