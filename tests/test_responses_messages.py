"""OpenAI's Responses API (``/v1/responses``) and Anthropic's Messages API (``/v1/messages``,
``/v1/messages/count_tokens``), which vLLM and llama.cpp's server serve beside chat: their
bodies are read like chat's, so they are validated, routed on ``model``, checked against a
tenant's models, rewritten by ``target_models`` and counted per tenant, streamed or not;
Anthropic's answers are cached and shared at temperature 0 (shared in
``test_coalesce_messages.py``), the Responses API's too when the server stores nothing.  The official ``openai`` and ``anthropic``
SDKs as clients, model servers on real sockets, and llama.cpp's own server."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from gateway.cache.entry import CachedResponse
from gateway.cache.keys import cacheability
from gateway.cache.replies import hit_body, whole_stream
from gateway.errors import Overloaded
from gateway.openai.prefix import leading_key
from gateway.openai.usage import StreamUsage, from_body
from gateway.sim import SimConfig, start_sim
from gateway.testing.llama import free_port
from gateway.wire import anthropic_path, error_event
from tests.helpers import metric, scrape_when_recorded, write_policy

ACME_KEY = "acme-secret-key"
RESPONSES_USAGE = {
    "input_tokens": 11,
    "output_tokens": 3,
    "total_tokens": 14,
    "input_tokens_details": {"cached_tokens": 4},
    "output_tokens_details": {"reasoning_tokens": 0},
}
MESSAGES_USAGE = {"input_tokens": 4, "cache_read_input_tokens": 6, "output_tokens": 5}
"""Anthropic's input count leaves out the tokens read from the prompt cache: 10 in all."""


def sse(events: list[tuple[str, dict[str, Any]]]) -> bytes:
    return b"".join(
        f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events
    )


def response_object(model: str, status: str = "completed") -> dict[str, Any]:
    message = {
        "type": "message",
        "id": "msg_1",
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "ok", "annotations": []}],
    }
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "status": status,
        "model": model,
        "output": [message] if status == "completed" else [],
        "usage": RESPONSES_USAGE if status == "completed" else None,
    }


def message_object(model: str) -> dict[str, Any]:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": "ok"}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": MESSAGES_USAGE,
    }


def responses_stream(model: str) -> bytes:
    return sse(
        [
            ("response.created", {"type": "response.created", "response": response_object(model, "in_progress")}),
            ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "ok"}),
            ("response.completed", {"type": "response.completed", "response": response_object(model)}),
        ]
    )  # fmt: skip


def messages_stream(model: str) -> bytes:
    start = {**message_object(model), "content": [], "stop_reason": None}
    start["usage"] = {**MESSAGES_USAGE, "output_tokens": 1}
    return sse(
        [
            ("message_start", {"type": "message_start", "message": start}),
            ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "ok"}}),
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": {"output_tokens": 5}}),
            ("message_stop", {"type": "message_stop"}),
        ]
    )  # fmt: skip


class Server:
    """Serves both APIs with fixed usage, answering with the model it was asked for; records
    each body it got."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_post("/v1/messages", self.messages)
        app.router.add_post("/v1/messages/count_tokens", self.count_tokens)
        return app

    async def responses(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        if body.get("stream"):
            return self._stream(responses_stream(body["model"]))
        return web.json_response(response_object(body["model"]))

    async def messages(self, request: web.Request) -> web.StreamResponse:
        body = await self._read(request)
        if body.get("stream"):
            return self._stream(messages_stream(body["model"]))
        return web.json_response(message_object(body["model"]))

    async def count_tokens(self, request: web.Request) -> web.Response:
        await self._read(request)
        return web.json_response({"input_tokens": 9})

    async def _read(self, request: web.Request) -> dict[str, Any]:
        body: dict[str, Any] = await request.json()
        self.bodies.append(body)
        return body

    @staticmethod
    def _stream(data: bytes) -> web.Response:
        return web.Response(body=data, content_type="text/event-stream")


POLICY = """
backends:
  big: {{url: "{big}"}}
  small: {{url: "{small}"}}
