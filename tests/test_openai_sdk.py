"""The official openai SDK, sync and async, streaming and not, gets the same answers
through the gateway as from the backend directly, and sees the gateway's errors as the
SDK's own exception types."""

from __future__ import annotations

import asyncio

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from gateway.sim import SimConfig, start_sim

MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is a sidecar?"}]


@pytest.fixture
async def sim():
    server = await start_sim(SimConfig(port=0, base_ms=1.0, per_item_ms=0.5, token_ms=0.0))
    yield server
    await server.close()


def sync_calls(base_url: str) -> dict[str, object]:
    with openai.OpenAI(base_url=base_url + "/v1", api_key="sk-test", max_retries=0) as client:
        chat = client.chat.completions.create(model="sim-model", messages=MESSAGES, temperature=0)
        stream = client.chat.completions.create(
            model="sim-model",
            messages=MESSAGES,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
        embedding = client.embeddings.create(model="sim-model", input=["a", "b"])
        models = [m.id for m in client.models.list()]
    assert chat.usage is not None
    return {
        "chat": chat.choices[0].message.content,
        "usage": chat.usage.model_dump(),
        "stream": "".join(pieces),
        "embedding": [d.embedding[:4] for d in embedding.data],
        "models": models,
    }


async def async_calls(base_url: str) -> dict[str, object]:
    async with openai.AsyncOpenAI(
        base_url=base_url + "/v1", api_key="sk-test", max_retries=0
    ) as client:
        chat = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, temperature=0
        )
        stream = await client.chat.completions.create(
            model="sim-model", messages=MESSAGES, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        completion = await client.completions.create(
            model="sim-model", prompt=["x", "y"], max_tokens=4, temperature=0
        )
    return {
        "chat": chat.choices[0].message.content,
        "stream": "".join(pieces),
        "completion": [c.text for c in completion.choices],
    }


async def test_sync_sdk_gets_the_same_answers_through_the_gateway(sim, start_gateway):
    gw = await start_gateway(upstream=sim.url)
    direct = await asyncio.to_thread(sync_calls, sim.url)
    proxied = await asyncio.to_thread(sync_calls, gw.url)
    assert proxied == direct
    assert proxied["stream"] == proxied["chat"]


async def test_async_sdk_gets_the_same_answers_through_the_gateway(sim, start_gateway):
    gw = await start_gateway(upstream=sim.url)
    assert await async_calls(gw.url) == await async_calls(sim.url)


async def test_sdk_raises_its_own_error_types_for_gateway_errors(
    start_gateway, unused_tcp_port, tmp_path
):
    gw = await start_gateway(upstream=f"http://127.0.0.1:{unused_tcp_port}")
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="m", messages=MESSAGES)
        assert info.value.status_code == 502
        assert info.value.code == "upstream_unavailable"
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(model="m", messages=[])
        assert "messages" in bad.value.message
    policy = tmp_path / "p.yaml"
    policy.write_text(
        f'backends: {{a: {{url: "http://127.0.0.1:{unused_tcp_port}"}}}}\n'
        "routes: [{match: {path: /v1/embeddings}, backend: a}]\n"
    )
    routed = await start_gateway(policy=policy)
    async with openai.AsyncOpenAI(
        base_url=routed.url + "/v1", api_key="k", max_retries=0
    ) as client:
        with pytest.raises(openai.NotFoundError) as missing:
            await client.chat.completions.create(model="m", messages=MESSAGES)
    assert missing.value.code == "no_route"


async def test_the_sdk_reads_the_callers_rate_standing_and_its_429(sim, start_gateway, tmp_path):
    """A gateway ``rate_limit``: the SDK's raw response carries the caller's own
    ``x-ratelimit-*`` standing, and past the limit the SDK raises its ``RateLimitError``
    with the same headers (what clients pace themselves by)."""
    policy = tmp_path / "p.yaml"
    policy.write_text(
        f'backends: {{sim: {{url: "{sim.url}"}}}}\n'
        "routes: [{match: {path: /v1/*}, backend: sim,"
        " rate_limit: {requests_per_s: 0.01, burst: 2}}]\n"
    )
    gw = await start_gateway(policy=policy)
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0) as client:
        create = client.chat.completions.with_raw_response.create
        left = []
        for _ in range(2):
            raw = await create(model="sim-model", messages=MESSAGES, temperature=0)
            assert raw.headers["x-ratelimit-limit-requests"] == "2"
            left.append(raw.headers["x-ratelimit-remaining-requests"])
            assert raw.parse().choices[0].message.content
        assert left == ["1", "0"]
        with pytest.raises(openai.RateLimitError) as over:
            await client.chat.completions.create(model="sim-model", messages=MESSAGES)
    assert over.value.code == "rate_limit_exceeded"
    assert over.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    assert over.value.response.headers["x-ratelimit-reset-requests"].endswith("s")
