"""A call too long for its model's context (a route's ``context_fallback``).

A model server refuses a prompt (plus the tokens it may generate) past its context window
with a 4xx, before it generates anything: llama.cpp's ``exceed_context_size_error``,
OpenAI's ``context_length_exceeded``, vLLM's "maximum context length is N tokens", TGI's
"`inputs` tokens + `max_new_tokens` must be <= N", SGLang's "longer than the model's context
length", Anthropic's "prompt is too long".  Such a call may well be served by a model with
a longer context (LiteLLM's ``context_window_fallbacks``): on a route with
``context_fallback``, the refusal is read (it is small, and nothing has reached the client)
and, when it says the context was exceeded, the call goes to those backends in order.

Only the backends' refusals are read, and only up to ``MAX_ERROR_BYTES``: an answer longer
than that, or that is not JSON, is passed on as it came.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator

from gateway.pipeline import Reply

OVERFLOW_STATUSES = frozenset({400, 413, 422})
"""How servers refuse a call too long for their context (TGI: 422; a proxy: 413)."""
MAX_ERROR_BYTES = 64 * 1024
"""The most of a refusal read to tell whether it says the context was exceeded."""
REASON = "context_length"
"""``X-Gateway-Fallback`` and ``gateway_fallbacks_total``'s reason."""
_CODES = frozenset({"context_length_exceeded", "exceed_context_size_error"})
_SAYS = re.compile(
    r"maximum context length|context length|context size|context window"
    r"|maximum model length|prompt is too long|must be <= \d+|too many tokens",
    re.IGNORECASE,
)


def overflowed(body: bytes) -> bool:
    """Whether ``body``, a server's refusal, says the call did not fit the context."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return False
    if not isinstance(data, dict):
        return False
    error = data.get("error", data)  # OpenAI, llama.cpp, Anthropic: nested; vLLM, TGI: flat
    if isinstance(error, str):  # TGI: {"error": "...", "error_type": "validation"}
        return _SAYS.search(error) is not None
    if not isinstance(error, dict):
        return False
    if error.get("code") in _CODES or error.get("type") in _CODES:
        return True
    message = error.get("message")
    return isinstance(message, str) and _SAYS.search(message) is not None


async def read_refusal(reply: Reply) -> tuple[Reply, bool]:
    """``reply`` with what was read of it kept, and whether it is a refusal for a context
    exceeded.  A streamed refusal is read whole when it ends within ``MAX_ERROR_BYTES``
    (else the reply goes on as a stream, the bytes read first)."""
    if reply.status not in OVERFLOW_STATUSES:
        return reply, False
    if reply.body is not None:
        return reply, len(reply.body) <= MAX_ERROR_BYTES and overflowed(reply.body)
    if reply.stream is None:
        return reply, False
    read: list[bytes] = []
    size = 0
    stream = reply.stream.__aiter__()
    async for chunk in stream:
        read.append(chunk)
        size += len(chunk)
        if size > MAX_ERROR_BYTES:
            return reply.replace(stream=_again(read, stream)), False
    body = b"".join(read)
    whole = reply.replace(stream=None, body=body, content_length=None)
    if whole.close is not None:
        await whole.close()  # read to its end: its connection goes back to the pool
        whole = whole.replace(close=None)
    return whole, overflowed(body)


async def _again(read: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for chunk in read:
        yield chunk
    async for chunk in rest:
        yield chunk