routes:
  - match: {{path: "/v1/*", model: "big-*"}}
    backend: big
    cache: {{ttl_s: 60}}
    coalesce: true
  - match: {{path: "/v1/*", model: "alias"}}
    backend: small
    target_models: [{{model: small-v2}}]
  - {{match: {{path: "/v1/*"}}, backend: small}}
tenants:
  keys:
    - {{name: acme, sha256: {digest}, models: ["big-*", "small-*", "alias"]}}
"""


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    big, small = Server(), Server()
    urls = {"big": await serve_app(big.app()), "small": await serve_app(small.app())}
    digest = hashlib.sha256(ACME_KEY.encode()).hexdigest()
    text = POLICY.format(digest=digest, **urls)
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    return big, small, gw


def openai_sdk(gw: Any, key: str = ACME_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def anthropic_sdk(gw: Any, key: str = ACME_KEY) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, max_retries=0)


HI: Any = [{"role": "user", "content": "hi"}]


async def test_both_apis_are_routed_on_their_model(served):
    big, small, gw = served
    async with openai_sdk(gw) as client:
        raw = await client.responses.with_raw_response.create(model="big-1", input="hi")
        assert raw.headers["X-Gateway-Backend"] == "big"
        assert raw.parse().output_text == "ok"
        raw = await client.responses.with_raw_response.create(model="small-1", input=HI)
        assert raw.headers["X-Gateway-Backend"] == "small"
    async with anthropic_sdk(gw) as claude:
        got = await claude.messages.with_raw_response.create(
            model="big-2", max_tokens=8, messages=HI
        )
        assert got.headers["X-Gateway-Backend"] == "big"
        block = (await got.parse()).content[0]
        assert isinstance(block, anthropic.types.TextBlock) and block.text == "ok"
        counted = await claude.messages.count_tokens(model="small-2", messages=HI)
        assert counted.input_tokens == 9
    assert [b["model"] for b in big.bodies] == ["big-1", "big-2"]
    assert [b["model"] for b in small.bodies] == ["small-1", "small-2"]


async def test_target_models_rewrite_both_apis(served):
    _, small, gw = served
    async with openai_sdk(gw) as client:
        raw = await client.responses.with_raw_response.create(model="alias", input="hi")
    async with anthropic_sdk(gw) as claude:
        await claude.messages.create(model="alias", max_tokens=8, messages=HI)
    assert raw.headers["X-Gateway-Model"] == "small-v2"
    assert [b["model"] for b in small.bodies] == ["small-v2", "small-v2"]


async def test_a_tenant_held_to_some_models_uses_them_through_both_apis_and_no_other(served):
    big, small, gw = served
    async with anthropic_sdk(gw) as claude:
        await claude.messages.create(model="small-1", max_tokens=8, messages=HI)
        with pytest.raises(anthropic.NotFoundError) as refused:
            await claude.messages.create(model="secret-model", max_tokens=8, messages=HI)
        with pytest.raises(anthropic.NotFoundError):
            await claude.messages.count_tokens(model="secret-model", messages=HI)
    assert refused.value.status_code == 404
    assert json.loads(refused.value.response.text)["error"]["code"] == "model_not_found"
    async with openai_sdk(gw) as client:
        await client.responses.create(model="big-1", input="hi")
        with pytest.raises(openai.NotFoundError) as hidden:
            await client.responses.create(model="secret-model", input="hi")
        with pytest.raises(openai.BadRequestError) as unnamed:
            await client.post("/responses", body={"input": "hi"}, cast_to=httpx.Response)
    assert hidden.value.code == "model_not_found"
    assert unnamed.value.code == "model_required"
    assert [b["model"] for b in big.bodies + small.bodies] == ["big-1", "small-1"]


@pytest.mark.parametrize(
    ("path", "body", "says"),
    [
        ("/v1/responses", {"model": "big-1"}, "'input' is required"),
        ("/v1/responses", {"model": "big-1", "input": 3}, "'input' has the wrong type"),
        ("/v1/responses", {"model": 7, "input": "hi"}, "'model' must be a string"),
        ("/v1/messages", {"model": "big-1", "messages": []}, "non-empty list"),
        ("/v1/messages", {"model": "big-1", "messages": ["hi"]}, "non-empty list"),
        ("/v1/messages/count_tokens", {"model": "big-1"}, "'messages' is required"),
        ("/v1/messages", {"model": "big-1", "messages": HI, "stream": "yes"}, "boolean"),
    ],
)
async def test_a_malformed_body_is_a_400_that_never_reaches_a_backend(served, path, body, says):
    big, small, gw = served
    async with httpx.AsyncClient() as client:
        reply = await client.post(gw.url + path, json=body)
        broken = await client.post(
            gw.url + path, content=b'{"model": "big-1", "input": [', headers=JSON
        )
    assert reply.status_code == 400
    assert says in reply.json()["error"]["message"]
    assert broken.status_code == 400
    assert big.bodies == small.bodies == []


JSON = {"content-type": "application/json"}


async def test_a_responses_answer_is_cached_only_when_the_server_stores_nothing(served):
    """A response the server stores is its own under its id (and a continuation reads what
    it stored): never served from the cache.  With ``store: false`` at temperature 0 the
    answer is cached as Anthropic's is, a whole answer and a stream apart, the stream
    replayed byte for byte, and the fields it echoes (``metadata``) in its key; a
    continuation, a hosted tool or a remote image is never cached."""
    big, _, gw = served
    stored = {"model": "big-1", "input": "hi", "temperature": 0}
    ask = {**stored, "store": False}
    seen: list[tuple[str, bytes]] = []
    async with httpx.AsyncClient() as client:
        for body in (
            stored,
            stored,
            ask,
            ask,
            {**ask, "stream": True},
            {**ask, "stream": True},
            {**ask, "metadata": {"order": "7"}},
            {**ask, "tools": [{"type": "web_search"}]},
            {**ask, "previous_response_id": "resp_1"},
            {**ask, "temperature": 1},
        ):
            reply = await client.post(gw.url + "/v1/responses", json=body)
            assert reply.status_code == 200
            seen.append((reply.headers["X-Gateway-Cache"], reply.content))
    assert [cache for cache, _ in seen] == [
        *("bypass", "bypass", "miss", "hit", "miss", "hit", "miss"),
        *("bypass", "bypass", "bypass"),
    ]
    assert seen[3][1] == seen[2][1] and json.loads(seen[3][1])["object"] == "response"
    assert seen[5][1] == seen[4][1] == responses_stream("big-1")
    assert len(big.bodies) == 8  # all but the two hits
    assert not cacheability(stored, "/v1/responses").ok
    image = {"type": "input_image", "image_url": "https://example.com/cat.png"}
    remote = {**ask, "input": [{"role": "user", "content": [image]}]}
    assert cacheability(ask, "/v1/responses").ok and not cacheability(remote, "/v1/responses").ok
    assert not cacheability({**ask, "background": True}, "/v1/responses").ok
    assert not cacheability({**ask, "prompt": {"id": "pmpt_1"}}, "/v1/responses").ok
    function = {"type": "function", "name": "f", "parameters": {}}
    assert cacheability({**ask, "tools": [function]}, "/v1/responses").ok


async def test_anthropic_answers_at_temperature_0_are_cached_in_the_shape_asked(served):
    """A whole answer, and a stream replayed byte for byte, each under a key of its own;
    Anthropic's version and beta headers are in the key; without temperature 0 nothing is
    cached; the tokens of a hit are the cache's, not the backend's."""
    big, _, gw = served
    ask = {"model": "big-1", "messages": HI, "max_tokens": 8, "temperature": 0}
    acme = {"Authorization": f"Bearer {ACME_KEY}"}
    seen: list[tuple[str, bytes]] = []
    async with httpx.AsyncClient(headers=acme) as client:
        for body, extra in (
            (ask, {}),
            (ask, {}),
            ({**ask, "stream": True}, {}),
            ({**ask, "stream": True}, {}),
            (ask, {"anthropic-beta": "some-feature-2026-01-01"}),
            ({**ask, "temperature": 1}, {}),
        ):
            reply = await client.post(gw.url + "/v1/messages", json=body, headers=extra)
            assert reply.status_code == 200
            seen.append((reply.headers["X-Gateway-Cache"], reply.content))
    assert [cache for cache, _ in seen] == ["miss", "hit", "miss", "hit", "miss", "bypass"]
    assert seen[1][1] == seen[0][1] and json.loads(seen[1][1])["type"] == "message"
    assert seen[3][1] == seen[2][1] == messages_stream("big-1")  # replayed as it came
    assert len(big.bodies) == 4
    async with anthropic_sdk(gw) as claude:  # its own anthropic-version: its own key
        for _ in range(2):
            async with claude.messages.stream(
                model="big-1", max_tokens=8, messages=HI, extra_body={"temperature": 0}
            ) as stream:
                assert await stream.get_final_text() == "ok"
    assert len(big.bodies) == 5  # the second, replayed, read by the SDK as the first
    text = await scrape_when_recorded(gw.admin_url, 8)
    assert (
        metric(text, "gateway_tenant_tokens_total", tenant="acme", kind="prompt", source="cache")
        == 30
    )
    assert cacheability(ask, "/v1/messages").ok
    assert not cacheability({**ask, "temperature": None}, "/v1/messages").ok


async def test_a_reworded_anthropic_question_hits_the_near_duplicate_tier(
    serve_app, start_gateway, tmp_path
):
    """Its ``system`` prompt is part of the context, as chat's system message is; a number
    that differs is still a miss, and a stream never answers from a whole answer."""
    server = Server()
    url = await serve_app(server.app())
    text = (
        f"backends: {{m: {{url: '{url}'}}}}\n"
        "routes: [{backend: m, cache: {ttl_s: 60, semantic: {method: simhash}}}]\n"
    )
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    base = {"model": "m", "max_tokens": 8, "temperature": 0, "system": "Be brief."}

    def ask(question: str, **extra: Any) -> dict[str, Any]:
        return {**base, "messages": [{"role": "user", "content": question}], **extra}

    asked = [
        ask("How many GPUs does the cluster have in rack 12?"),
        ask("how many gpus does the cluster have in rack 12"),
        ask("How many GPUs does the cluster have in rack 13?"),
        ask("how many gpus does the cluster have in rack 12", system="Be verbose."),
        ask("how many gpus does the cluster have in rack 12", stream=True),
    ]
    seen = []
    async with httpx.AsyncClient() as client:
        for body in asked:
            reply = await client.post(gw.url + "/v1/messages", json=body)
            seen.append(
                (reply.headers["X-Gateway-Cache"], reply.headers.get("X-Gateway-Cache-Match"))
            )
    assert seen == [
        ("miss", None),
        ("hit", "simhash"),
        ("miss", None),
        ("miss", None),
        ("miss", None),
    ]
    assert len(server.bodies) == 4
    async with httpx.AsyncClient() as client:  # another beta feature: another answer
        beta = await client.post(
            gw.url + "/v1/messages",
            json=asked[1],
            headers={"anthropic-beta": "some-feature-2026-01-01"},
        )
    assert beta.headers["X-Gateway-Cache"] == "miss" and len(server.bodies) == 5


async def test_an_anthropic_stream_that_failed_or_was_cut_is_never_stored(
    serve_app, start_gateway, tmp_path
):
    """A stream that carries an ``error`` event (an overloaded server, mid-answer, under a
    200) or that never reached ``message_stop`` is relayed, and not stored."""
    whole = messages_stream("m")
    failed = whole.split(b"event: content_block_stop")[0] + sse(
        [("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]
    )
    cut = whole.split(b"event: message_stop")[0]
    answers = [failed, cut, whole]
    asked = 0

    async def messages(request: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.Response(body=answers[min(asked, 3) - 1], content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/v1/messages", messages)
    url = await serve_app(app)
    text = f"backends: {{m: {{url: '{url}'}}}}\nroutes: [{{backend: m, cache: {{ttl_s: 60}}}}]\n"
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    ask = {"model": "m", "messages": HI, "max_tokens": 8, "temperature": 0, "stream": True}
    cached = []
    async with httpx.AsyncClient() as client:
        for _ in range(5):
            reply = await client.post(gw.url + "/v1/messages", json=ask)
            cached.append(reply.headers["X-Gateway-Cache"])
    assert cached == ["miss", "miss", "miss", "hit", "hit"]
    assert asked == 3


async def test_each_apis_tokens_are_counted_for_the_tenant_streamed_or_not(served):
    _, _, gw = served
    async with openai_sdk(gw) as client:
        await client.responses.create(model="big-1", input="hi")
        async for _ in await client.responses.create(model="big-1", input="hi", stream=True):
            pass
    async with anthropic_sdk(gw) as claude:
        await claude.messages.create(model="small-1", max_tokens=8, messages=HI)
        async with claude.messages.stream(model="small-1", max_tokens=8, messages=HI) as s:
            assert (await s.get_final_message()).usage.output_tokens == 5
    text = await scrape_when_recorded(gw.admin_url, 4)

    def tokens(backend: str, kind: str) -> float | None:
        return metric(text, "gateway_tokens_total", backend=backend, kind=kind)

    # the Responses API: 11 in, 3 out, twice; Anthropic's: 4 + 6 cached in, 5 out, twice
    assert (tokens("big", "prompt"), tokens("big", "completion")) == (22, 6)
    assert (tokens("small", "prompt"), tokens("small", "completion")) == (20, 10)
    got = metric(
        text, "gateway_tenant_tokens_total", tenant="acme", kind="prompt", source="backend"
    )
    assert got == 42


def test_usage_is_read_in_all_three_shapes():
    assert from_body(json.dumps(response_object("m")).encode()) == (11, 3)
    assert from_body(json.dumps(message_object("m")).encode()) == (10, 5)
    created = {"cache_creation_input_tokens": 2, "input_tokens": 1, "output_tokens": 0}
    assert from_body(json.dumps({"usage": created}).encode()) == (3, 0)
    assert from_body(json.dumps({**response_object("m", "failed")}).encode()) is None
    chat = {"usage": {"prompt_tokens": 3, "completion_tokens": 4, "input_tokens": 99}}
    assert from_body(json.dumps(chat).encode()) == (3, 4)


@pytest.mark.parametrize("size", [1, 7, 61, 100_000])
def test_stream_usage_is_read_however_the_events_are_split(size):
    for stream, counts in ((responses_stream("m"), (11, 3)), (messages_stream("m"), (10, 5))):
        usage = StreamUsage()
        for at in range(0, len(stream), size):
            usage.feed(stream[at : at + size])
        assert usage.counts == counts


def test_instructions_are_the_leading_context_of_both_apis():
    system = "You are a careful assistant."
    first = {"model": "m", "system": system, "messages": [{"role": "user", "content": "a"}]}
    later = {"model": "m", "system": system, "messages": [{"role": "user", "content": "b"}]}
    assert leading_key(first) == leading_key(later) != leading_key({**later, "system": "other"})
    one = {"model": "m", "instructions": system, "input": "a"}
    assert leading_key(one) == leading_key({**one, "input": [{"role": "user", "content": "b"}]})
    turns = [{"role": "developer", "content": system}, {"role": "user", "content": "a"}]
    other = [turns[0], {"role": "user", "content": "b"}]
    assert leading_key({"model": "m", "input": turns}) == leading_key(
        {"model": "m", "input": other}
    )
    assert leading_key({"model": "m", "input": ["an", "embedding"]}) is None


LLAMA_POLICY = """
backends: {{main: {{url: "{url}"}}}}
routes:
  - {{match: {{path: "/v1/*"}}, backend: main}}
