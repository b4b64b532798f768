"""A backend's answer the gateway reads past what Python's ``json`` reads: nested deeper than
its recursion limit (``RecursionError``, not a ``ValueError``) or holding a number past
``int()``'s 4,300 digits.  The gateway reads answers for a token limit's counts, a quality
fallback's confidence, a context fallback's refusal, a cached stream's events; whatever it
makes of them, the answer reaches the client as the backend sent it, never as the gateway's
own 500 or a stream cut short."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.pipeline import Reply
from gateway.testing import FakeClock, Sent, stream_reply
from tests.helpers import chat, policy

URL = "http://main.test"
DEEP = b"[" * 100_000 + b"]" * 100_000
LONG = b"9" * 5000
WHOLE = [
    DEEP,
    b'{"choices":[],"usage":{"prompt_tokens":' + LONG + b',"completion_tokens":1}}',
    b'{"choices":[{"index":0,"message":{"content":"x"},"logprobs":' + DEEP + b"}]}",
    b'{"choices":[{"index":0,"message":{"content":"x"},"logprobs":{"content":[{"logprob":'
    + LONG
    + b"}]}}]}",
]
EVENTS = [
    b"data: " + DEEP + b"\n\n",
    b'data: {"choices":[],"usage":{"prompt_tokens":' + LONG + b',"completion_tokens":1}}\n\n',
    b'data: {"choices":[{"index":0,"delta":{"content":"x"}}],"x":' + DEEP + b"}\n\n",
]


def answering(body: bytes, status: int = 200, stream: bool = False) -> Any:
    def answer(sent: Sent) -> Reply:
        if stream:
            return stream_reply([b'data: {"choices":[]}\n\n', body, b"data: [DONE]\n\n"])
        return Reply(status, (("Content-Type", "application/json"),), body=body)

    return answer


def route(**more: Any) -> dict[str, Any]:
    return {
        "cache": {"ttl_s": 60},
        "rate_limit": {"tokens_per_min": 100_000},
        "fallback": ["spare"],
        "context_fallback": ["spare"],
        "quality": {"min_mean_logprob": -0.5},
        **more,
    }


def gateway_policy() -> dict[str, Any]:
    return policy({"main": {"url": URL}, "spare": {"url": "http://spare.test"}}, route())


@pytest.mark.parametrize("body", WHOLE, ids=["deep", "long-count", "deep-logprobs", "long-prob"])
@pytest.mark.parametrize("status", [200, 400])
async def test_a_whole_answer_past_what_json_reads_is_relayed(pipeline, body, status):
    backends = {"main": answering(body, status), "spare": answering(b"{}")}
    gw = await pipeline(gateway_policy(), backends, clock=FakeClock())
    answer = await gw.post("/v1/chat/completions", chat(logprobs=True))
    assert (answer.status_code, answer.body) == (status, body)


@pytest.mark.parametrize("event", EVENTS, ids=["deep", "long-count", "deep-member"])
async def test_a_stream_event_past_what_json_reads_is_relayed_whole(pipeline, event):
    backends = {"main": answering(event, stream=True), "spare": answering(b"{}")}
    gw = await pipeline(gateway_policy(), backends, clock=FakeClock())
    for _ in range(2):
        answer = await gw.post("/v1/chat/completions", chat(stream=True))
        assert answer.status_code == 200 and answer.complete
        assert event in answer.body and answer.body.endswith(b"data: [DONE]\n\n")


async def test_a_stored_answer_past_what_json_reads_is_not_replayed_as_a_stream(pipeline):
    """A whole answer is stored as it came, and a stream asking the same is answered from it
    in events: one nested past the parser's depth cannot be, so that call goes upstream."""
    body = b'{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":'
    body += b'"assistant","content":"x"},"finish_reason":"stop"}],"x":' + DEEP + b"}"
    calls: list[Sent] = []

    def main(sent: Sent) -> Reply:
        calls.append(sent)
        if sent.json().get("stream"):
            return stream_reply([b'data: {"choices":[]}\n\n', b"data: [DONE]\n\n"])
        return Reply(200, (("Content-Type", "application/json"),), body=body)

    routes = {"cache": {"ttl_s": 60}}
    gw = await pipeline(policy({"main": {"url": URL}}, routes), main, clock=FakeClock())
    assert (await gw.post("/v1/chat/completions", chat(temperature=0))).body == body
    answer = await gw.post("/v1/chat/completions", chat(temperature=0, stream=True))
    assert answer.status_code == 200 and answer.complete and len(calls) == 2
