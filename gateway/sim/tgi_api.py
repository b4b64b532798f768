"""The sim's Text Generation Inference API: ``/generate`` (one JSON object),
``/generate_stream`` (SSE) and TGI's compatibility route ``/`` (a list of one object, or the
stream when the body says ``"stream": true``), as TGI answers them and its Python client
(``text-generation``) reads them.  The same model behind another server's own API: the
answer derives from ``inputs`` as chat's does (``outputs.answer_tokens``), paced like chat;
``parameters.max_new_tokens`` bounds it (TGI's default: 20), ``parameters.details`` adds
TGI's details.  A stream's events carry one token each, ``"generated_text": null`` but the
last, which carries the whole text (and, asked, the details).  Errors leave as TGI writes
them: ``{"error": "...", "error_type": "..."}``, a 422 for a request it cannot read."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest
from gateway.sim import requests as req
from gateway.sim.engine import Engine
from gateway.sim.gpu import call_cost_ms, prefill_ms
from gateway.sim.openai_api import ENGINE, _hold, _length
from gateway.sim.outputs import answer_tokens, count_tokens

DEFAULT_NEW_TOKENS = 20
"""TGI's ``max_new_tokens`` when a request names none."""


async def generate(request: web.Request) -> web.StreamResponse:
    return await _answer(request, stream=False, listed=False)


async def generate_stream(request: web.Request) -> web.StreamResponse:
    return await _answer(request, stream=True, listed=False)


async def compat(request: web.Request) -> web.StreamResponse:
    """TGI's ``/``: ``/generate_stream`` when the body asks a stream, else ``/generate``'s
    answer in a list."""
    try:
        stream = (await req.read_body(request)).get("stream") is True
    except BadRequest:  # _answer reads it again and says why
        stream = False
    return await _answer(request, stream=stream, listed=True)


def _error(message: str, status: int = 422, kind: str = "validation") -> web.Response:
    return web.json_response({"error": message, "error_type": kind}, status=status)


async def _answer(request: web.Request, stream: bool, listed: bool) -> web.StreamResponse:
    engine: Engine = request.app[ENGINE]
    config = engine.config
    try:
        body = await req.read_body(request)
    except BadRequest as exc:
        return _error(str(exc))
    inputs, parameters = body.get("inputs"), body.get("parameters") or {}
    if not isinstance(inputs, str) or not inputs:
        return _error("`inputs` must be a non-empty string")
    if not isinstance(parameters, dict):
        return _error("`parameters` must be an object")
    limit = parameters.get("max_new_tokens", DEFAULT_NEW_TOKENS)
    if limit is None:
        limit = DEFAULT_NEW_TOKENS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        return _error("`max_new_tokens` must be strictly positive")
    model = config.model_names[0]
    tokens = answer_tokens(model, inputs, _length(config.answer_tokens, limit), config.weights)
    reason = "length" if limit < config.answer_tokens else "eos_token"
    text = "".join(tokens)
    if parameters.get("return_full_text") is True:
        text = inputs + text
    asked = parameters.get("details") is True
    if fault := engine.fault(1):
        return _error(fault.message, fault.status, "overloaded")
    if not stream:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(cost_ms)
        answer: dict[str, Any] = {"generated_text": text}
        if asked:
            answer["details"] = {
                "finish_reason": reason,
                "generated_tokens": len(tokens),
                "seed": None,
                "prefill": [],
                "tokens": [_token(i, t) for i, t in enumerate(tokens)],
            }
        return web.json_response([answer] if listed else answer)
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(prefill_ms(config, 1) + cost_ms - call_cost_ms(config, 1, len(tokens)))
            for i, token in enumerate(tokens):
                await _hold(config.token_ms)
                last = i == len(tokens) - 1
                event: dict[str, Any] = {
                    "index": i,
                    "token": _token(i, token),
                    "generated_text": text if last else None,
                    "details": None,
                }
                if last and asked:
                    event["details"] = {
                        "finish_reason": reason,
                        "generated_tokens": len(tokens),
                        "seed": None,
                        "input_length": count_tokens(inputs),
                    }
                await response.write(b"data:" + json.dumps(event).encode() + b"\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the slot was released on the way out
    return response


def _token(index: int, text: str) -> dict[str, Any]:
    return {"id": index, "text": text, "logprob": -0.25, "special": False}
