"""The sim's OpenAI Responses API (``/v1/responses``) and Anthropic Messages API
(``/v1/messages``, ``/v1/messages/count_tokens``): the same model behind the other shapes
vLLM and llama.cpp's server answer beside chat, whole and streamed, with their own
``usage`` (the Responses API's ``input_tokens`` / ``output_tokens``, Anthropic's with its
input in ``message_start`` and its output in ``message_delta``).  Paced like chat
(``openai_api``).

Responses are stored as vLLM stores them with its store on (unless the body says
``"store": false``): in this process's memory, the last ``MAX_STORED`` of them, served by
``GET``/``DELETE /v1/responses/<id>`` and continued by ``previous_response_id`` (whose
conversation's tokens then count in the new response's input); the least recently made or
continued are forgotten first.  Another instance of the sim
has none of them, as another vLLM instance would not.  A response may also join a
conversation of the Conversations API (``conversations``)."""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.errors import RequestError
from gateway.sim import conversations
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

MAX_STORED = 4096
"""Responses a sim keeps (the oldest forgotten first): its memory stays bounded."""
Stored = OrderedDict[str, dict[str, Any]]
STORED = web.AppKey("stored", OrderedDict)


class NotStored(RequestError):
    """An id this instance does not hold (OpenAI's and vLLM's answer)."""

    status = 404
    code = "response_not_found"


def stored_of(request: web.Request) -> Stored:
    stored: Stored = request.app[STORED]
    return stored


async def stored_response(request: web.Request) -> web.Response:
    """``GET`` (or ``DELETE``) ``/v1/responses/<id>``."""
    rid, stored = request.match_info["rid"], stored_of(request)
    found = stored.pop(rid, None) if request.method == "DELETE" else stored.get(rid)
    if found is None:
        raise NotStored(f"Response with id '{rid}' not found.")
    if request.method == "DELETE":
        return web.json_response({"id": rid, "object": "response", "deleted": True})
    return web.json_response(found)


async def responses(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    body = await req.read_body(request)
    model = req.model_of(body, engine.config.model_names[0])
    prompt, prompt_tokens = _input_prompt(body)
    previous = body.get("previous_response_id")
    if previous is not None:
        earlier = stored_of(request).get(previous) if isinstance(previous, str) else None
        if earlier is None:
            raise req.BadRequest(f"Previous response with id '{previous}' not found.")
        stored_of(request).move_to_end(previous)  # the least recently used go first
        prompt_tokens += earlier["usage"]["total_tokens"]  # the conversation so far
    conversation = conversations.joined(request, body)
    if conversation is not None:
        prompt_tokens += conversation.tokens
    limit = req.max_tokens_of(body, "max_output_tokens")
    length = _length(engine.config.answer_tokens, limit)
    tokens = answer_tokens(model, prompt, length, engine.config.weights)
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
        made = {
            "id": ids[0],
            "object": "response",
            "created_at": created,
            "status": status,
            "model": model,
            "previous_response_id": previous,
            "conversation": {"id": conversation.id} if conversation is not None else None,
            "output": [{**message, "content": [part]}] if done else [],
            "usage": usage if done else None,
        }
        if done and conversation is not None:
            given = body.get("input")
            said: list[Any] = [{"role": "user", "content": given}]
            if isinstance(given, list):  # else a string: ``_input_prompt`` took nothing else
                said = [item for item in given if isinstance(item, dict)]
            conversation.add([*said, {**message, "content": [part]}])
        if done and body.get("store", True) is not False:
            stored = stored_of(request)
            stored[ids[0]] = made
            while len(stored) > MAX_STORED:
                stored.popitem(last=False)
        return made

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
    length = _length(engine.config.answer_tokens, limit)
    tokens = answer_tokens(model, prompt, length, engine.config.weights)
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
