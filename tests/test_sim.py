"""The simulated GPU server over HTTP: OpenAI shapes, cost headers, faults, metrics, control."""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from gateway.sim import SimConfig, SimServer, conversations, other_apis, run_sim, start_sim

MakeSim = Callable[..., Awaitable[SimServer]]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "why is the sky blue"}]
CHAT: dict[str, Any] = {"model": "sim-model", "messages": MESSAGES}


@pytest.fixture
async def make_sim() -> AsyncIterator[MakeSim]:
    servers: list[SimServer] = []

    async def make(**overrides: Any) -> SimServer:
        server = await start_sim(SimConfig(port=0, **overrides))
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.close()


@pytest.fixture
async def sim(make_sim: MakeSim) -> SimServer:
    return await make_sim()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, sim: SimServer, path: str, body: Any
) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    async with http.post(sim.url + path, json=body) as response:
        return response.status, await response.json(), response.headers


async def embed(http: aiohttp.ClientSession, sim: SimServer, inputs: Any, **extra: Any) -> Any:
    status, body, _ = await post(http, sim, "/v1/embeddings", {"input": inputs, **extra})
    assert status == 200, body
    return [np.array(d["embedding"]) for d in body["data"]]


# --- cost model -------------------------------------------------------------------------


async def test_batched_call_costs_more_than_one_input_but_far_less_than_separate_calls(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    _, _, one = await post(http, sim, "/v1/embeddings", {"input": "a"})
    _, _, eight = await post(http, sim, "/v1/embeddings", {"input": ["a"] * 8})
    one_ms, eight_ms = float(one["x-sim-cost-ms"]), float(eight["x-sim-cost-ms"])
    assert (one_ms, eight_ms) == (50.0, 78.0)
    assert one_ms < eight_ms < 8 * one_ms / 4
    state = sim.state()
    assert (state["calls"], state["items"], state["modelled_ms"]) == (2, 9, 128.0)


async def test_one_slot_serialises_concurrent_calls(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(slots=1, added_latency_ms=100)
    await asyncio.gather(*(post(http, sim, "/v1/embeddings", {"input": "x"}) for _ in range(4)))
    state = sim.state()
    assert state["calls"] == 4
    assert state["peak_running"] == 1
    assert state["peak_waiting"] >= 1
    assert (state["running"], state["waiting"]) == (0, 0)


async def test_chat_cost_is_prefill_plus_token_ms_per_generated_token(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    _, body, headers = await post(http, sim, "/v1/chat/completions", {**CHAT, "max_tokens": 5})
    assert body["usage"]["completion_tokens"] == 5
    assert float(headers["x-sim-cost-ms"]) == 50.0 + 5 * 2.0


async def test_added_latency_shows_in_the_cost_header_and_state(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    sim.configure(added_latency_ms=30)
    _, _, headers = await post(http, sim, "/v1/embeddings", {"input": "a"})
    assert float(headers["x-sim-cost-ms"]) == 80.0
    assert sim.state()["modelled_ms"] == 80.0


# --- deterministic outputs ----------------------------------------------------------------


async def test_same_text_gives_the_same_unit_vector_and_different_text_a_different_one(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    a1, b = await embed(http, sim, ["the cat sat", "quarterly revenue fell"])
    (a2,) = await embed(http, sim, "the cat sat")
    assert np.allclose(a1, a2)
    assert np.linalg.norm(a1) == pytest.approx(1.0, abs=1e-5)
    assert len(a1) == 384
    assert float(a1 @ b) < 0.5


async def test_texts_sharing_words_embed_closer_than_unrelated_texts(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    base, near, far = await embed(
        http, sim, ["how do I reset my password", "how can I reset my password", "best pizza"]
    )
    assert float(base @ near) > float(base @ far) + 0.3


async def test_embeddings_accept_strings_token_lists_and_report_index_and_usage(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    for inputs, count in [("a b", 1), (["a", "b c"], 2), ([1, 2, 3], 1), ([[1, 2], [3]], 2)]:
        status, body, _ = await post(http, sim, "/v1/embeddings", {"input": inputs})
        assert status == 200
        assert [d["index"] for d in body["data"]] == list(range(count))
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert sim.state()["items"] == 6


async def test_embeddings_honour_dimensions_and_base64_encoding(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    (as_floats,) = await embed(http, sim, "hello", dimensions=64)
    status, body, _ = await post(
        http,
        sim,
        "/v1/embeddings",
        {"input": "hello", "dimensions": 64, "encoding_format": "base64"},
    )
    decoded = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert status == 200 and len(as_floats) == 64
    assert np.allclose(decoded, as_floats)


async def test_embeddings_refuse_sizes_that_would_outgrow_memory_and_keep_serving(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    """A hostile ``dimensions`` (a fuzzer's 10**9 once made the sim allocate 24 GB) or
    more inputs times dimensions than one answer may hold are a 400, not an OOM kill."""
    extras: list[dict[str, float]] = [{"dimensions": 10**9}, {"dimensions": 0}, {"dimensions": 3.5}]
    for extra in extras:
        status, body, _ = await post(http, sim, "/v1/embeddings", {"input": "a", **extra})
        assert status == 400 and "dimensions" in body["error"]["message"]
    many = {"input": ["x"] * 1024, "dimensions": 16384}
    status, body, _ = await post(http, sim, "/v1/embeddings", many)
    assert status == 400 and "fewer inputs" in body["error"]["message"]
    (vector,) = await embed(http, sim, "a", dimensions=16384)
    assert len(vector) == 16384


async def test_chat_answer_derives_from_the_prompt_and_honours_max_tokens(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    _, first, _ = await post(http, sim, "/v1/chat/completions", CHAT)
    _, again, _ = await post(http, sim, "/v1/chat/completions", CHAT)
    other = {**CHAT, "messages": [{"role": "user", "content": "something else"}]}
    _, different, _ = await post(http, sim, "/v1/chat/completions", other)
    _, short, _ = await post(http, sim, "/v1/chat/completions", {**CHAT, "max_tokens": 3})
    text = first["choices"][0]["message"]["content"]
    assert text == again["choices"][0]["message"]["content"]
    assert text != different["choices"][0]["message"]["content"]
    assert first["choices"][0]["finish_reason"] == "stop"
    assert first["usage"] == {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21}
    assert short["choices"][0]["finish_reason"] == "length"
    assert short["choices"][0]["message"]["content"] == " ".join(text.split()[:3])


async def test_completions_answer_each_prompt_of_a_list_with_its_own_choice(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    _, body, headers = await post(
        http, sim, "/v1/completions", {"prompt": ["one", "two", "three"], "max_tokens": 4}
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in body["choices"]}) == 3
    assert float(headers["x-sim-cost-ms"]) == 46 + 3 * 4 + 4 * 2
    assert sim.state()["calls"] == 1


async def test_logprobs_are_deterministic_and_the_confidence_knob_lowers_them(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    async def mean_logprob() -> float:
        _, body, _ = await post(http, sim, "/v1/chat/completions", {**CHAT, "logprobs": True})
        entries = body["choices"][0]["logprobs"]["content"]
        return sum(e["logprob"] for e in entries) / len(entries)

    sure = await mean_logprob()
    assert sure == await mean_logprob()
    sim.configure(confidence=0.2)
    assert await mean_logprob() < sure - 1.0


# --- the official SDK ---------------------------------------------------------------------


async def test_async_openai_client_chats_streams_embeds_and_completes(sim: SimServer) -> None:
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client:
        chat = await client.chat.completions.create(model="m", messages=MESSAGES)
        assert chat.choices[0].message.content
        stream = await client.chat.completions.create(
            model="m",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == chat.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
        vectors = await client.embeddings.create(model="m", input=["a", "b"])
        assert [d.index for d in vectors.data] == [0, 1]
        assert len(vectors.data[0].embedding) == 384
        completion = await client.completions.create(model="m", prompt="hi", max_tokens=2)
        assert completion.choices[0].finish_reason == "length"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]


async def test_sync_openai_client_chats_streams_and_embeds(sim: SimServer) -> None:
    def use_sync_client() -> tuple[str, str, int]:
        with openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client:
            chat = client.chat.completions.create(model="m", messages=MESSAGES)
            stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            streamed = "".join(c.choices[0].delta.content or "" for c in stream)
            vectors = client.embeddings.create(model="m", input="a", dimensions=8)
            return chat.choices[0].message.content or "", streamed, len(vectors.data[0].embedding)

    text, streamed, dims = await asyncio.to_thread(use_sync_client)
    assert text and text == streamed
    assert dims == 8


async def test_sdk_sees_injected_errors_as_server_errors(make_sim: MakeSim) -> None:
    sim = await make_sim(error_rate=1.0)
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.InternalServerError):
            await client.embeddings.create(model="m", input="a")
    assert sim.state()["calls"] == 0


# --- faults and errors --------------------------------------------------------------------


async def test_error_rate_one_answers_openai_shaped_errors_with_retry_after_for_503(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(error_rate=1.0, fail_status=503)
    status, body, headers = await post(http, sim, "/v1/chat/completions", CHAT)
    assert status == 503
    assert set(body["error"]) >= {"message", "type", "code"}
    assert headers["Retry-After"] == "1"


async def test_calls_over_oom_above_fail_with_cuda_out_of_memory(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(oom_above=4)
    ok, _, _ = await post(http, sim, "/v1/embeddings", {"input": ["a"] * 4})
    status, body, _ = await post(http, sim, "/v1/embeddings", {"input": ["a"] * 5})
    assert (ok, status) == (200, 500)
    assert "CUDA out of memory" in body["error"]["message"]
    assert (sim.state()["calls"], sim.state()["ooms"]) == (1, 1)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": []}),
        ("/v1/chat/completions", {**CHAT, "n": 2}),
        ("/v1/chat/completions", {**CHAT, "max_tokens": 0}),
        ("/v1/embeddings", {"input": []}),
        ("/v1/embeddings", {"input": "a", "encoding_format": "int8"}),
        ("/v1/completions", {"prompt": 5}),
    ],
)
async def test_invalid_bodies_get_openai_shaped_400s(
    sim: SimServer, http: aiohttp.ClientSession, path: str, body: Any
) -> None:
    status, answer, _ = await post(http, sim, path, body)
    assert status == 400
    assert answer["error"]["type"] == "invalid_request_error"


async def test_malformed_json_gets_an_openai_shaped_400(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    async with http.post(sim.url + "/v1/chat/completions", data=b"{not json") as response:
        body = await response.json()
    assert response.status == 400
    assert body["error"]["code"] == "invalid_json"
    assert set(body["error"]) >= {"message", "type", "code"}


async def test_a_client_leaving_mid_stream_frees_the_slot(
    make_sim: MakeSim, http: aiohttp.ClientSession
) -> None:
    sim = await make_sim(token_ms=20, answer_tokens=50)
    async with http.post(sim.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        await r.content.readline()
    for _ in range(200):
        if sim.state()["running"] == 0:
            break
        await asyncio.sleep(0.01)
    assert (sim.state()["running"], sim.engine.slots.in_use) == (0, 0)


# --- metrics and control ------------------------------------------------------------------


async def test_metrics_use_dcgm_and_vllm_names_with_dcgm_labels(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(sim.url + "/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_MEMORY_TEMP",
        "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_UTIL",
        "DCGM_FI_DEV_POWER_USAGE",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert name in families, name
    temp = families["DCGM_FI_DEV_GPU_TEMP"].samples[0]
    assert temp.labels["gpu"] == "0"
    assert temp.labels["UUID"].startswith("GPU-")
    assert temp.labels["modelName"] == "NVIDIA H100 80GB HBM3"
    assert temp.value == pytest.approx(40.0, abs=1.0)


async def test_state_and_config_endpoints_read_and_change_the_sim(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(sim.url + "/sim/state") as response:
        state = await response.json()
    assert {"temperature_c", "peak_temperature_c", "utilization", "vram_used_ratio"} <= set(state)
    assert {"calls", "items", "running", "waiting"} <= set(state)
    status, config, _ = await post(http, sim, "/sim/config", {"error_rate": 1, "oom_above": 3})
    assert status == 200 and (config["error_rate"], config["oom_above"]) == (1.0, 3)
    assert sim.engine.config.error_rate == 1.0
    for bad in ({"port": 1}, {"slots": "x"}, {"nope": 1}, [1]):
        status, body, _ = await post(http, sim, "/sim/config", bad)
        assert status == 400, bad
        assert "error" in body
    async with http.post(sim.url + "/sim/reset") as response:
        assert (await response.json())["calls"] == 0


async def test_health_follows_the_healthy_knob(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.get(sim.url + "/health") as response:
        assert response.status == 200
    sim.configure(healthy=False)
    async with http.get(sim.url + "/health") as response:
        assert response.status == 503


async def test_unknown_paths_get_an_openai_shaped_404(
    sim: SimServer, http: aiohttp.ClientSession
) -> None:
    async with http.get(sim.url + "/v2/nothing") as response:
        body = await response.json()
    assert response.status == 404 and body["error"]["code"] == "not_found"


async def test_run_sim_prints_its_address_and_serves_until_cancelled(
    capsys: pytest.CaptureFixture[str], http: aiohttp.ClientSession
) -> None:
    task = asyncio.create_task(run_sim(SimConfig(port=0)))
    line = ""
    for _ in range(500):
        line += capsys.readouterr().out
        if line:
            break
        await asyncio.sleep(0.01)
    assert line.startswith("sim listening on http://127.0.0.1:")
    async with http.get(line.split()[-1] + "/health") as response:
        assert response.status == 200
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_stored_responses_are_bounded_the_least_recently_used_forgotten_first(
    make_sim: MakeSim, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(other_apis, "MAX_STORED", 3)
    sim = await make_sim(base_ms=0, token_ms=0)
    ask = {"model": "sim-model", "input": "hi"}
    made = [(await post(http, sim, "/v1/responses", ask))[1]["id"] for _ in range(3)]
    status, _, _ = await post(http, sim, "/v1/responses", {**ask, "previous_response_id": made[0]})
    assert status == 200  # made[0] continued: used after made[1] and made[2]; a 4th stored
    await post(http, sim, "/v1/responses", {**ask, "store": False})  # not stored
    for rid, kept in zip(made, (True, False, True), strict=True):
        async with http.get(f"{sim.url}/v1/responses/{rid}") as got:
            assert (got.status == 200) is kept, rid
            if not kept:
                assert (await got.json())["error"]["code"] == "response_not_found"


async def test_the_sim_keeps_conversations_as_the_conversations_api_does(
    make_sim: MakeSim, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Read by the official SDK: a conversation made with items, added to, answered within
    (its tokens in each answer's input, the turn added to it), listed, updated, an item
    deleted, then the conversation; bounded in items per request and in conversations."""
    monkeypatch.setattr(conversations, "MAX_CONVERSATIONS", 2)
    sim = await make_sim(base_ms=0, token_ms=0)
    async with openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="k", max_retries=0) as sdk:
        made = await sdk.conversations.create(
            items=[{"type": "message", "role": "user", "content": "hello there"}],
            metadata={"topic": "greeting"},
        )
        assert made.id.startswith("conv_") and made.metadata == {"topic": "greeting"}
        added = await sdk.conversations.items.create(
            made.id, items=[{"type": "message", "role": "user", "content": "and more"}]
        )
        assert len(added.data) == 1
        inputs = []
        for _ in range(2):
            turn = await sdk.responses.create(model="m", input="go on", conversation=made.id)
            assert turn.conversation is not None and turn.conversation.id == made.id
            assert turn.usage is not None
            inputs.append(turn.usage.input_tokens)
        assert inputs[1] > inputs[0]  # the first turn's words are part of the conversation
        listed = await sdk.conversations.items.list(made.id, order="asc")
        assert len(listed.data) == 6  # two items, then each turn's question and answer
        assert (await sdk.conversations.update(made.id, metadata={"a": "b"})).metadata == {"a": "b"}
        first = listed.data[0].id
        assert first is not None
        await sdk.conversations.items.delete(first, conversation_id=made.id)
        assert len((await sdk.conversations.items.list(made.id)).data) == 5
        with pytest.raises(openai.BadRequestError):
            await sdk.conversations.items.create(
                made.id, items=[{"type": "message", "role": "user", "content": "x"}] * 21
            )
        assert (await sdk.conversations.delete(made.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await sdk.conversations.retrieve(made.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model="m", input="x", conversation=made.id)
        kept = [(await sdk.conversations.create()).id for _ in range(3)]
        with pytest.raises(openai.NotFoundError):
            await sdk.conversations.retrieve(kept[0])  # the oldest forgotten
        assert (await sdk.conversations.retrieve(kept[2])).id == kept[2]