"""


@pytest.mark.llm
async def test_llama_cpps_responses_and_messages_through_the_gateway(
    llama, start_gateway, tmp_path
):
    """llama.cpp's server answers both APIs; through the gateway the SDKs get its answers,
    and the tokens counted are the ones it reports, streamed or not."""
    gw = await start_gateway(policy=write_policy(tmp_path, LLAMA_POLICY.format(url=llama.url)))
    async with openai_sdk(gw, "k") as client:
        whole = await client.responses.create(
            model="gemma", input="Count to three", max_output_tokens=6
        )
        completed = None
        stream = await client.responses.create(
            model="gemma", input="Count to four", max_output_tokens=6, stream=True
        )
        async for event in stream:
            if event.type == "response.completed":
                completed = event.response
    async with anthropic_sdk(gw, "k") as claude:
        message = await claude.messages.create(model="gemma", max_tokens=6, messages=HI)
        async with claude.messages.stream(model="gemma", max_tokens=6, messages=HI) as s:
            streamed = await s.get_final_message()
    assert whole.usage is not None and completed is not None and completed.usage is not None
    assert whole.output_text and message.content[0].type == "text"

    def anthropic_input(usage: Any) -> int:
        return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))

    prompt = (
        whole.usage.input_tokens
        + completed.usage.input_tokens
        + anthropic_input(message.usage)
        + anthropic_input(streamed.usage)
    )
    completion = (
        whole.usage.output_tokens
        + completed.usage.output_tokens
        + message.usage.output_tokens
        + streamed.usage.output_tokens
    )
    text = await scrape_when_recorded(gw.admin_url, 4)
    counted = (
        metric(text, "gateway_tokens_total", backend="main", kind="prompt"),
        metric(text, "gateway_tokens_total", backend="main", kind="completion"),
    )
    assert counted == (prompt, completion)


@pytest.fixture
async def sim() -> Any:
    server = await start_sim(SimConfig(port=0, base_ms=0, token_ms=0, answer_tokens=5))
    yield server
    await server.close()


async def test_the_sim_answers_both_apis_as_the_sdks_read_them(sim, start_gateway, tmp_path):
    """``gateway sim`` serves both APIs, whole and streamed: the SDKs read its answers
    directly and through the gateway alike, and the gateway counts the usage it reports."""
    gw = await start_gateway(policy=write_policy(tmp_path, LLAMA_POLICY.format(url=sim.url)))
    ask: Any = {"model": "sim-model", "max_tokens": 8, "system": "Be brief.", "messages": HI}
    texts = []
    for base in (sim.url, gw.url):
        async with openai_sdk_at(base) as client:
            whole = await client.responses.create(model="sim-model", input="why", instructions="x")
            done = None
            async for event in await client.responses.create(
                model="sim-model", input=HI, stream=True
            ):
                if event.type == "response.completed":
                    done = event.response
        async with anthropic.AsyncAnthropic(base_url=base, api_key="k", max_retries=0) as claude:
            message = await claude.messages.create(**ask)
            async with claude.messages.stream(**ask) as stream:
                streamed = await stream.get_final_message()
            counted = await claude.messages.count_tokens(model="sim-model", messages=HI)
        assert done is not None and done.usage is not None and whole.usage is not None
        assert (whole.usage.input_tokens, whole.usage.output_tokens) == (2, 5)
        assert message.usage.input_tokens == streamed.usage.input_tokens == 3
        assert streamed.usage.output_tokens == 5 and counted.input_tokens == 1
        texts.append((whole.output_text, done.output_text, message.content, streamed.content))
    assert texts[0] == texts[1]
    text = await scrape_when_recorded(gw.admin_url, 5)
    prompt = metric(text, "gateway_tokens_total", backend="main", kind="prompt")
    completion = metric(text, "gateway_tokens_total", backend="main", kind="completion")
    assert (prompt, completion) == (2 + 1 + 3 + 3, 4 * 5)


def openai_sdk_at(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="k", max_retries=0)


def test_a_client_cannot_hide_its_tokens_behind_echoed_fields():
    """The Responses API echoes the client's ``user`` and ``metadata`` after its ``usage``:
    a client naming itself ``"usage"`` is still counted, by the answer's own counts."""
    answer = response_object("m")
    answer["user"] = "usage"
    answer["metadata"] = {"usage": "input_tokens", "input_tokens": "0"}
    assert from_body(json.dumps(answer).encode()) == (11, 3)
    answer["usage"] = None
    assert from_body(json.dumps(answer).encode()) is None


