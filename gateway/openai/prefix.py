"""A request's leading context, as a key: what a model server's prefix cache can reuse.

vLLM and SGLang keep the KV cache of prompts they have seen; a request that starts like an
earlier one (the same system prompt, the same first turns) is cheaper on the instance that
served it.  ``leading_key`` hashes the ``model`` and the first ``LEADING_MESSAGES`` messages
of a chat body (or the first ``LEADING_CHARS`` of a completion prompt): requests with the
same key start with the same tokens.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

LEADING_MESSAGES = 2
"""The system prompt and the first user turn: what a conversation's requests share."""
LEADING_CHARS = 512


def leading_key(body: Any) -> str | None:
    """The key of ``body``'s leading context, or None when it has none to share."""
    if not isinstance(body, dict):
        return None
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        leading: Any = messages[:LEADING_MESSAGES]
    elif isinstance(body.get("prompt"), str):
        leading = body["prompt"][:LEADING_CHARS]
    else:
        return None
    text = json.dumps([body.get("model"), leading], sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
