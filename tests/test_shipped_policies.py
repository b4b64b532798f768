"""Every policy shipped in ``policies/`` serves what an OpenAI client asks first: the
models list, chat, streaming chat and embeddings, driven by the official openai SDK, with
every backend (and telemetry URL) pointed at the simulated model server."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.sim import SimConfig, start_sim
from tests.redis_server import redis_url  # noqa: F401

POLICIES = sorted((Path(__file__).resolve().parent.parent / "policies").glob("*.yaml"))
URL = re.compile(r"https?://[^/\s\"']+")
MODEL = "llama-3.1-8b"


@pytest.fixture
async def sim():
    server = await start_sim(SimConfig(port=0, base_ms=1.0, per_item_ms=0.5, token_ms=0.0))
    yield server
    await server.close()


def calls(base_url: str) -> dict[str, object]:
    with openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test", max_retries=0) as client:
        models = [m.id for m in client.models.list()]
        messages: list[ChatCompletionMessageParam] = [
            {"role": "user", "content": "What is a sidecar?"}
        ]
        chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        embedding = client.embeddings.create(model="bge-small-en", input=["a", "b"])
    return {
        "models": models,
        "chat": chat.choices[0].message.content,
        "stream": "".join(pieces),
        "embeddings": len(embedding.data),
    }


@pytest.mark.parametrize("path", POLICIES, ids=[p.name for p in POLICIES])
async def test_a_shipped_policy_serves_models_chat_streams_and_embeddings(
    path,
    sim,
    start_gateway,
    tmp_path,
    monkeypatch,
    redis_url,  # noqa: F811
):
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("TRITON_TOKEN", "triton-secret")
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "a-long-random-admin-token")
    local = tmp_path / path.name
    local.write_text(URL.sub(sim.url, path.read_text()))
    gw = await start_gateway(policy=local, warmup=False)
    got = await asyncio.to_thread(calls, gw.url)
    assert got["models"]
    assert got["chat"] and got["stream"] == got["chat"]
    assert got["embeddings"] == 2
