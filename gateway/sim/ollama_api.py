"""The sim's Ollama API: ``/api/chat`` and ``/api/generate`` (NDJSON streams unless the body
says ``"stream": false``, as Ollama answers), ``/api/embed``, ``/api/tags`` and
``/api/version``.  The same
model behind another server's own API: the answer derives from the prompt as chat's does
(``outputs.answer_tokens``), paced like chat, with Ollama's counts (``prompt_eval_count``,
``eval_count``) and ``done_reason``; ``options.num_predict`` bounds it.  Errors leave as
Ollama writes them: ``{"error": "..."}``."""

from __future__ import annotations

import datetime
import hashlib
import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest
from gateway.sim import requests as req
from gateway.sim.engine import Engine
from gateway.sim.gpu import call_cost_ms, prefill_ms
from gateway.sim.openai_api import ENGINE, _hold, _length
from gateway.sim.outputs import answer_tokens, count_tokens, embedding

NDJSON = "application/x-ndjson"
VERSION = "0.12.6"
"""The Ollama version the sim answers ``/api/version`` with."""


async def chat(request: web.Request) -> web.StreamResponse:
    body = await req.read_body(request)
    prompt, prompt_tokens = req.chat_prompt(body)
    return await _answer(request, body, prompt, prompt_tokens, _chat_piece)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await req.read_body(request)
    prompt, system = body.get("prompt", ""), body.get("system", "")
    if not isinstance(prompt, str) or not isinstance(system, str):
        raise BadRequest("'prompt' and 'system' must be strings")
    return await _answer(
        request, body, prompt, count_tokens(system) + count_tokens(prompt), _generate_piece
    )


async def embed(request: web.Request) -> web.Response:
    """Ollama's ``/api/embed``: ``input`` a string or a list of them, one vector each
    (normalised, as Ollama's are), ``prompt_eval_count`` their tokens."""
    engine: Engine = request.app[ENGINE]
    body = await req.read_body(request)
    model = req.model_of(body, engine.config.model_names[0])
    given = body.get("input")
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise BadRequest("'input' must be a string or a non-empty array of strings")
    if fault := engine.fault(len(texts)):
        return web.json_response({"error": fault.message}, status=fault.status)
    async with engine.call(len(texts)) as cost_ms:
        await _hold(cost_ms)
    vectors = [embedding(text, engine.config.dimensions) for text in texts]
    return web.json_response(
        {
            "model": model,
            "embeddings": [[round(float(x), 6) for x in vector] for vector in vectors],
            "prompt_eval_count": sum(count_tokens(text) for text in texts),
        }
    )


async def tags(request: web.Request) -> web.Response:
    names = request.app[ENGINE].config.model_names
    now = _now(request.app[ENGINE])
    weights = request.app[ENGINE].config.weights
    models = [
        {"name": n, "model": n, "modified_at": now, "size": 0, "digest": _sha256(weights, n)}
        for n in names
    ]
    return web.json_response({"models": models})


def _sha256(weights: str, name: str) -> str:
    """The digest Ollama names a model's weights by (here, of the sim's ``weights``)."""
    return hashlib.sha256(f"{weights}\x00{name}".encode()).hexdigest()


async def version(_: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


def _chat_piece(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


def _generate_piece(text: str) -> dict[str, Any]:
    return {"response": text}


async def _answer(
    request: web.Request,
    body: dict[str, Any],
    prompt: str,
    prompt_tokens: int,
    piece: Callable[[str], dict[str, Any]],
) -> web.StreamResponse:
    engine: Engine = request.app[ENGINE]
    config = engine.config
    model = req.model_of(body, config.model_names[0])
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object")
    limit = options.get("num_predict")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)):
        raise BadRequest("'options.num_predict' must be an integer")
    limit = None if limit is None or limit < 0 else limit  # -1: until the model stops
    tokens = answer_tokens(model, prompt, _length(config.answer_tokens, limit), config.weights)
    reason = "length" if limit is not None and limit < config.answer_tokens else "stop"
    head = {"model": model, "created_at": _now(engine)}
    tail = {
        **head,
        **piece(""),
        "done": True,
        "done_reason": reason,
        "prompt_eval_count": prompt_tokens,
        "eval_count": len(tokens),
    }
    if fault := engine.fault(1):
        return web.json_response({"error": fault.message}, status=fault.status)
    if body.get("stream") is False:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(cost_ms)
        return web.json_response({**tail, **piece("".join(tokens))})
    response = web.StreamResponse(headers={"Content-Type": NDJSON})
    await response.prepare(request)
    try:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(prefill_ms(config, 1) + cost_ms - call_cost_ms(config, 1, len(tokens)))
            for token in tokens:
                await _hold(config.token_ms)
                await response.write(_line({**head, **piece(token), "done": False}))
        await response.write(_line(tail))
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the slot was released on the way out
    return response


def _line(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode() + b"\n"


def _now(engine: Engine) -> str:
    moment = datetime.datetime.fromtimestamp(engine.clock.wall(), datetime.UTC)
    return moment.isoformat().replace("+00:00", "Z")
