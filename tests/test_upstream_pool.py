"""Upstream connection handling: stale keep-alive sockets, TLS verification, pools kept or
replaced across reloads."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from tests.helpers import CHAT, write_policy
from tests.upstreams import Recorder


async def test_stale_pooled_connection_is_retried_once_on_a_fresh_one(start_gateway):
    """The backend closes a keep-alive connection just as the gateway reuses it: the client
    still gets its answer."""
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        served = 0
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                break
            length = next(
                (
                    int(line.split(b":")[1])
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            await reader.readexactly(length)
            if served == 1:  # the keep-alive timer fired: close without answering
                break
            body = b'{"ok": true}'
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
            served += 1
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        gw = await start_gateway(upstream=f"http://127.0.0.1:{port}")
        async with httpx.AsyncClient() as client:
            first = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
            second = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
        assert first.status_code == second.status_code == 200
        assert connections == 2
        assert (
            'gateway_upstream_stale_retries_total{backend="upstream"} 1.0'
            in gw.gateway.metrics.exposition().decode()
        )
    finally:
        server.close()
        await server.wait_closed()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it."""
    d = tmp_path_factory.mktemp("tls")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=127.0.0.1",
    )
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "1",
        "-extfile",
        "ext.cnf",
    )
    return d / "ca.pem", d / "srv.pem", d / "srv.key"


async def test_https_backend_is_verified_against_its_ca_bundle(tls_files, tmp_path, start_gateway):
    import ssl

    ca, cert, key = tls_files
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    recorder = Recorder()
    runner = web.AppRunner(recorder.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        trusted = write_policy(
            tmp_path,
            f"""
            backends: {{main: {{url: "https://127.0.0.1:{port}", ca_bundle: "{ca}"}}}}
            routes: [{{match: {{path: "*"}}, backend: main}}]
            """,
            "trusted.yaml",
        )
        untrusted = write_policy(
            tmp_path,
            f"""
            backends: {{main: {{url: "https://127.0.0.1:{port}"}}}}
            routes: [{{match: {{path: "*"}}, backend: main}}]
            """,
            "untrusted.yaml",
        )
        good = await start_gateway(policy=trusted)
        bad = await start_gateway(policy=untrusted)
        async with httpx.AsyncClient() as client:
            ok = await client.post(good.url + "/v1/chat/completions", json=CHAT)
            refused = await client.post(bad.url + "/v1/chat/completions", json=CHAT)
        assert ok.status_code == 200
        assert refused.status_code == 502
        assert len(recorder.seen) == 1
    finally:
        await runner.cleanup()


async def test_reload_keeps_pool_of_unchanged_backend_and_replaces_a_moved_one(
    serve_app, start_gateway, tmp_path
):
    one, two = Recorder(), Recorder()
    url1, url2 = await serve_app(one.app()), await serve_app(two.app())
    path = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url1}"}}, other: {{url: "{url1}"}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=path, watch_interval_s=3600)
    upstreams = gw.gateway.transport
    async with httpx.AsyncClient() as client:
        async with client.stream("POST", gw.url + "/gated", json={}) as r:
            chunks = r.aiter_raw()
            await chunks.__anext__()
            old_main = upstreams.pool(gw.gateway.snapshot.policy.backend("main"))
            old_other = upstreams.pool(gw.gateway.snapshot.policy.backend("other"))
            write_policy(
                tmp_path,
                f"""
                backends: {{main: {{url: "{url2}"}}, other: {{url: "{url1}"}}}}
                routes: [{{match: {{path: "*"}}, backend: main}}]
                """,
            )
            assert gw.gateway.reload()
            new_policy = gw.gateway.snapshot.policy
            assert upstreams.pool(new_policy.backend("other")) is old_other
            assert upstreams.pool(new_policy.backend("main")) is not old_main
            assert not old_main.closed  # the stream in flight still uses it
            one.release.set()
            rest = b"".join([c async for c in chunks])
        assert rest.endswith(b"[DONE]\n\n")
        for _ in range(100):
            if old_main.closed:
                break
            await asyncio.sleep(0.01)
        assert old_main.closed
        after = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert after.status_code == 200
    assert len(two.seen) == 1
