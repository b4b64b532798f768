"""Token counts read from OpenAI ``usage``: whole bodies and SSE streams."""

from __future__ import annotations

import json
from typing import Any

from gateway.openai.usage import MAX_LINE_BYTES, StreamUsage, from_body


def test_usage_is_read_from_the_key_not_from_text_inside_the_answer():
    body = json.dumps(
        {
            "choices": [{"message": {"content": 'say "usage": {"prompt_tokens": 99}'}}],
            "usage": {"completion_tokens": 4, "prompt_tokens": 3},
        }
    ).encode()
    assert from_body(body) == (3, 4)


def test_missing_or_null_usage_counts_nothing():
    assert from_body(b'{"choices": []}') is None
    assert from_body(b'{"usage": null}') is None


def test_stream_usage_chunk_is_found_across_chunk_boundaries():
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}\n\n'
    usage = StreamUsage()
    usage.feed(b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n')
    usage.feed(event[:20])
    usage.feed(event[20:] + b"data: [DONE]\n\n")
    assert usage.counts == (7, 9)


def test_a_usage_chunk_split_anywhere_is_found():
    """However the transport splits the stream, even a byte at a time, the usage chunk
    is read (a split marker, or a line split before its ``data:``)."""
    content = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
    last = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9}}\n\n'
    stream = content * 3 + last + b"data: [DONE]\n\n"
    for size in (1, 2, 3, 5, 13):
        usage = StreamUsage()
        for at in range(0, len(stream), size):
            usage.feed(stream[at : at + size])
        assert usage.counts == (7, 9), size


def test_the_usage_at_the_end_of_a_very_long_event_is_read_and_memory_stays_bounded():
    """The Responses API's ``response.completed`` repeats the whole answer before its
    ``usage``: past ``MAX_LINE_BYTES`` only the line's end is held, and read."""
    answer: dict[str, Any] = {"type": "response.completed", "response": {"output": []}}
    answer["response"]["output"].append({"text": "x" * 300_000})
    answer["response"]["usage"] = {"input_tokens": 12, "output_tokens": 34000}
    stream = b"event: response.completed\ndata: " + json.dumps(answer).encode() + b"\n\n"
    usage = StreamUsage()
    for at in range(0, len(stream), 4096):
        usage.feed(stream[at : at + 4096])
        assert len(usage._partial) <= MAX_LINE_BYTES
    assert usage.counts == (12, 34000)
