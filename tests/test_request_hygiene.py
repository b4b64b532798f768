"""What the edge decides about a request before any stage sees it: compressed bodies,
strict JSON, the forwarding headers, the tenant (scope and rate-limit key) and the request
id.  Nothing a client sends produces a 5xx from the gateway itself."""

from __future__ import annotations

import gzip
import json
import logging
import zlib

import httpx
import pytest

from gateway.testing import FakeClock
from tests.helpers import CHAT, write_policy
from tests.upstreams import Recorder


@pytest.fixture
async def upstream(serve_app):
    recorder = Recorder()
    return recorder, await serve_app(recorder.app())


def post(client: httpx.AsyncClient, url: str, body: bytes, **headers: str):
    return client.post(url, content=body, headers={"Content-Type": "application/json", **headers})


async def test_a_gzip_chat_body_is_decoded_and_forwarded_without_its_encoding(
    upstream, start_gateway
):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    raw = json.dumps(CHAT).encode()
    async with httpx.AsyncClient() as client:
        for encoding, body in (
            ("gzip", gzip.compress(raw)),
            ("deflate", zlib.compress(raw)),
            ("identity", raw),
        ):
            r = await post(
                client, gw.url + "/v1/chat/completions", body, **{"Content-Encoding": encoding}
            )
            assert r.status_code == 200, encoding
            seen = recorder.seen[-1]
            assert seen.body == raw
            assert "Content-Encoding" not in seen.headers
            assert seen.headers["Content-Length"] == str(len(raw))


@pytest.mark.parametrize(
    ("encoding", "body", "status", "code"),
    [
        ("gzip", gzip.compress(b"{" + b" " * (2 * 1024 * 1024) + b"}"), 413, "request_too_large"),
        ("br", b"\x1b\x00", 415, "unsupported_content_encoding"),
        ("gzip", b"not gzip at all", 400, "invalid_json"),
        ("gzip", gzip.compress(b'{"a": 1}')[:-6], 400, "invalid_json"),
    ],
    ids=["bomb", "brotli", "not gzip", "truncated gzip"],
)
async def test_a_body_that_cannot_be_decoded_is_refused(
    upstream, start_gateway, tmp_path, encoding, body, status, code
):
    recorder, url = upstream
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
        "server: {max_body_bytes: 1048576}\n",
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        r = await post(
            client, gw.url + "/v1/chat/completions", body, **{"Content-Encoding": encoding}
        )
    assert r.status_code == status
    assert r.json()["error"]["code"] == code
    assert recorder.seen == []


async def test_a_pass_through_body_is_forwarded_byte_for_byte(raw_backend, start_gateway):
    """No decompression on other paths: the bytes and their Content-Encoding go on as sent
    (the raw backend sees the wire, where an aiohttp one would decompress on read)."""
    url, backend = await raw_backend(lambda ex: b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
    gw = await start_gateway(upstream=url)
    body = gzip.compress(b"opaque payload")
    async with httpx.AsyncClient() as client:
        r = await client.post(
            gw.url + "/upload", content=body, headers={"Content-Encoding": "gzip"}
        )
    assert r.status_code == 200
    [seen] = backend.exchanges
    assert (seen.body, seen.header("content-encoding")) == (body, "gzip")


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 1000 + b"]" * 1000,
        b'{"model": "m", "messages": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"model": "m", "max_tokens": ' + b"9" * 5000 + b', "messages": []}',
        b'{"model": "m", "max_tokens": 1e999, "messages": []}',
        b'{"model": "m", "temperature": NaN, "messages": []}',
        b'{"model": "m", "temperature": Infinity, "messages": []}',
        b'{"model": "m", "temperature": -Infinity, "messages": []}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\udfff x"}]}',
        b'{"model": "\xff", "messages": []}',
        b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]} trailing',
    ],
    ids=[
        "1000 deep",
        "100 deep inside",
        "5000-digit integer",
        "float overflow",
        "NaN",
        "Infinity",
        "-Infinity",
        "lone high surrogate",
        "lone low surrogate",
        "invalid UTF-8",
        "trailing data",
    ],
)
async def test_json_beyond_the_standard_or_its_bounds_is_a_400(
    upstream, start_gateway, caplog, body
):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    with caplog.at_level(logging.WARNING):
        async with httpx.AsyncClient() as client:
            r = await post(client, gw.url + "/v1/chat/completions", body)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert recorder.seen == []
    assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]


