"""The bounds of strict JSON on request bodies (``gateway.openai.body.loads``), at the
edges of the screens that decide which decoder runs: a number one digit or one exponent
digit past its bound is refused wherever it sits, and one within it is read as it is."""

from __future__ import annotations

import json
import random

import pytest

from gateway.errors import BadRequest
from gateway.openai.body import MAX_INT_DIGITS, loads


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
