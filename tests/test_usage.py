"""Token counts read from OpenAI ``usage``: whole bodies and SSE streams."""

from __future__ import annotations

import json

from gateway.openai.usage import StreamUsage, from_body


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
