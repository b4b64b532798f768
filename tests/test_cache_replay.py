"""Stored answers replayed as streams and streams assembled into answers; entry encoding."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.cache.entry import CachedResponse, dumps, loads, select_headers
from gateway.openai.sse import (
    StreamRecorder,
    event_data,
    events_to_json,
    json_to_events,
    parse_sse,
    render_sse,
)

CHAT_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "m",
    "system_fingerprint": "fp",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "The capital of France is Paris, "
                "a city on the Seine with a long history.",
            },
            "logprobs": None,
            "finish_reason": "stop",
        }
    ],
    "usage": {"prompt_tokens": 5, "completion_tokens": 14, "total_tokens": 19},
}
TOOL_ANSWER: dict[str, Any] = {
    "id": "chatcmpl-2",
    "object": "chat.completion",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "weather",
                            "arguments": '{"city": "Paris", "unit": "c"}',
                        },
                    },
                ],
            },
            "logprobs": None,
            "finish_reason": "tool_calls",
        }
    ],
}
TEXT_ANSWER: dict[str, Any] = {
    "id": "cmpl-1",
    "object": "text_completion",
    "created": 1700000000,
    "model": "m",
    "choices": [
        {
            "index": 0,
            "text": " Paris is the capital of France.",
            "logprobs": None,
            "finish_reason": "stop",
        },
        {"index": 1, "text": " Lyon.", "logprobs": None, "finish_reason": "length"},
    ],
    "usage": {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11},
}


def payloads(events: tuple[str, ...]) -> list[str]:
    """The data of stored event blocks, ``[DONE]`` left out."""
    return [d for e in events if (d := event_data(e)) is not None and d != "[DONE]"]


def test_chat_answer_replays_as_chunked_stream() -> None:
    events = json_to_events(CHAT_ANSWER)
    assert events[-1] == "data: [DONE]\n\n"
    chunks = [json.loads(e) for e in payloads(events)]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "chatcmpl-1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:-2]]
    assert len(contents) >= 3
    assert "".join(contents) == CHAT_ANSWER["choices"][0]["message"]["content"]
    assert chunks[-2]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
    }
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 19


@pytest.mark.parametrize("answer", [CHAT_ANSWER, TOOL_ANSWER, TEXT_ANSWER])
def test_json_to_stream_and_back_is_lossless(answer: dict[str, Any]) -> None:
    assert events_to_json(json_to_events(answer)) == answer


def test_stream_without_usage_when_not_requested() -> None:
    events = json_to_events(CHAT_ANSWER, include_usage=False)
    assert all(json.loads(e)["choices"] for e in payloads(events))
    wire = render_sse(json_to_events(CHAT_ANSWER), include_usage=False)
    assert b'"usage"' not in wire and wire.endswith(b"data: [DONE]\n\n")


def test_recorder_stores_a_completed_stream_and_renders_it_back() -> None:
    wire = render_sse(json_to_events(CHAT_ANSWER))
    recorder = StreamRecorder()
    for i in range(0, len(wire), 7):  # arbitrary network chunking
        recorder.feed(wire[i : i + 7])
    events = recorder.result()
    assert events is not None and render_sse(events) == wire
    assert events_to_json(events) == CHAT_ANSWER


@pytest.mark.parametrize(
    "mutate",
    [
        lambda w: w[: w.rindex(b"data: [DONE]")],  # cut off before [DONE]
        lambda w: w[: len(w) // 2],  # cut off mid-stream
        lambda w: w.replace(b"data: [DONE]", b'data: {"error":{"message":"boom"}}\n\ndata: [DONE]'),
        lambda w: w.replace(b'"finish_reason":"stop"', b'"finish_reason":null'),
        lambda w: b"",
    ],
    ids=["no-done", "truncated", "error-event", "no-finish-reason", "empty"],
)
def test_recorder_never_stores_incomplete_or_failed_streams(mutate: Any) -> None:
    recorder = StreamRecorder()
    recorder.feed(mutate(render_sse(json_to_events(CHAT_ANSWER))))
    assert recorder.result() is None


def test_recorder_gives_up_past_its_byte_bound() -> None:
    recorder = StreamRecorder(max_bytes=100)
    recorder.feed(render_sse(json_to_events(CHAT_ANSWER)))
    assert recorder.result() is None and "overflowed=True" in repr(recorder)


def test_parse_sse_handles_crlf_comments_and_multiline_data() -> None:
    raw = b': keep-alive\r\n\r\ndata: {"a":\r\ndata: 1}\r\n\r\ndata:[DONE]\r\n\r\n'
    assert parse_sse(raw) == ['{"a":\n1}', "[DONE]"]


def test_stream_assembly_merges_tool_call_argument_deltas() -> None:
    events = json_to_events(TOOL_ANSWER, chunk_chars=4)
    deltas = [json.loads(e)["choices"][0]["delta"] for e in payloads(events)]
    assert sum(1 for d in deltas if "tool_calls" in d) > 3
    assert events_to_json(events)["choices"][0]["message"]["tool_calls"][0]["function"] == {
        "name": "weather",
        "arguments": '{"city": "Paris", "unit": "c"}',
    }


def entry(**over: Any) -> CachedResponse:
    fields: dict[str, Any] = dict(
        status=200,
        headers=(("content-type", "application/json"),),
        body=b'{"a":1}',
        events=None,
        created_at=1.5,
        backend="main",
        model_version="v1",
        route="r",
        scope="s",
        prompt="hi",
        context="c",
        fingerprint=2**64 - 1,
    )
    return CachedResponse(**(fields | over))


@pytest.mark.parametrize(
    "value",
    [
        entry(),
        entry(body=b"x" * 5000),
        entry(body=None, events=("{}", '{"b":2}')),
        entry(prompt=None, context=None, fingerprint=None),
    ],
    ids=["json", "compressed", "stream", "no-near"],
)
def test_entry_serialisation_round_trips(value: CachedResponse) -> None:
    data = dumps(value)
    assert loads(data) == value
    if value.body and len(value.body) > 1024:
        assert len(data) < len(value.body)


def test_entry_holds_exactly_one_of_body_and_events() -> None:
    with pytest.raises(ValueError):
        entry(events=("{}",))
    with pytest.raises(ValueError):
        entry(body=None)
    with pytest.raises(ValueError, match="corrupt"):
        loads(b"GWC1 garbage")


def test_only_selected_headers_are_stored() -> None:
    headers = [("Content-Type", "application/json"), ("Set-Cookie", "x"), ("Date", "now")]
    assert select_headers(headers) == (("Content-Type", "application/json"),)
