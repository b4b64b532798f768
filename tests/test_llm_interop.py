"""A real generating model behind the gateway: llama.cpp's server with Gemma 3 270M.  Each
answer through the gateway (the openai SDK as the client) is the answer the server gives
directly: chat and completions, plain and streamed with ``stream_options.include_usage``,
``n`` choices and a request's ``tools``, token for token with the same ``usage`` (a fixed
seed, temperature 0); the gateway counts the tokens the server's ``usage`` and ``timings``
report; the quality fallback weighs the server's own logprobs; its errors (a prompt over
the context, a bad parameter) reach the client byte for byte."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from gateway.resilience.quality import mean_logprob
from gateway.testing.llama import MODEL_ALIAS, LlamaServer
from tests.helpers import metric, write_policy
from tests.llama import chat

pytestmark = pytest.mark.llm

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="sk-none", max_retries=0)


def sdk(body: dict[str, Any]) -> dict[str, Any]:
    """A request body as the SDK's arguments: llama.cpp's own fields in ``extra_body``."""
    own = {"cache_prompt", "ignore_eos"}
    return {
        **{k: v for k, v in body.items() if k not in own},
        "extra_body": {k: v for k, v in body.items() if k in own},
    }


def answer(completion: Any) -> dict[str, Any]:
    """What must be equal: every choice's text and end, and the token counts."""
    choices = [
        (c.index, c.finish_reason, c.message.content if hasattr(c, "message") else c.text)
        for c in completion.choices
    ]
    usage = completion.usage
    return {"choices": choices, "usage": (usage.prompt_tokens, usage.completion_tokens)}


async def both(llama: LlamaServer, gateway_url: str, call: Any) -> tuple[Any, Any]:
    """``call(client)`` straight at the server, then through the gateway."""
    async with client(llama.url) as direct, client(gateway_url) as via:
        return await call(direct), await call(via)


async def test_chat_and_completions_through_the_gateway_equal_the_server_directly(
    llama, start_gateway
):
    gw = await start_gateway(upstream=llama.url)

    async def calls(c: openai.AsyncOpenAI) -> list[dict[str, Any]]:
        body = chat("The capital of France is", max_tokens=6)
        chat_answer = await c.chat.completions.create(**sdk(body))
        completion = await c.completions.create(
            model=MODEL_ALIAS,
            prompt="The capital of France is",
            max_tokens=6,
            temperature=0,
            extra_body={"cache_prompt": False},
        )
        return [answer(chat_answer), answer(completion), chat_answer.model_extra["timings"]]

    direct, via = await both(llama, gw.url, calls)
    assert via[:2] == direct[:2]
    assert via[0]["usage"][1] == 6 and via[0]["choices"][0][1] == "length"
    assert via[2]["predicted_n"] == 6  # llama.cpp's own timings pass through


