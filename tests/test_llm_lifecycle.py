"""The gateway's readiness and cancellation against llama.cpp's real server: ``/readyz``
stays not ready while the server loads its model (its ``/health`` 503) and turns ready only
once the warm-up request was answered; a client that leaves a stream frees the server's
slot (``/slots``) within a second, long before the generation it asked for would end."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.testing.llama import LlamaOptions, LlamaServer
from tests.helpers import write_policy
from tests.llama import chat

pytestmark = pytest.mark.llm

FREED_WITHIN_S = 1.0


async def test_readyz_waits_for_the_model_to_load_and_the_warmup_to_be_answered(
    start_gateway, tmp_path
):
    server = LlamaServer(LlamaOptions(slots=1, context_tokens_per_slot=256)).start()
    try:
        policy = write_policy(
            tmp_path,
            f"""
            backends:
              llm:
                url: "{server.url}"
                warmup_timeout_s: 120
                warmup:
                  - path: /v1/chat/completions
                    body: {{messages: [{{role: user, content: warm up}}], max_tokens: 1}}
            routes: [{{match: {{path: "/*"}}, backend: llm}}]
            """,
        )
        gw = await start_gateway(policy=policy)
        seen: list[tuple[int, int]] = []  # (readyz, the server's /health just after)
        async with httpx.AsyncClient(timeout=10) as http:
            while not seen or seen[-1][0] != 200:
                ready = (await http.get(gw.admin_url + "/readyz")).status_code
                seen.append((ready, await asyncio.to_thread(server.health)))
                assert len(seen) < 6000, "not ready within 10 minutes"
                await asyncio.sleep(0.02)
        loading = [health for ready, health in seen if health != 200]
        assert loading, f"the model loaded before the first look: {seen[:3]}"
        assert all(ready == 503 for ready, health in seen if health != 200)
        assert 503 in loading  # the server said it was loading, the gateway was not ready
        assert server.metrics()["n_decode_total"] >= 1  # the warm-up was answered
    finally:
        server.stop()


async def test_a_client_leaving_a_stream_frees_the_servers_slot(llama, start_gateway):
    """The gateway closes the upstream stream when its client goes; llama.cpp stops the
    generation (1,000 tokens asked, the end of text ignored) and its slot is idle again."""
    gw = await start_gateway(upstream=llama.url)
    before = llama.metrics()["tokens_predicted_total"]
    body = {**chat("Tell me a long story.", max_tokens=1000), "stream": True, "ignore_eos": True}
    async with (
        httpx.AsyncClient(timeout=60) as http,
        http.stream("POST", gw.url + "/v1/chat/completions", json=body) as reply,
    ):
        assert reply.status_code == 200
        tokens = 0
        async for line in reply.aiter_lines():
            tokens += line.startswith("data: ") and '"content":"' in line
            if tokens >= 3:
                break
        assert any(slot["is_processing"] for slot in llama.slots())
    left = time.monotonic()
    while any(slot["is_processing"] for slot in await asyncio.to_thread(llama.slots)):
        assert time.monotonic() - left < FREED_WITHIN_S, "the slot still generates"
        await asyncio.sleep(0.02)
    counted = llama.metrics()
    assert counted["requests_processing"] == 0
    assert counted["tokens_predicted_total"] - before < 1000  # stopped, not finished