async def test_the_gateways_own_errors_on_anthropics_api_are_in_its_shape(
    served, start_gateway, tmp_path
):
    """Anthropic's SDK and its clients (Claude Code among them) read an error's ``type``
    (``rate_limit_error``, ``overloaded_error``...) from Anthropic's shape; what the gateway
    itself answers on ``/v1/messages`` is in that shape, with its own ``code`` beside, while
    chat's stay OpenAI's."""
    *_, gw = served
    async with anthropic_sdk(gw) as claude:
        with pytest.raises(anthropic.NotFoundError) as hidden:
            await claude.messages.create(model="secret-model", max_tokens=8, messages=HI)
        with pytest.raises(anthropic.BadRequestError) as malformed:
            await claude.messages.count_tokens(model="small-1", messages=[])
    body: Any = hidden.value.body
    assert body["type"] == "error" and "secret-model" in body["error"]["message"]
    assert body["error"]["type"] == "not_found_error"
    assert body["error"]["code"] == "model_not_found"
    assert malformed.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    async with httpx.AsyncClient() as client:
        chat = await client.post(
            gw.url + "/v1/chat/completions",
            json={"model": "secret-model", "messages": HI},
            headers={"Authorization": f"Bearer {ACME_KEY}"},
        )
    assert chat.status_code == 404 and "type" not in chat.json()
    assert chat.json()["error"]["type"] == "invalid_request_error"

    text = (
        f"backends: {{small: {{url: 'http://127.0.0.1:{free_port()}'}}}}\n"
        "routes: [{backend: small, rate_limit: {requests_per_s: 0.01, burst: 1}}]\n"
    )
    down = await start_gateway(policy=write_policy(tmp_path, text, "down.yaml"))
    async with anthropic_sdk(down) as claude:
        with pytest.raises(anthropic.APIStatusError) as unreachable:
            await claude.messages.create(model="m", max_tokens=8, messages=HI)
        with pytest.raises(anthropic.RateLimitError) as limited:
            await claude.messages.create(model="m", max_tokens=8, messages=HI)
    assert unreachable.value.status_code == 502
    assert unreachable.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert limited.value.body["error"]["type"] == "rate_limit_error"  # type: ignore[index]
    assert limited.value.response.headers["Retry-After"]