async def test_a_paired_surrogate_and_a_long_digit_string_are_fine(upstream, start_gateway):
    _recorder, url = upstream
    gw = await start_gateway(upstream=url)
    content = "\\ud83d\\ude00 call 123456789012345678901234567890"
    body = b'{"model": "m", "messages": [{"role": "user", "content": "%s"}]}' % content.encode()
    async with httpx.AsyncClient() as client:
        r = await post(client, gw.url + "/v1/chat/completions", body)
    assert r.status_code == 200
    assert "\U0001f600" in r.json()["choices"][0]["message"]["content"]


SPOOFED = {
    "Forwarded": "for=10.9.9.9;host=evil;proto=https",
    "X-Real-IP": "10.9.9.9",
    "X-Forwarded-For": "10.9.9.9",
    "X-Forwarded-Host": "evil",
    "X-Forwarded-Proto": "https",
}


async def test_forwarding_headers_from_an_untrusted_client_are_replaced(upstream, start_gateway):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        await client.get(gw.url + "/v1/models", headers=SPOOFED)
    seen = recorder.seen[-1].headers
    host = gw.url.removeprefix("http://")
    assert seen["X-Forwarded-For"] == "127.0.0.1"
    assert seen["X-Real-IP"] == "127.0.0.1"
    assert seen["X-Forwarded-Proto"] == "http"
    assert seen["X-Forwarded-Host"] == host
    assert seen["Forwarded"] == f'for=127.0.0.1;host="{host}";proto=http'
    assert "evil" not in json.dumps(seen) and "10.9.9.9" not in json.dumps(seen)


async def test_after_a_trusted_proxy_forwarding_headers_are_kept_and_extended(
    upstream, start_gateway, tmp_path
):
    recorder, url = upstream
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
        'server: {trusted_proxies: ["127.0.0.0/8", "10.0.0.0/8"]}\n',
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        await client.get(
            gw.url + "/v1/models",
            headers={
                **SPOOFED,
                "X-Forwarded-For": "203.0.113.7, 10.1.2.3",
                "X-Real-IP": "203.0.113.7",
            },
        )
    seen = recorder.seen[-1].headers
    assert seen["X-Forwarded-For"] == "203.0.113.7, 10.1.2.3, 127.0.0.1"
    assert seen["X-Real-IP"] == "203.0.113.7"
    assert (seen["X-Forwarded-Host"], seen["X-Forwarded-Proto"]) == ("evil", "https")
    assert seen["Forwarded"].startswith("for=10.9.9.9;host=evil;proto=https, for=127.0.0.1;")


async def test_the_rate_limit_counts_one_tenant_however_its_credential_is_spelled(
    upstream, start_gateway, tmp_path
):
    """``bearer  k``, ``Bearer k`` and ``BEARER k`` are one tenant: one bucket."""
    _, url = upstream
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\n'
        "routes: [{backend: main, rate_limit: {requests_per_s: 1, burst: 1}}]\n",
    )
    gw = await start_gateway(policy=policy, clock=FakeClock())
    async with httpx.AsyncClient() as client:
        statuses = [
            (
                await client.post(
                    gw.url + "/v1/chat/completions", json=CHAT, headers={"Authorization": auth}
                )
            ).status_code
            for auth in ("Bearer k", "bearer  k", "BEARER\tk", "Bearer other")
        ]
    assert statuses == [200, 429, 429, 200]


async def test_connection_cannot_move_a_request_into_another_tenants_scope(
    upstream, start_gateway, tmp_path
):
    """Naming Authorization in Connection strips it before forwarding, but the tenant
    scope was computed from the headers as received: no hit from the anonymous scope."""
    recorder, url = upstream
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main, cache: {{ttl_s: 60}}}}]\n',
    )
    gw = await start_gateway(policy=policy)
    chat = {**CHAT, "temperature": 0}
    async with httpx.AsyncClient() as client:
        anonymous = await client.post(gw.url + "/v1/chat/completions", json=chat)
        smuggled = await client.post(
            gw.url + "/v1/chat/completions",
            json=chat,
            headers={"Authorization": "Bearer b", "Connection": "keep-alive, authorization"},
        )
    assert anonymous.headers["X-Gateway-Cache"] == "miss"
    assert smuggled.headers["X-Gateway-Cache"] == "miss"
    assert len(recorder.seen) == 2
    assert "Authorization" not in recorder.seen[-1].headers


@pytest.mark.parametrize(
    ("given", "kept"),
    [("req-42", True), ("a b", False), ("x" * 129, False), ("ünï", False), ("ok:/+=._-1", True)],
)
async def test_a_client_request_id_is_kept_only_when_it_is_a_plain_token(
    upstream, start_gateway, given, kept
):
    recorder, url = upstream
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.url + "/v1/models", headers={"X-Request-ID": given.encode("utf-8")})
    assert (r.headers["X-Request-ID"] == given) is kept
    assert recorder.seen[-1].headers["X-Request-ID"] == r.headers["X-Request-ID"]
