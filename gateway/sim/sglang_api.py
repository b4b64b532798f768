"""The sim's SGLang native API: ``/generate`` with SGLang's body (its prompt in ``text``, or
token ids in ``input_ids``; ``sampling_params``; ``stream``), as SGLang's HTTP server
answers it.  The same model behind another server's own API: the answer derives from the
prompt as chat's does (``outputs.answer_tokens``), paced like chat;
``sampling_params.max_new_tokens`` bounds it (SGLang's default: 128).  A whole answer is
``{"text", "output_ids", "meta_info"}``; a stream's events carry the text so far (SGLang's
default, not incremental), ``meta_info.finish_reason`` null but in the last, which names
why it finished (``{"type": "length", "length": N}`` or ``{"type": "stop", ...}``), then
``data: [DONE]``.  Errors leave as SGLang writes them: ``{"error": {"message": ...}}``, a
400.  ``/generate`` is TGI's too (``tgi_api``): the sim's route tells them apart by the
prompt's field, as the gateway does."""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest
from gateway.sim import requests as req
from gateway.sim.engine import Engine
from gateway.sim.gpu import call_cost_ms, prefill_ms
from gateway.sim.openai_api import ENGINE, _hold, _length
from gateway.sim.outputs import answer_tokens, count_tokens

DEFAULT_NEW_TOKENS = 128
"""SGLang's ``max_new_tokens`` when a request names none."""
EOS_ID = 1
"""The token id a stop names as ``matched``."""


def asks_sglang(body: dict[str, Any]) -> bool:
    """Whether a ``/generate`` body is SGLang's: its prompt in ``text`` or ``input_ids``."""
    return "inputs" not in body and ("text" in body or "input_ids" in body)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def generate(request: web.Request) -> web.StreamResponse:
    engine: Engine = request.app[ENGINE]
    config = engine.config
    try:
        body = await req.read_body(request)
    except BadRequest as exc:
        return _error(str(exc))
    prompt = body.get("text")
    if prompt is None and isinstance(body.get("input_ids"), list):
        prompt = " ".join(map(str, body["input_ids"]))
    if not isinstance(prompt, str) or not prompt:
        return _error("Either text or input_ids should be provided.")
    sampling = body.get("sampling_params") or {}
    if not isinstance(sampling, dict):
        return _error("sampling_params must be an object")
    limit = sampling.get("max_new_tokens", DEFAULT_NEW_TOKENS)
    if limit is None:
        limit = DEFAULT_NEW_TOKENS
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        return _error("max_new_tokens must be at least 0")
    model = config.model_names[0]
    tokens = answer_tokens(model, prompt, _length(config.answer_tokens, limit), config.weights)
    finish = (
        {"type": "length", "length": len(tokens)}
        if limit < config.answer_tokens
        else {"type": "stop", "matched": EOS_ID}
    )
    rid = body.get("rid") if isinstance(body.get("rid"), str) else uuid.uuid4().hex
    prompt_tokens = count_tokens(prompt)
    if fault := engine.fault(1):
        return _error(fault.message, fault.status)

    def answer(upto: int, finished: bool) -> dict[str, Any]:
        meta = {
            "id": rid,
            "finish_reason": finish if finished else None,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": upto,
            "cached_tokens": 0,
        }
        text = "".join(tokens[:upto])
        return {"text": text, "output_ids": list(range(2, 2 + upto)), "meta_info": meta}

    if body.get("stream") is not True:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(cost_ms)
        return web.json_response(answer(len(tokens), True))
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        async with engine.call(1, len(tokens)) as cost_ms:
            await _hold(prefill_ms(config, 1) + cost_ms - call_cost_ms(config, 1, len(tokens)))
            for i in range(len(tokens)):
                await _hold(config.token_ms)
                event = answer(i + 1, i == len(tokens) - 1)
                await response.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; the slot was released on the way out
    return response
