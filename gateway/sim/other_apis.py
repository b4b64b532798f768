"""The sim's OpenAI Responses API (``/v1/responses``) and Anthropic Messages API
(``/v1/messages``, ``/v1/messages/count_tokens``): the same model behind the other shapes
vLLM and llama.cpp's server answer beside chat, whole and streamed, with their own
``usage`` (the Responses API's ``input_tokens`` / ``output_tokens``, Anthropic's with its
input in ``message_start`` and its output in ``message_delta``).  Paced like chat
(``openai_api``); nothing is stored, so ``previous_response_id`` is refused."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.sim import requests as req
from gateway.sim.engine import Engine
from gateway.sim.gpu import call_cost_ms, prefill_ms
from gateway.sim.openai_api import (
    ENGINE,
    _fault_response,
    _hold,
    _json,
    _length,
    _sse_response,
)
from gateway.sim.outputs import answer_tokens, count_tokens


async def responses(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await req.read_body(request)
    if body.get("previous_response_id") is not None:
        raise req.BadRequest("the sim stores no responses: 'previous_response_id' is unknown")
    model = req.model_of(body, engine.config.model_names[0])
    prompt, prompt_tokens = _input_prompt(body)
    limit = req.max_tokens_of(body, "max_output_tokens")
    tokens = answer_tokens(model, prompt, _length(engine.config.answer_tokens, limit))
    if fault := engine.fault(1):
        return _fault_response(fault)
    usage = {
        "input_tokens": prompt_tokens,
        "output_tokens": len(tokens),
        "total_tokens": prompt_tokens + len(tokens),
    }
    ids = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    created = int(engine.clock.wall())

    def answer(text: str, status: str) -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": []}
        message = {"type": "message", "id": ids[1], "status": status, "role": "assistant"}
        done = status == "completed"
        return {
            "id": ids[0],
            "object": "response",
            "created_at": created,
            "status": status,
            "model": model,
            "output": [{**message, "content": [part]}] if done else [],
            "usage": usage if done else None,
        }

    if not body.get("stream"):
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(cost_ms)
        return _json(answer("".join(tokens), "completed"), cost_ms)
    delta: dict[str, Any] = {"type": "response.output_text.delta", "item_id": ids[1]}
    delta.update(output_index=0, content_index=0)
    opened: dict[str, Any] = {"type": "response.created", "response": answer("", "in_progress")}
    completed = {"type": "response.completed", "response": answer("".join(tokens), "completed")}
    return await _stream(
        request,
        engine,
        tokens,
        [("response.created", opened)],
        lambda token: ("response.output_text.delta", {**delta, "delta": token}),
        [("response.completed", completed)],
    )


async def messages(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await req.read_body(request)
    model = req.model_of(body, engine.config.model_names[0])
    prompt, prompt_tokens = _messages_prompt(body)
    limit = req.max_tokens_of(body, "max_tokens")
    tokens = answer_tokens(model, prompt, _length(engine.config.answer_tokens, limit))
    stop = "max_tokens" if limit is not None and limit < engine.config.answer_tokens else "end_turn"
    if fault := engine.fault(1):
        return _fault_response(fault)
    head = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": model}
    usage = {"input_tokens": prompt_tokens, "output_tokens": len(tokens)}
    if not body.get("stream"):
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(cost_ms)
        content = [{"type": "text", "text": "".join(tokens)}]
        whole = {**head, "content": content, "stop_reason": stop, "stop_sequence": None}
        return _json({**whole, "usage": usage}, cost_ms)
    started: dict[str, Any] = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
    started["usage"] = {**usage, "output_tokens": 0}
    block: dict[str, Any] = {"type": "content_block_start", "index": 0}
    block["content_block"] = {"type": "text", "text": ""}
    ended: dict[str, Any] = {
        "type": "message_delta",
        "delta": {"stop_reason": stop, "stop_sequence": None},
    }
    ended["usage"] = {"output_tokens": len(tokens)}

    def text(token: str) -> Event:
        delta = {"type": "text_delta", "text": token}
        return "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}

    return await _stream(
        request,
        engine,
        tokens,
        [
            ("message_start", {"type": "message_start", "message": started}),
            ("content_block_start", block),
        ],
        text,
        [
            ("content_block_stop", {"type": "content_block_stop", "index": 0}),
            ("message_delta", ended),
            ("message_stop", {"type": "message_stop"}),
        ],
    )


async def count_message_tokens(request: web.Request) -> web.Response:
    body = await req.read_body(request)
    _, prompt_tokens = _messages_prompt(body)
    return web.json_response({"input_tokens": prompt_tokens})


Event = tuple[str, dict[str, Any]]


async def _stream(
    request: web.Request,
    engine: Engine,
    tokens: list[str],
    opening: list[Event],
    each: Callable[[str], Event],
    closing: list[Event],
) -> web.StreamResponse:
    """Named SSE events (``event:`` then ``data:``), paced as a chat stream is."""
    config = engine.config
    response = _sse_response(call_cost_ms(config, 1, len(tokens)))
    await response.prepare(request)
    try:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(prefill_ms(config, 1) + cost_ms - call_cost_ms(config, 1, len(tokens)))
            for event in opening:
                await response.write(_event(event))
            for token in tokens:
                await _hold(config.token_ms)
                await response.write(_event(each(token)))
            for event in closing:
                await response.write(_event(event))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the slot was released on the way out
    return response


def _event(event: Event) -> bytes:
    name, data = event
    return f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()


def _input_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """The Responses API's ``input`` (a string, or message items) and ``instructions``."""
    given = body.get("input")
    instructions = body.get("instructions")
    extra = count_tokens(instructions) if isinstance(instructions, str) else 0
    if isinstance(given, str):
        return given, count_tokens(given) + extra
    if not isinstance(given, list) or not given:
        raise req.BadRequest("'input' must be a string or a non-empty array")
    items = [item for item in given if isinstance(item, dict) and "role" in item]
    if not items:
        raise req.BadRequest("'input' holds no message")
    prompt, tokens = req.chat_prompt({"messages": items})
    return prompt, tokens + extra


def _messages_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """Anthropic's ``messages`` and its top-level ``system`` (a string or text blocks)."""
    prompt, tokens = req.chat_prompt(body)
    system = body.get("system")
    if isinstance(system, list):
        system = " ".join(b.get("text", "") for b in system if isinstance(b, dict))
    return prompt, tokens + (count_tokens(system) if isinstance(system, str) else 0)
