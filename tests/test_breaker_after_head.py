"""The breaker sees failures after a 200 head: a stream cut or misframed mid-way, an answer
that is not JSON.  A backend that fails that way opens its breaker and the route's fallback
takes over; a stream its client abandons counts for nothing."""

from __future__ import annotations

import httpx
import pytest

from gateway.resilience.stage import GUARDS
from tests.helpers import write_policy
from tests.upstreams import RawExchange, Recorder

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
)
EVENT = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


@pytest.fixture
async def breaking(raw_backend, serve_app, start_gateway, tmp_path):
    """A primary whose answers break after their head, and a healthy fallback."""

    def respond(ex: RawExchange):
        if b'"stream":true' in ex.body.replace(b" ", b""):
            return SSE_HEAD + chunk(EVENT) + b"zz\r\ngarbage", "close"
        return (
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 9\r\n\r\n"
            b"<garbage>"
        )

    primary, backend = await raw_backend(respond)
    fallback = Recorder()
    fallback_url = await serve_app(fallback.app())
    policy = write_policy(
        tmp_path,
        f"""
        backends:
          primary:
            url: "{primary}"
            circuit_breaker: {{consecutive_failures: 3, min_calls: 1000, open_s: 60}}
          spare: {{url: "{fallback_url}"}}
        routes: [{{backend: primary, fallback: [spare]}}]
        """,
    )
    return backend, fallback, await start_gateway(policy=policy)


def breaker_state(gw) -> float:
    return gw.gateway.metrics.breaker_state.labels("primary")._value.get()


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


async def test_streams_cut_after_their_head_open_the_breaker(breaking):
    backend, _fallback, gw = breaking
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            with pytest.raises(httpx.RemoteProtocolError):  # cut: fallback is too late
                async with client.stream(
                    "POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}
                ) as r:
                    async for _ in r.aiter_raw():
                        pass
        assert breaker_state(gw) == 1  # open
        after = await client.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert after.status_code == 200 and after.headers["X-Gateway-Fallback"] == "circuit_open"
    assert len(backend.exchanges) == 3


async def test_answers_that_are_not_json_open_the_breaker(breaking):
    backend, _fallback, gw = breaking
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            r = await client.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "x"})
            assert r.content == b"<garbage>"  # the backend's answer, passed on as it is
        assert breaker_state(gw) == 1
        after = await client.post(gw.url + "/v1/embeddings", json={"model": "m", "input": "x"})
    assert after.status_code == 200 and after.headers["X-Gateway-Fallback"] == "circuit_open"
    assert len(backend.exchanges) == 3


async def test_a_stream_its_client_abandons_counts_for_nothing(serve_app, start_gateway, tmp_path):
    rec = Recorder()
    url = await serve_app(rec.app())
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}", circuit_breaker: {{consecutive_failures: 1}}}}}}
        routes: [{{backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            async with client.stream("POST", gw.url + "/gated", json={}) as r:
                await r.aiter_raw().__anext__()
            await rec.cancelled.wait()
            rec.cancelled.clear()
    assert gw.gateway.metrics.breaker_state.labels("main")._value.get() == 0
    assert "in_a_row=0/1" in repr(gw.gateway.registry.peek(GUARDS, "main").breaker)
