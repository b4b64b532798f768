"""A route's ``context_fallback``: a call its backend refuses as too long for the model's
context goes to a backend with a longer one.  The refusals of llama.cpp, OpenAI, vLLM, TGI,
SGLang and Anthropic are told apart from every other 4xx, a streamed refusal too; a
refusal that is not about the context, or too long to read, reaches the client as it came.
Against two real llama.cpp servers with different contexts as well."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from gateway.pipeline import Reply
from gateway.resilience.context import MAX_ERROR_BYTES, overflowed
from gateway.testing import Sent, json_reply
from tests.helpers import chat, problems_of

SMALL, BIG = "http://small.test", "http://big.test"
CHAT = "/v1/chat/completions"
JSON = (("Content-Type", "application/json"),)

LLAMA_CPP = {
    "error": {
        "code": 400,
        "message": "the request exceeds the available context size, try increasing it",
        "type": "exceed_context_size_error",
        "n_prompt_tokens": 1102,
        "n_ctx": 1024,
    }
}
REFUSALS = {
    "llama.cpp": LLAMA_CPP,
    "openai": {
        "error": {
            "message": "This model's maximum context length is 8192 tokens. However, your "
            "messages resulted in 9000 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    },
    "vllm (flat)": {
        "object": "error",
        "message": "This model's maximum context length is 2048 tokens. However, you "
        "requested 3000 tokens (2000 in the messages, 1000 in the completion).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    },
    "vllm (nested)": {
        "error": {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 4000. This "
            "model's maximum context length is 4096 tokens and your request has 300 input "
            "tokens (4000 > 4096 - 300).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    },
    "tgi": {
        "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. "
        "Given: 4000 `inputs` tokens and 500 `max_new_tokens`",
        "error_type": "validation",
    },
    "sglang": {
        "object": "error",
        "message": "The input (5000 tokens) is longer than the model's context length "
        "(4096 tokens).",
        "type": "BadRequestError",
        "code": 400,
    },
    "anthropic": {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 210000 tokens > 200000 maximum",
        },
    },
}
OTHER_400S = [
    {"error": {"message": "Invalid 'temperature': 3", "type": "invalid_request_error"}},
    {"error": {"message": "model 'x' not found", "code": "model_not_found"}},
    {"error": "Input validation error: `temperature` must be strictly positive"},
    ["context length"],
]


@pytest.mark.parametrize("body", REFUSALS.values(), ids=REFUSALS.keys())
def test_each_servers_refusal_for_a_context_exceeded_is_recognised(body):
    assert overflowed(json.dumps(body).encode())


@pytest.mark.parametrize("body", OTHER_400S)
def test_other_refusals_are_not(body):
    assert not overflowed(json.dumps(body).encode())
    assert not overflowed(b"the context length was exceeded")  # not JSON: not read


class Server:
    """A model server whose context holds ``limit`` characters of prompt: a longer one is
    refused with ``refusal`` (400), as a stream when the call streams and ``streams``."""

    def __init__(self, name: str, limit: int, refusal: Any = LLAMA_CPP, streams: bool = False):
        self.name, self.limit, self.refusal, self.streams = name, limit, refusal, streams
        self.calls = 0

    async def __call__(self, sent: Sent) -> Reply:
        self.calls += 1
        data = sent.json()
        if len(data["messages"][-1]["content"]) > self.limit:
            body = json.dumps(self.refusal).encode()
            if self.streams and data.get("stream"):
                return Reply(400, JSON, stream=_pieces(body))
            return Reply(400, JSON, body=body)
        message = {"role": "assistant", "content": f"{self.name} answers"}
        return json_reply({"object": "chat.completion", "choices": [{"message": message}]})


async def _pieces(body: bytes) -> AsyncIterator[bytes]:
    for at in range(0, len(body), 7):
        yield body[at : at + 7]


def policy(**route: Any) -> dict[str, Any]:
    backends = {"small": {"url": SMALL}, "big": {"url": BIG}}
    return {
        "backends": backends,
        "routes": [{"name": "chat", "match": {"path": "/v1/*"}, "backend": "small", **route}],
    }


async def rig(pipeline: Any, small: Server, **route: Any) -> tuple[Any, Server]:
    big = Server("big", 10_000)
    gw = await pipeline(policy(context_fallback=["big"], **route), {"small": small, "big": big})
    return gw, big


async def test_a_call_too_long_for_the_context_goes_to_the_longer_one(pipeline):
    small = Server("small", 10)
    gw, big = await rig(pipeline, small)
    answer = await gw.post(CHAT, chat("a question longer than ten characters"))
    assert answer.status_code == 200
    assert json.loads(answer.body)["choices"][0]["message"]["content"] == "big answers"
    assert answer.headers["X-Gateway-Backend"] == "big"
    assert answer.headers["X-Gateway-Fallback"] == "context_length"
    assert gw.metric("gateway_fallbacks_total", route="chat", reason="context_length") == 1
    short = await gw.post(CHAT, chat("short"))
    assert short.headers["X-Gateway-Backend"] == "small"
    assert (small.calls, big.calls) == (2, 1)


async def test_a_streamed_refusal_is_read_and_the_stream_goes_to_the_longer_one(pipeline):
    small = Server("small", 10, streams=True)
    gw, big = await rig(pipeline, small)
    answer = await gw.post(CHAT, chat("a question longer than ten characters", stream=True))
    assert answer.status_code == 200 and answer.headers["X-Gateway-Backend"] == "big"
    assert big.calls == 1


@pytest.mark.parametrize("refusal", OTHER_400S[:3])
async def test_another_refusal_reaches_the_client_as_it_came(pipeline, refusal):
    small = Server("small", 10, refusal=refusal, streams=True)
    gw, big = await rig(pipeline, small)
    for streamed in (False, True):
        answer = await gw.post(CHAT, chat("longer than ten characters", stream=streamed))
        assert (answer.status_code, json.loads(answer.body)) == (400, refusal)
    assert big.calls == 0


async def test_a_refusal_too_long_to_read_passes_byte_for_byte(pipeline):
    long = {"error": {"message": "context length " + "x" * MAX_ERROR_BYTES}}
    small = Server("small", 10, refusal=long, streams=True)
    gw, big = await rig(pipeline, small)
    answer = await gw.post(CHAT, chat("longer than ten characters", stream=True))
    assert (answer.status_code, answer.body) == (400, json.dumps(long).encode())
    assert big.calls == 0


async def test_without_context_fallback_the_refusal_is_the_answer(pipeline):
    small, big = Server("small", 10), Server("big", 10_000)
    gw = await pipeline(policy(fallback=["big"]), {"small": small, "big": big})
    answer = await gw.post(CHAT, chat("longer than ten characters"))
    assert (answer.status_code, json.loads(answer.body)) == (400, LLAMA_CPP)
    assert big.calls == 0  # a 400 is the client's: the ordinary fallback does not take it


async def test_when_every_context_is_too_short_the_last_refusal_is_the_answer(pipeline):
    small, big = Server("small", 10), Server("big", 20)
    gw = await pipeline(policy(context_fallback=["big"]), {"small": small, "big": big})
    answer = await gw.post(CHAT, chat("x" * 30))
    assert answer.status_code == 400 and answer.headers["X-Gateway-Backend"] == "big"
    assert (small.calls, big.calls) == (1, 1)


@pytest.mark.parametrize(
    ("context_fallback", "problem"),
    [
        (["nope"], "context_fallback[0]: unknown backend 'nope'"),
        (["small"], "context_fallback[0]: the primary backend cannot be its own fallback"),
    ],
)
def test_the_policy_refuses_a_context_fallback_that_cannot_serve(context_fallback, problem):
    text = json.dumps(policy(context_fallback=context_fallback))
    assert any(problem in p for p in problems_of(text)), problems_of(text)


@pytest.mark.llm
async def test_llama_cpp_refusing_a_long_prompt_is_served_by_a_longer_context(
    llama, start_gateway, tmp_path
):
    """Two real servers (llama.cpp, Gemma 3 270M): one slot of 256 tokens, and the session's
    longer one.  A prompt of about 400 tokens is refused by the first directly, and answered
    through the gateway by the second."""
    import asyncio

    from gateway.testing.llama import LlamaOptions, start_servers, stop_all
    from tests.helpers import write_policy
    from tests.llama import chat as llama_chat

    short = await asyncio.to_thread(
        start_servers, 1, LlamaOptions(slots=1, context_tokens_per_slot=256, threads=1)
    )
    try:
        route = {"backend": "short", "context_fallback": ["long"]}
        backends = {"short": {"url": short[0].url}, "long": {"url": llama.url}}
        path = write_policy(tmp_path, {"backends": backends, "routes": [route]})
        gw = await start_gateway(policy=path)
        body = llama_chat("word " * 400, max_tokens=2)
        async with httpx.AsyncClient(timeout=120) as http:
            direct = await http.post(short[0].url + CHAT, json=body)
            via = await http.post(gw.url + CHAT, json=body)
    finally:
        await asyncio.to_thread(stop_all, short)
    assert direct.status_code == 400 and overflowed(direct.content)
    assert via.status_code == 200, via.text
    assert via.headers["X-Gateway-Backend"] == "long"
    assert via.headers["X-Gateway-Fallback"] == "context_length"