async def test_streams_carry_the_same_tokens_and_the_usage_chunk(llama, start_gateway):
    gw = await start_gateway(upstream=llama.url)

    async def stream(c: openai.AsyncOpenAI) -> tuple[list[str], tuple[int, int], str | None]:
        events = await c.chat.completions.create(
            **sdk(chat("Count: one, two,", max_tokens=5)),
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces, usage, finish = [], (0, 0), None
        async for event in events:
            if event.choices:
                pieces.append(event.choices[0].delta.content or "")
                finish = event.choices[0].finish_reason or finish
            if event.usage is not None:
                usage = (event.usage.prompt_tokens, event.usage.completion_tokens)
        return pieces, usage, finish

    direct, via = await both(llama, gw.url, stream)
    assert via == direct
    assert via[1][1] == 5 and via[2] == "length"


async def test_n_choices_and_tools_pass_through(llama, start_gateway):
    """``n: 2`` gives two choices; ``tools`` reach the server's chat format (the test
    template names each tool in a system turn), so the prompt grows by the same tokens."""
    gw = await start_gateway(upstream=llama.url)

    async def calls(c: openai.AsyncOpenAI) -> list[dict[str, Any]]:
        two = await c.chat.completions.create(**sdk(chat("Hello", max_tokens=3, n=2)))
        plain = await c.chat.completions.create(**sdk(chat("Weather in Paris?", max_tokens=3)))
        tooled = await c.chat.completions.create(
            **sdk(chat("Weather in Paris?", max_tokens=3, tools=[WEATHER_TOOL], tool_choice="auto"))
        )
        return [answer(two), answer(plain), answer(tooled)]

    direct, via = await both(llama, gw.url, calls)
    assert via == direct
    assert len(via[0]["choices"]) == 2
    assert via[2]["usage"][0] > via[1]["usage"][0]  # the tool's name is in the prompt


async def test_token_metrics_come_from_the_servers_usage_and_timings(llama, start_gateway):
    """``gateway_tokens_total`` adds up the server's ``usage``, plain and streamed; the
    server's own ``timings`` say the same (prompt tokens computed plus reused, tokens
    predicted)."""
    gw = await start_gateway(upstream=llama.url)
    async with httpx.AsyncClient(timeout=60) as http:
        plain = (await http.post(gw.url + "/v1/chat/completions", json=chat("Hi there"))).json()
        streamed = await http.post(
            gw.url + "/v1/chat/completions",
            json={**chat("Hi again"), "stream": True, "stream_options": {"include_usage": True}},
        )
        metrics = (await http.get(gw.admin_url + "/metrics")).text
    last = [line for line in streamed.text.splitlines() if '"usage"' in line][-1]
    usage_event = httpx.Response(200, content=last.removeprefix("data: ")).json()
    prompt = completion = 0
    for body in (plain, usage_event):
        usage, timings = body["usage"], body["timings"]
        assert usage["prompt_tokens"] == timings["prompt_n"] + timings["cache_n"]
        assert usage["completion_tokens"] == timings["predicted_n"]
        prompt += usage["prompt_tokens"]
        completion += usage["completion_tokens"]
    counted = {
        kind: metric(metrics, "gateway_tokens_total", backend="upstream", kind=kind)
        for kind in ("prompt", "completion")
    }
    assert counted == {"prompt": prompt, "completion": completion}


LONG_PROMPT = "word " * 1100
"""Past a slot's 1,024 tokens of context."""
ERRORS = [
    ("/v1/completions", {"model": MODEL_ALIAS, "prompt": LONG_PROMPT, "max_tokens": 2}),
    ("/v1/chat/completions", {**chat(LONG_PROMPT), "stream": True}),
    (
        "/v1/chat/completions",
        chat(
            "Hi",
            response_format={"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}},
        ),
    ),
]


@pytest.mark.parametrize(("path", "body"), ERRORS, ids=["overflow", "overflow-stream", "schema"])
async def test_the_servers_errors_reach_the_client_untouched(llama, start_gateway, path, body):
    gw = await start_gateway(upstream=llama.url)
    async with httpx.AsyncClient(timeout=60) as http:
        direct = await http.post(llama.url + path, json=body)
        via = await http.post(gw.url + path, json=body)
    assert direct.status_code == 400
    assert (via.status_code, via.content) == (direct.status_code, direct.content)
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.json()["error"]["type"] in ("exceed_context_size_error", "invalid_request_error")


async def test_the_quality_fallback_weighs_the_servers_real_logprobs(
    llama, start_gateway, tmp_path
):
    """The answer's mean token logprob, as the server reports it, decides: a route whose
    threshold is over it sends the call to the fallback (``low_confidence``), one under it
    keeps the primary's answer; the logprobs the gateway asked for are stripped."""
    body = chat("The capital of France is", max_tokens=4)
    async with httpx.AsyncClient(timeout=60) as http:
        direct = (await http.post(llama.url + "/v1/chat/completions", json=body)).json()
        weighed = await http.post(
            llama.url + "/v1/chat/completions", json={**body, "logprobs": True}
        )
    mean = mean_logprob(weighed.json())
    assert mean is not None and mean < 0
    route: dict[str, Any] = {"match": {"path": "/v1/chat/completions"}, "backend": "primary"}
    policy = write_policy(
        tmp_path,
        {
            "backends": {"primary": {"url": llama.url}, "backup": {"url": llama.url}},
            "routes": [
                {
                    **route,
                    "match": {**route["match"], "model": "strict"},
                    "fallback": ["backup"],
                    "quality": {"min_mean_logprob": mean + 0.5},
                },
                {**route, "fallback": ["backup"], "quality": {"min_mean_logprob": mean - 0.5}},
            ],
        },
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient(timeout=60) as http:
        strict = await http.post(gw.url + "/v1/chat/completions", json={**body, "model": "strict"})
        lenient = await http.post(gw.url + "/v1/chat/completions", json=body)
    assert strict.headers["X-Gateway-Backend"] == "backup"
    assert strict.headers["X-Gateway-Fallback"] == "low_confidence"
    assert lenient.headers["X-Gateway-Backend"] == "primary"
    assert "X-Gateway-Fallback" not in lenient.headers
    for reply in (strict, lenient):
        choice = reply.json()["choices"][0]
        assert choice.get("logprobs") is None
        assert choice["message"] == direct["choices"][0]["message"]