def test_an_error_ending_a_stream_is_an_event_of_the_streams_api():
    busy = Overloaded("the gateway shut down", retry_after_s=1.0, reason="shutdown")
    event = error_event(busy, "/v1/messages")
    assert event.startswith(b"event: error\ndata: ") and event.endswith(b"\n\n")
    assert json.loads(event.split(b"data: ")[1])["error"]["type"] == "overloaded_error"
    assert error_event(busy, "/v1/chat/completions").startswith(b'data: {"error": ')
    assert [anthropic_path(p) for p in ("/v1/messages/count_tokens", "/v1/messagesx", "/")] == [
        True,
        False,
        False,
    ]


def test_an_answer_stored_as_sent_is_replayed_in_its_own_shape_only():
    """The keys keep a stream and a whole answer of Anthropic's apart; were they ever to
    meet, the answer is a miss, never one converted to chat's shape."""
    whole = message_object("m")
    stored = CachedResponse(
        200,
        (("Content-Type", "application/json"),),
        json.dumps(whole).encode(),
        None,
        0,
        "m",
        "",
        "r",
        "s",
    )
    streamed = CachedResponse(
        200,
        (("Content-Type", "text/event-stream"),),
        messages_stream("m"),
        None,
        0,
        "m",
        "",
        "r",
        "s",
    )
    assert hit_body(stored, streaming=False, include_usage=False, as_sent=True)[0] == stored.body
    assert hit_body(streamed, streaming=True, include_usage=False, as_sent=True)[0] == streamed.body
    for entry, streaming in ((stored, True), (streamed, False)):
        with pytest.raises(ValueError):
            hit_body(entry, streaming=streaming, include_usage=False, as_sent=True)


@pytest.mark.parametrize(
    ("last", "stored"),
    [
        ("response.completed", True),
        ("response.incomplete", True),  # cut at max_output_tokens: as deterministic
        ("response.failed", False),
        ("error", False),
        ("response.output_text.delta", False),  # cut off before its end
    ],
)
async def test_a_responses_stream_is_stored_only_once_it_ended_well(last, stored):
    kept: list[bytes | None] = []
    refused: list[str] = []

    async def put(events: tuple[str, ...] | None, body: bytes | None) -> None:
        kept.append(body)

    head = responses_stream("m").split(b"event: response.completed")[0]
    body = head + f"event: {last}\ndata: {{}}\n\n".encode()
    await whole_stream(put, "/v1/responses", refused.append)(None, body)
    assert kept == ([body] if stored else [])
    assert refused == ([] if stored else ["unfinished"])
