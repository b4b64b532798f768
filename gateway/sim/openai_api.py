"""The sim's OpenAI-compatible endpoints: chat, completions, embeddings and models.

Each model call asks the engine for a fault first, then holds a GPU slot for its modelled
time: the prefill (``base_ms + items * per_item_ms + added_latency_ms``), then ``token_ms`` per
generated token.  Streams pace their chunks the same way.  Every answer carries its modelled
cost in ``x-sim-cost-ms``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

from aiohttp import web

from gateway.sim import requests as req
from gateway.sim.engine import Engine, Fault
from gateway.sim.gpu import call_cost_ms, prefill_ms
from gateway.sim.outputs import (
    answer_tokens,
    embedding,
    encode_vector,
    token_embedding,
    token_logprobs,
)

ENGINE = web.AppKey("engine", Engine)
COST_HEADER = "x-sim-cost-ms"
RETRY_AFTER_S = 1
_RETRYABLE = (429, 503)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    config = engine.config
    body = await req.read_body(request)
    model = req.model_of(body, config.model_names[0])
    prompt, prompt_tokens = req.chat_prompt(body)
    req.single_choice(body)
    limit = req.max_tokens_of(body, "max_completion_tokens", "max_tokens")
    tokens = answer_tokens(model, prompt, _length(config.answer_tokens, limit), config.weights)
    finish = "length" if limit is not None and limit < config.answer_tokens else "stop"
    logprobs = None
    if body.get("logprobs") is True:
        top = req.top_logprobs_of(body)
        logprobs = token_logprobs(prompt, tokens, config.confidence, top)
    usage = _usage(prompt_tokens, len(tokens))
    if fault := engine.fault(1):
        return _fault_response(fault)
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(engine.clock.wall()),
        "model": model,
        "system_fingerprint": f"sim-{config.port}",  # which instance answered
    }
    if body.get("stream"):
        options = body.get("stream_options") or {}
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return await _stream_chat(
            request, engine, head, tokens, logprobs, finish, usage, include_usage
        )
    async with engine.call(1, len(tokens)) as cost_ms:
        await _hold(cost_ms)
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(tokens)},
        "logprobs": {"content": logprobs} if logprobs is not None else None,
        "finish_reason": finish,
    }
    answer = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
    return _json(answer, cost_ms)


async def _stream_chat(
    request: web.Request,
    engine: Engine,
    head: dict[str, Any],
    tokens: list[str],
    logprobs: list[dict[str, Any]] | None,
    finish: str,
    usage: dict[str, int],
    include_usage: bool,
) -> web.StreamResponse:
    config = engine.config
    response = _sse_response(call_cost_ms(config, 1, len(tokens)))
    await response.prepare(request)
    extra = {"usage": None} if include_usage else {}

    def chunk(delta: dict[str, Any], lp: Any = None, reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": reason}
        return _sse({**head, "object": "chat.completion.chunk", "choices": [choice], **extra})

    try:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(prefill_ms(config, 1) + cost_ms - call_cost_ms(config, 1, len(tokens)))
            await response.write(chunk({"role": "assistant", "content": ""}))
            for i, token in enumerate(tokens):
                await _hold(config.token_ms)
                lp = {"content": [logprobs[i]]} if logprobs is not None else None
                await response.write(chunk({"content": token}, lp))
            await response.write(chunk({}, None, finish))
        if include_usage:
            tail = {**head, "object": "chat.completion.chunk", "choices": [], "usage": usage}
            await response.write(_sse(tail))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the slot was released on the way out
    return response


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    config = engine.config
    body = await req.read_body(request)
    model = req.model_of(body, config.model_names[0])
    items = req.input_items(body.get("prompt"), "prompt")
    req.single_choice(body)
    limit = req.max_tokens_of(body, "max_tokens")
    length = _length(config.answer_tokens, limit)
    finish = "length" if limit is not None and limit < config.answer_tokens else "stop"
    answers = [answer_tokens(model, text, length, config.weights) for text, _ in items]
    usage = _usage(sum(req.item_tokens(i) for i in items), length * len(items))
    if fault := engine.fault(len(items)):
        return _fault_response(fault)
    head = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(engine.clock.wall()),
        "model": model,
    }
    if body.get("stream"):
        return await _stream_completions(request, engine, head, answers, finish)
    async with engine.call(len(items), length) as cost_ms:
        await _hold(cost_ms)
    choices = [
        {"index": i, "text": "".join(answer), "logprobs": None, "finish_reason": finish}
        for i, answer in enumerate(answers)
    ]
    return _json({**head, "choices": choices, "usage": usage}, cost_ms)


async def _stream_completions(
    request: web.Request,
    engine: Engine,
    head: dict[str, Any],
    answers: list[list[str]],
    finish: str,
) -> web.StreamResponse:
    config = engine.config
    length = len(answers[0])
    response = _sse_response(call_cost_ms(config, len(answers), length))
    await response.prepare(request)

    def chunk(i: int, text: str, reason: str | None = None) -> bytes:
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": reason}
        return _sse({**head, "choices": [choice]})

    try:
        async with engine.call(len(answers), length) as cost_ms:
            cold_ms = cost_ms - call_cost_ms(config, len(answers), length)
            await _hold(prefill_ms(config, len(answers)) + cold_ms)
            for step in range(length):
                await _hold(config.token_ms)
                for i, answer in enumerate(answers):
                    await response.write(chunk(i, answer[step]))
            for i in range(len(answers)):
                await response.write(chunk(i, "", finish))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the slot was released on the way out
    return response


async def embeddings(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    config = engine.config
    body = await req.read_body(request)
    model = req.model_of(body, config.model_names[0])
    items = req.input_items(body.get("input"), "input")
    dimensions = req.dimensions_of(body, config.dimensions, len(items))
    encoding_format = req.encoding_format_of(body)
    if fault := engine.fault(len(items)):
        return _fault_response(fault)
    async with engine.call(len(items)) as cost_ms:
        await _hold(cost_ms)
    data = []
    for i, (text, tokens) in enumerate(items):
        if tokens is not None:
            vector = token_embedding(tokens, dimensions)
        else:
            vector = embedding(text, dimensions)
        data.append(
            {"object": "embedding", "index": i, "embedding": encode_vector(vector, encoding_format)}
        )
    prompt_tokens = sum(req.item_tokens(i) for i in items)
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return _json({"object": "list", "data": data, "model": model, "usage": usage}, cost_ms)


async def models(request: web.Request) -> web.Response:
    names = request.app[ENGINE].config.model_names
    root = request.app[ENGINE].config.weights
    data = [
        {"id": n, "object": "model", "created": 0, "owned_by": "sim", "root": root or n}
        for n in names
    ]
    return web.json_response({"object": "list", "data": data})


def error_body(message: str, type_: str, code: str) -> dict[str, Any]:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _fault_response(fault: Fault) -> web.Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if fault.status in _RETRYABLE else None
    body = error_body(fault.message, fault.type, fault.code)
    return web.json_response(body, status=fault.status, headers=headers)


def _length(natural: int, limit: int | None) -> int:
    return natural if limit is None else min(natural, limit)


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _hold(ms: float) -> None:
    await asyncio.sleep(ms / 1000)


def _json(body: dict[str, Any], cost_ms: float) -> web.Response:
    return web.json_response(body, headers={COST_HEADER: f"{cost_ms:.3f}"})


def _sse_response(cost_ms: float) -> web.StreamResponse:
    headers = {
        "Content-Type": "text/event-stream",
        "Cache-Control": "no-cache",
        COST_HEADER: f"{cost_ms:.3f}",
    }
    return web.StreamResponse(headers=headers)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
