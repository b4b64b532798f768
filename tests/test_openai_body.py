"""The bounds of strict JSON on request bodies (``gateway.openai.body.loads``), at the
edges of the screens that decide which decoder runs: a number one digit or one exponent
digit past its bound is refused wherever it sits, and one within it is read as it is."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from gateway.errors import BadRequest
from gateway.openai.body import (
    MAX_INT_DIGITS,
    PASS_BYTES,
    YIELD_FROM_BYTES,
    dumps,
    dumps_yielding,
    json_object,
    loads,
    utf8,
)


def body_with(number: str, *, padding: str = "") -> bytes:
    """A chat body with ``number`` as ``max_tokens`` after a long text (the screens scan
    the whole body, strings included)."""
    text = json.dumps(padding)
    return b'{"model": "m", "messages": [{"role": "user", "content": %s}], "max_tokens": %s}' % (
        text.encode(),
        number.encode(),
    )


@pytest.mark.parametrize("sign", ["", "-"])
@pytest.mark.parametrize("padding", ["", "the 12 apples cost 3e2 cents. " * 700])
def test_integers_are_read_up_to_their_digit_bound_and_refused_past_it(sign, padding):
    for digits in range(1, MAX_INT_DIGITS + 6):
        number = sign + "9" * digits
        if digits <= MAX_INT_DIGITS:
            assert loads(body_with(number, padding=padding))["max_tokens"] == int(number)
        else:
            with pytest.raises(BadRequest, match="digits"):
                loads(body_with(number, padding=padding))


@pytest.mark.parametrize(
    ("number", "value"),
    [
        ("1e308", 1e308),
        ("1E+308", 1e308),
        ("1e-400", 0.0),
        ("2.5e-07", 2.5e-07),
        ("1.5E0007", 1.5e7),
        ("1e99", 1e99),
        ("-1e308", -1e308),
    ],
)
def test_finite_floats_with_any_exponent_are_read(number, value):
    assert loads(body_with(number, padding="e100 E+999 words"))["max_tokens"] == value


@pytest.mark.parametrize("number", ["1e309", "1E+400", "-1e400", "1.5E0400", "9e99999"])
def test_floats_that_overflow_are_refused(number):
    with pytest.raises(BadRequest, match="overflows"):
        loads(body_with(number))


def test_numbers_spelled_every_way_in_strings_never_change_what_is_read():
    """Digits and exponents inside strings may send the body to the bounded decoder (a
    screen); the answer is the same either way."""
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("0123456789eE+-. ax") for _ in range(rng.randint(0, 80)))
        data = loads(body_with("7", padding=text))
        assert data["messages"][0]["content"] == text and data["max_tokens"] == 7


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice('aé"\\\u2028\n\t😀 ') for _ in range(rng.randrange(8)))
    if kind == "int":
        return rng.randrange(-(10**12), 10**12)
    if kind == "float":
        return rng.uniform(-1e6, 1e6)
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randrange(4))}


async def test_a_body_written_in_passes_is_the_body_written_at_once():
    """``dumps_yielding`` writes exactly ``dumps``'s bytes, which are compact UTF-8 JSON,
    whether the body is small (at once) or large (in passes)."""
    rng = random.Random(26)
    bodies: list[dict[str, Any]] = [{}, {"messages": []}, {"model": "m", "n": [[]]}]
    bodies += [{f"k{i}": random_value(rng) for i in range(6)} for _ in range(300)]
    for body in bodies:
        expected = json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()
        assert dumps(body) == expected
        assert await dumps_yielding(body, 0) == expected
        assert await dumps_yielding(body, YIELD_FROM_BYTES) == expected


async def test_a_large_body_is_written_with_the_event_loop_turning_between_passes():
    messages = [{"role": "user", "content": "word é " * 200} for _ in range(4000)]
    body = {"model": "m", "messages": messages, "temperature": 0}
    turns = 0

    async def beside() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(beside())
    await asyncio.sleep(0)
    written = await dumps_yielding(body, YIELD_FROM_BYTES)
    task.cancel()
    assert written == dumps(body)
    assert turns >= len(written.decode()) // PASS_BYTES  # once a pass of 256 Ki characters


@pytest.mark.parametrize(
    "encoding",
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"],
)
def test_a_json_object_is_told_in_every_encoding_pythons_parser_reads(encoding):
    for text in ('{"a": 1}', ' \r\n\t{"a": 1}'):
        body = text.encode(encoding)
        assert json.loads(body) == {"a": 1}  # what a lenient server reads
        assert json_object(body)
        assert utf8(body) == (encoding == "utf-8")
    for text in ('["a"]', '"a"', "1", "--boundary\r\n", "a {", ""):
        assert not json_object(text.encode(encoding))
    assert not json_object(b"\x00\x00\x00 \x00\x00\x00x")


@pytest.mark.parametrize(
    ("extra", "refused"),
    [
        ({"MODEL": "secret"}, True),  # a Go server (Ollama) reads the last spelling
        ({"Max_Tokens": 99999}, True),
        ({"metadata": {"ID": 1, "id": 2}}, False),  # nested: the client's own data
        ({"user": "u"}, False),
    ],
)
def test_a_member_named_under_two_spellings_is_refused(extra, refused):
    """Ollama's Go server matches a JSON key to its field case-insensitively, the last one
    winning: a body naming ``model`` and ``MODEL`` would be read one way by the gateway (the
    model a tenant may use, the bound it clamped) and the other by the server."""
    from gateway.openai.body import parse

    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
    ).encode()
    if not refused:
        assert parse("/v1/chat/completions", body)["model"] == "m"
        return
    with pytest.raises(BadRequest, match="twice"):
        parse("/v1/chat/completions", body)
