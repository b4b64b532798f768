"""vLLM's own ``priority`` body field (a server started with ``--scheduling-policy
priority``: lower runs first, 0 is its default), written by the gateway for a backend with
``upstream_priority: vllm`` over whatever the client sent, so that no client sets its own
place in that server's queue: the resilience stage writes the call's priority, the mirror
the lowest for its copies."""

from __future__ import annotations

import dataclasses

from gateway.openai.body import dumps_yielding
from gateway.pipeline import Call

HIGH, NORMAL, LOW = -1, 0, 1
"""vLLM's values for the gateway's high, normal and low priorities."""
PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"})
"""The OpenAI endpoints whose bodies vLLM reads a ``priority`` from."""


async def with_priority(call: Call, wanted: int) -> Call:
    """``call`` whose body carries ``wanted`` as vLLM's ``priority``, replacing the client's."""
    data = call.json
    if data is None or call.method != "POST" or call.path not in PATHS:
        return call
    given = data.get("priority", NORMAL)
    if type(given) is int and given == wanted:
        return call  # already so (vLLM's default is 0): nothing to write again
    asked = {**data, "priority": wanted}
    return dataclasses.replace(call, json=asked, body=await dumps_yielding(asked, len(call.body)))
