"""Quality fallback: judge a chat answer by its mean token logprob (the case study's
"confidence below threshold"), asking the backend for logprobs and hiding them again.

Only non-streaming chat completions are judged: a stream has reached the client before its
last token could be weighed.  An answer without logprobs (a backend that ignores the
request) cannot be judged and is accepted.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from gateway.openai.body import dumps_yielding
from gateway.pipeline import Call, Reply
from gateway.policy.model import Quality

CHAT_PATH = "/v1/chat/completions"


def judged(call: Call, quality: Quality | None) -> bool:
    """Whether ``call``'s answer is judged on this route."""
    return (
        quality is not None
        and call.path == CHAT_PATH
        and call.json is not None
        and not call.streaming
    )


async def asking_logprobs(call: Call, quality: Quality) -> tuple[Call, bool]:
    """The call to send (asking for logprobs if the route says to) and whether they must be
    stripped from the answer because the client did not ask for them."""
    data = call.json
    if data is None or data.get("logprobs") is True or not quality.request_logprobs:
        return call, False
    asked = {**data, "logprobs": True}
    body = await dumps_yielding(asked, len(call.body))
    return dataclasses.replace(call, body=body, json=asked), True


def mean_logprob(answer: Any) -> float | None:
    """The mean logprob over every token of every choice, None when there are none."""
    total = 0.0
    count = 0
    for choice in _choices(answer):
        logprobs = choice.get("logprobs")
        content = logprobs.get("content") if isinstance(logprobs, dict) else None
        if not isinstance(content, list):
            continue
        for token in content:
            value = token.get("logprob") if isinstance(token, dict) else None
            if isinstance(value, int | float) and not isinstance(value, bool):
                total += value
                count += 1
    return total / count if count else None


def strip_logprobs(answer: Any) -> bytes:
    """The answer re-encoded with every choice's ``logprobs`` set to null."""
    for choice in _choices(answer):
        choice["logprobs"] = None
    return json.dumps(answer, separators=(",", ":")).encode()


def parse(reply: Reply) -> Any:
    """The answer's JSON, or None when it is not a JSON body."""
    if reply.body is None:
        return None
    try:
        return json.loads(reply.body)
    except (ValueError, RecursionError):  # not JSON; nested past the parser's depth
        return None


def _choices(answer: Any) -> list[dict[str, Any]]:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list):
        return []
    return [c for c in choices if isinstance(c, dict)]
