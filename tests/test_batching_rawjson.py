"""Arrays of numbers pass through a split answer byte for byte, and odd answers still split."""

from __future__ import annotations

import json

import pytest

from gateway.batching.rawjson import decode, encode


def test_number_arrays_are_kept_as_their_original_bytes():
    raw = b'{"data": [{"index": 0, "embedding": [0.10000000000000001, -2e-05]}], "n": [1]}'
    skeleton, arrays = decode(raw)
    assert arrays == [b"[0.10000000000000001, -2e-05]", b"[1]"]
    assert skeleton["data"][0]["index"] == 0
    assert (
        encode(skeleton, arrays)
        == b'{"data":[{"index":0,"embedding":[0.10000000000000001, -2e-05]}],"n":[1]}'
    )


@pytest.mark.parametrize(
    "raw",
    [
        b"[[1, 2], [3], []]",
        b'{"a": [{"b": [1]}, [2, [3]]], "c": "d"}',
        b'{"text": "x[1,2]y", "v": [1, 2]}',  # a bracket in a string: decoded whole
        b'{"s": "\\u0000 1", "v": [1]}',  # a NUL in a string: decoded whole
        b'[1, 2, "x", [4, true, null]]',
        b'{"none": []}',
    ],
)
def test_every_answer_round_trips_to_the_same_json(raw):
    skeleton, arrays = decode(raw)
    assert json.loads(encode(skeleton, arrays)) == json.loads(raw)


def test_brackets_inside_strings_fall_back_to_a_whole_decode():
    skeleton, arrays = decode(b'{"model": "bge[1]", "v": [1]}')
    assert arrays == [] and skeleton == {"model": "bge[1]", "v": [1]}


def test_invalid_json_raises_value_error():
    with pytest.raises(ValueError):
        decode(b"[1, 2")
