"""Reading OpenAI request bodies for the sim: JSON, prompts, inputs and token limits.

Everything here raises ``BadRequest`` with an OpenAI-style message; the server's middleware
turns it into the ``{"error": {...}}`` body a real server sends.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.errors import BadRequest
from gateway.sim.outputs import count_tokens

ENCODING_FORMATS = ("float", "base64")
MAX_TOP_LOGPROBS = 20
MAX_DIMENSIONS = 16384
"""Wider than any embedding model served today (text-embedding-3-large: 3072)."""
MAX_OUTPUT_FLOATS = 1 << 23
"""Items times dimensions one embeddings answer may hold (32 MiB of float32): a request
for more is refused, so no body under the server's size limit can make the sim build an
answer larger than its memory."""


async def read_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object."""
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body


def model_of(body: dict[str, Any], default: str) -> str:
    """The requested model (any name is served), or the sim's default one."""
    model = body.get("model", default)
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string")
    return model


def max_tokens_of(body: dict[str, Any], *names: str) -> int | None:
    """The first token limit present among ``names``; None when none is set."""
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BadRequest(f"'{name}' must be a positive integer")
        return value
    return None


def single_choice(body: dict[str, Any]) -> None:
    """The sim answers one choice per prompt; refuse ``n`` > 1 rather than ignore it."""
    n = body.get("n", 1)
    if n is not None and n != 1:
        raise BadRequest("the sim serves only n=1")


def chat_prompt(body: dict[str, Any]) -> tuple[str, int]:
    """The text the answer derives from (last user message) and the prompt's token count."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array")
    texts: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a 'role'")
        texts.append((message["role"], _content_text(message.get("content"), i)))
    users = [text for role, text in texts if role == "user"]
    prompt = users[-1] if users else texts[-1][1]
    return prompt, sum(count_tokens(text) for _, text in texts)


def _content_text(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict)]
        return " ".join(p for p in parts if isinstance(p, str))
    raise BadRequest(f"messages[{i}].content must be a string or an array of parts")


def input_items(value: Any, name: str) -> list[tuple[str, list[int] | None]]:
    """A prompt or input as items: a string, strings, a token list or token lists.

    Each item is ``(text, tokens)``; ``tokens`` is None for text items.
    """
    if isinstance(value, str):
        return [(value, None)]
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return [(v, None) for v in value]
        if all(_is_token(v) for v in value):
            return [(_token_text(value), list(value))]
        if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
            return [(_token_text(v), list(v)) for v in value]
    raise BadRequest(
        f"'{name}' must be a string, an array of strings, an array of token ids "
        "or an array of token-id arrays, and not empty"
    )


def item_tokens(item: tuple[str, list[int] | None]) -> int:
    """How many tokens an input item counts for in ``usage``."""
    text, tokens = item
    return len(tokens) if tokens is not None else count_tokens(text)


def dimensions_of(body: dict[str, Any], default: int, items: int = 1) -> int:
    """The embedding size asked for, within ``MAX_DIMENSIONS`` and, over ``items``
    inputs, within ``MAX_OUTPUT_FLOATS``."""
    value = body.get("dimensions", default)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIMENSIONS:
        raise BadRequest(f"'dimensions' must be an integer in 1..{MAX_DIMENSIONS}")
    if value * items > MAX_OUTPUT_FLOATS:
        raise BadRequest(
            f"{items} inputs of {value} dimensions exceed the {MAX_OUTPUT_FLOATS} values "
            "one answer may hold; send fewer inputs per request"
        )
    return value


def encoding_format_of(body: dict[str, Any]) -> str:
    value = body.get("encoding_format") or "float"
    if value not in ENCODING_FORMATS:
        raise BadRequest("'encoding_format' must be 'float' or 'base64'")
    return str(value)


def top_logprobs_of(body: dict[str, Any]) -> int:
    value = body.get("top_logprobs") or 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be an integer in 0..{MAX_TOP_LOGPROBS}")
    return value


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _token_text(tokens: list[int]) -> str:
    return "tokens:" + " ".join(str(t) for t in tokens)
