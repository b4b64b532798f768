"""What an answer says, to tell whether the mirror answered a call as the route's backend
did: the JSON answer without the fields two servers' answers differ in whatever they say
(ids, times, the model's name, token counts, server timings), in one canonical form.

Only a deterministic call's answers are compared (the cache's test: temperature 0, one
choice, an embedding), both whole bodies of at most ``MAX_COMPARED_BYTES``; a sampled
answer differs by design, and a bigger one would hold the event loop to parse.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.cache.keys import cacheability
from gateway.pipeline import Call, Reply

MAX_COMPARED_BYTES = 256 * 1024
VOLATILE = frozenset(
    {
        "id",
        "created",
        "created_at",
        "model",
        "system_fingerprint",
        "usage",
        "timings",  # llama.cpp's
        "service_tier",
    }
)
"""Fields in which two servers' answers to one call differ whatever they say."""


def comparable(call: Call, reply: Reply) -> bytes | None:
    """The body of ``reply`` if it is one to compare the mirror's with, else None."""
    body = reply.body
    if reply.status != 200 or body is None or len(body) > MAX_COMPARED_BYTES:
        return None
    if call.json is None or call.streaming or not cacheability(call.json, call.path).ok:
        return None
    return body


def said(body: bytes) -> str | None:
    """What a JSON answer says, canonical; None for a body that is not JSON."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return json.dumps(_stable(data), sort_keys=True, separators=(",", ":"))


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value
