"""Endpoint picking and throttle rules on llama.cpp's own signals, two real servers of one
slot each: its ``/metrics`` (``--metrics``) says how many requests hold a slot
(``llamacpp:requests_processing``, the ``requests_running`` signal) and how many wait for
one (``llamacpp:requests_deferred``, ``queue_waiting``); the gateway exports both per
endpoint as ``gateway_endpoint_signal``, ``kv_aware`` sends nothing to a server whose queue
is over its ``saturation``, and a rule firing on one server's signal takes it out of
rotation while the other serves."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.testing.llama import LlamaServer
from tests.helpers import metric, until, write_policy
from tests.llama import chat

pytestmark = pytest.mark.llm

TELEMETRY = {"source": "prometheus", "url": "http://{host}:{port}/metrics", "interval_ms": 200}


@contextlib.asynccontextmanager
async def busy(server: LlamaServer, requests: int) -> AsyncIterator[None]:
    """``requests`` long generations straight at ``server`` (one holds its slot, the rest
    wait), ended when the block is left (their clients go; the server stops them)."""
    body = {**chat("Tell me a long story.", max_tokens=1000), "stream": True, "ignore_eos": True}
    started = asyncio.Event()

    async def one(http: httpx.AsyncClient) -> None:
        async with http.stream("POST", server.url + "/v1/chat/completions", json=body) as r:
            async for _ in r.aiter_bytes():
                started.set()

    async with httpx.AsyncClient(timeout=None) as http:
        tasks = [asyncio.create_task(one(http)) for _ in range(requests)]
        try:
            await asyncio.wait_for(started.wait(), 60)
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def series(gw, name: str, url: str, **labels: str) -> float | None:
    """The gateway's series ``name`` for backend ``llm``'s endpoint ``url``."""
    text = gw.gateway.metrics.exposition().decode()
    return metric(text, name, backend="llm", endpoint=url, **labels)


def signal(gw, url: str, name: str) -> float | None:
    return series(gw, "gateway_endpoint_signal", url, signal=name)


def served(gw, url: str) -> float:
    return series(gw, "gateway_endpoint_requests_total", url, status="2xx") or 0.0


async def ask(gw, count: int) -> None:
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(count):
            r = await http.post(gw.url + "/v1/chat/completions", json=chat(f"Hi {i}", max_tokens=1))
            assert r.status_code == 200, r.text


async def test_kv_aware_sends_nothing_to_a_server_with_requests_deferred(
    llama_pair, start_gateway, tmp_path
):
    a, b = llama_pair
    policy = write_policy(
        tmp_path,
        {
            "backends": {
                "llm": {
                    "endpoints": [a.url, b.url],
                    "balance": "kv_aware",
                    "saturation": {"queue_waiting": 0},
                    "telemetry": TELEMETRY,
                }
            },
            "routes": [{"backend": "llm"}],
        },
    )
    gw = await start_gateway(policy=policy)
    await until(lambda: signal(gw, b.url, "queue_waiting") == 0, timeout_s=30)
    async with busy(a, requests=3):
        await until(lambda: (signal(gw, a.url, "queue_waiting") or 0) >= 1, timeout_s=30)
        assert signal(gw, a.url, "requests_running") == 1  # its one slot
        assert signal(gw, b.url, "requests_running") == 0
        before = served(gw, a.url), served(gw, b.url)
        await ask(gw, 4)
        assert (served(gw, a.url), served(gw, b.url)) == (before[0], before[1] + 4)
    await until(lambda: signal(gw, a.url, "queue_waiting") == 0, timeout_s=30)


async def test_a_rule_on_deferred_requests_takes_that_server_out_of_rotation(
    llama_pair, start_gateway, tmp_path
):
    a, b = llama_pair
    policy = write_policy(
        tmp_path,
        {
            "backends": {"llm": {"endpoints": [a.url, b.url], "telemetry": TELEMETRY}},
            "routes": [{"backend": "llm"}],
            "throttle": [
                {
                    "name": "deferring",
                    "backend": "llm",
                    "when": {"signal": "queue_waiting", "above": 0.5, "clear_below": 0.5},
                    "action": "shed",
                }
            ],
        },
    )
    gw = await start_gateway(policy=policy)

    def throttled(url: str) -> float | None:
        return series(gw, "gateway_endpoint_state", url, state="throttled")

    await until(lambda: signal(gw, a.url, "queue_waiting") == 0, timeout_s=30)
    async with busy(a, requests=2):
        await until(lambda: throttled(a.url) == 1.0, timeout_s=30)
        before = served(gw, a.url), served(gw, b.url)
        await ask(gw, 4)  # one at a time: b never defers, so the backend is not shed
        assert (served(gw, a.url), served(gw, b.url)) == (before[0], before[1] + 4)
    await until(lambda: throttled(a.url) == 0.0, timeout_s=30)


async def test_a_stream_waiting_for_a_busy_servers_slot_is_hedged_to_the_free_one(
    llama_pair, start_gateway, tmp_path
):
    """``hedge.streams`` on two real servers: one's slot held by a long generation, a
    stream sent there gets no first token, so after ``after_ms`` it is also sent to the
    other, whose first token wins; the waiting one is cancelled."""
    a, b = llama_pair
    hedge = {"after_ms": 300, "answers": False, "streams": True}
    backend = {"endpoints": [a.url, b.url], "balance": "round_robin", "hedge": hedge}
    policy = write_policy(tmp_path, {"backends": {"llm": backend}, "routes": [{"backend": "llm"}]})
    gw = await start_gateway(policy=policy)
    async with busy(a, requests=1), httpx.AsyncClient(timeout=120) as http:
        for i in range(2):  # round robin: the second picks the busy server first
            body = {**chat(f"Hi {i}", max_tokens=3), "stream": True}
            async with http.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                streamed = b"".join([chunk async for chunk in r.aiter_bytes()])
            assert streamed.rstrip().endswith(b"data: [DONE]")
        text = gw.gateway.metrics.exposition().decode()
        assert (
            metric(text, "gateway_hedges_total", backend="llm", kind="stream", outcome="won") == 1
        )
        assert served(gw, a.url) == 0  # its one call was cancelled before any answer
    await until(lambda: a.metrics().get("requests_deferred") == 0, timeout_s=30)
