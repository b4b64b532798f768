"""Validation of the JSON bodies of OpenAI endpoints, so that malformed requests are
answered 400 at the gateway and never reach a backend."""

from __future__ import annotations

import json
from typing import Any

from .errors import BadRequest

_REQUIRED: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "/v1/chat/completions": ("messages", list),
    "/v1/completions": ("prompt", (str, list)),
    "/v1/embeddings": ("input", (str, list)),
}


def parse(path: str, body: bytes) -> dict[str, Any]:
    """The body as a JSON object, checked for what routing, caching and batching rely on."""
    if not body:
        raise BadRequest("request body is empty; this endpoint expects a JSON object")
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    field, kind = _REQUIRED[path]
    if field not in data:
        raise BadRequest(f"'{field}' is required")
    if not isinstance(data[field], kind):
        raise BadRequest(f"'{field}' has the wrong type")
    if path == "/v1/chat/completions":
        messages = data["messages"]
        if not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects")
    return data
