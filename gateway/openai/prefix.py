"""A request's leading context, as a key: what a model server's prefix cache can reuse.

vLLM and SGLang keep the KV cache of prompts they have seen; a request that starts like an
earlier one (the same system prompt, the same first turns) is cheaper on the instance that
served it.  ``leading_key`` hashes the ``model`` and a chat body's leading ``system`` (or
``developer``) messages, the prompt an application puts before every conversation, so all
its conversations, and their later turns, meet on one instance; a chat without one is keyed
by its first message (its own conversation's turns share it).  Anthropic's ``system`` and
the Responses API's ``instructions`` are such a prompt, and the Responses API's ``input``
items are read as messages.  A completion is keyed by the
first ``LEADING_CHARS`` of its prompt.  Requests with the same key start with the same
tokens.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

LEADING_CHARS = 512
INSTRUCTION_ROLES = frozenset({"system", "developer"})


def leading_key(body: Any) -> str | None:
    """The key of ``body``'s leading context, or None when it has none to share."""
    if not isinstance(body, dict):
        return None
    # Anthropic's top-level system prompt, the Responses API's instructions
    instructions = body.get("system") or body.get("instructions")
    messages = body.get("messages")
    if not isinstance(messages, list):  # the Responses API's input items
        items = body.get("input")
        messages = (
            items if isinstance(items, list) and items and isinstance(items[0], dict) else None
        )
    leading: Any
    if isinstance(instructions, str | list):
        leading = ["instructions", instructions]
    elif isinstance(messages, list) and messages:
        count = 0
        for m in messages:
            if not (isinstance(m, dict) and m.get("role") in INSTRUCTION_ROLES):
                break
            count += 1
        leading = messages[: count or 1]
    elif isinstance(body.get("prompt"), str):
        leading = body["prompt"][:LEADING_CHARS]
    else:
        return None
    text = json.dumps([body.get("model"), leading], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
