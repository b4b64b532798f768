"""The JSON bodies of OpenAI endpoints: decoded, parsed strictly and validated, so that
malformed requests are answered 400 at the gateway and never reach a backend.

Strict JSON is RFC 8259 without the extensions Python's parser allows, and bounded so that
nothing a client writes costs the gateway more than its size: UTF-8 only (UTF-16 and 32,
which Python would detect and read, are a 400), no ``NaN`` or ``Infinity``, no number that
overflows a float, no integer past ``MAX_INT_DIGITS`` digits, no nesting past
``MAX_DEPTH``, no lone surrogate escape (``"\ud800"`` cannot be encoded again), and at most
``server.max_json_values`` values, so that a body of a million ``{}`` cannot hold the event
loop for seconds and the memory for hundreds of MiB while it is parsed (json's parser holds
the GIL throughout, so a thread would stall the loop just as long: the bound is what keeps
a parse short).  The checks cost nothing on ordinary bodies: each has a fast screen over
the bytes (C speed) and runs in full only when the screen finds a candidate; the full
checks see the body without its strings (one split at the quotes), so brackets and commas
inside text never count.  The parse itself runs with the cyclic garbage collector paused:
a body of many containers otherwise sets it off again and again.

A body the gateway changes (a route's ``target_models``, the logprobs a quality fallback
asks for) is written again by ``dumps_yielding``: compact UTF-8 JSON, in passes with the
event loop run between them when the body is large, as it was read.

A body in ``Content-Encoding: gzip`` or ``deflate`` is decoded, never past the body cap (a
decompression bomb is a 413), and goes upstream decoded, without the header; any other
coding is a 415.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from typing import Any

from gateway.errors import BadRequest, BodyTooLarge, UnsupportedEncoding

MAX_DEPTH = 64
MAX_INT_DIGITS = 20
DEFAULT_MAX_VALUES = 500_000
YIELD_FROM_BYTES = 1024 * 1024
"""Bodies this large are parsed in passes with the event loop run between them."""
MEMBER_WEIGHT = 4
"""An object member counts as this many values: a fresh key costs about four values'
parse (measured: 1.2 us a member against 40-100 ns a value)."""
_SHAPES = bytes(
    0x30
    if 0x30 <= b <= 0x39
    else 0x65
    if b in b"eE"
    else 0x2B
    if b in b"+-"
    else 0x5B
    if b in b"[{"
    else b
    if b in b"\\u,:"
    else 0x20
    for b in range(256)
)
"""What the screens look for, in one pass over the body: every digit to ``0``, ``e``/``E``
to ``e``, ``+``/``-`` to ``+``, ``[``/``{`` to ``[``, ``\\``, ``u``, ``,`` and ``:`` as
they are, all else to a space."""
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)
_BRACKETS_ONLY = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` without its ``Content-Encoding`` (``gzip``, ``deflate``, ``identity``)."""
    coding = encoding.strip().lower()
    if coding in ("", "identity"):
        return body
    wbits = _WBITS.get(coding)
    if wbits is None:
        raise UnsupportedEncoding(
            f"Content-Encoding {encoding!r} is not decoded; send gzip, deflate or identity"
        )
    try:
        inflater = zlib.decompressobj(wbits)
        data = inflater.decompress(body, limit + 1)
        if len(data) > limit:
            raise BodyTooLarge(f"the decoded request body exceeds the limit of {limit} bytes")
        if not inflater.eof or inflater.unused_data:
            raise BadRequest(f"the {coding} request body is truncated or has trailing bytes")
    except zlib.error as exc:
        raise BadRequest(f"the request body is not valid {coding}: {exc}") from exc
    return data


def loads(body: bytes, max_values: int = DEFAULT_MAX_VALUES) -> Any:
    """``body`` parsed as strict JSON of at most ``max_values`` values (an object member
    counting ``MEMBER_WEIGHT``); ``BadRequest`` for anything else."""
    shapes = _shapes(body)
    # A byte holds at most MEMBER_WEIGHT values: a shorter body cannot pass the bound.
    if len(body) * MEMBER_WEIGHT >= max_values or shapes.count(b"[") > MAX_DEPTH:
        _bound(body, shapes, max_values)
    data = _decode(body, shapes)
    if b"\\u" in shapes:
        _surrogates(data)
    return data


async def loads_yielding(body: bytes, max_values: int = DEFAULT_MAX_VALUES) -> Any:
    """``loads``, letting the event loop run between its passes over a body of
    ``YIELD_FROM_BYTES`` or more: each pass over 16 MiB takes tens of milliseconds, and
    back to back they would hold every other request that long."""
    if len(body) < YIELD_FROM_BYTES:
        return loads(body, max_values)
    shapes = _shapes(body)
    for _ in _bounding(body, shapes, max_values):
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    data = _decode(body, shapes)
    if b"\\u" in shapes:
        await asyncio.sleep(0)
        _surrogates(data)
    return data


_ENCODE = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode
PASS_BYTES = 256 * 1024
"""How much JSON (in characters) ``dumps_yielding`` writes between turns of the event loop."""


def dumps(data: dict[str, Any]) -> bytes:
    """``data`` as the body it goes upstream as: compact JSON, UTF-8."""
    return _ENCODE(data).encode()


async def dumps_yielding(data: dict[str, Any], size_hint: int) -> bytes:
    """``dumps``, letting the event loop run between passes when the body it was parsed from
    (``size_hint`` bytes) is ``YIELD_FROM_BYTES`` or more: an 8 MiB conversation is written
    in about 70 ms, which back to back would hold every other request that long.  The
    passes follow the top-level members and the items of their arrays (the messages), so
    the bytes are ``dumps``'s exactly."""
    if size_hint < YIELD_FROM_BYTES:
        return dumps(data)
    parts: list[str] = []
    written = 0
    for index, (key, value) in enumerate(data.items()):
        parts.append(("{" if index == 0 else ",") + _ENCODE(key) + ":")
        items = value if isinstance(value, list) and value else None
        for at, item in enumerate(items if items is not None else (value,)):
            text = _ENCODE(item)
            if items is not None:
                text = ("[" if at == 0 else ",") + text
            parts.append(text)
            written += len(text)
            if written >= PASS_BYTES:
                written = 0
                await asyncio.sleep(0)
        if items is not None:
            parts.append("]")
    parts.append("}" if data else "{}")
    return "".join(parts).encode()


_OBJECT = re.compile(
    rb"(?:\xef\xbb\xbf)?[ \t\r\n]*\{"  # UTF-8, with or without a BOM
    rb"|(?:\xff\xfe)?(?:[ \t\r\n]\x00)*\{\x00"  # UTF-16 LE
    rb"|(?:\xff\xfe\x00\x00)?(?:[ \t\r\n]\x00\x00\x00)*\{\x00\x00\x00"  # UTF-32 LE
    rb"|(?:\xfe\xff)?(?:\x00[ \t\r\n])*\x00\{"  # UTF-16 BE
    rb"|(?:\x00\x00\xfe\xff)?(?:\x00\x00\x00[ \t\r\n])*\x00\x00\x00\{"  # UTF-32 BE
)


def json_object(body: bytes) -> bool:
    """Whether ``body`` opens as a JSON object in any encoding Python's parser reads (UTF-8
    with or without a BOM, UTF-16, UTF-32): the test of a body not typed as JSON that a
    lenient server may read as JSON all the same."""
    return _OBJECT.match(body) is not None


def utf8(body: bytes) -> bool:
    """Whether ``body``, read as JSON, is UTF-8: a search of its bytes finds its keys (in
    UTF-16 or 32 a NUL stands between their letters)."""
    if body[:1] == b"{" and body[1:2] != b"\0":  # most bodies, as in ``_shapes``
        return True
    return json.detect_encoding(body) == "utf-8"


def _shapes(body: bytes) -> bytes:
    """The body's screen (``_SHAPES``), once it is known to be UTF-8."""
    # A body that opens with "{" and then no NUL byte is UTF-8 (RFC 8259 8.1: UTF-16 and
    # 32 put a NUL beside the brace, a BOM comes first): most bodies skip json's detection.
    if body[:1] == b"{" and body[1:2] != b"\0":
        return body.translate(_SHAPES)
    encoding = json.detect_encoding(body)
    if encoding != "utf-8":
        raise BadRequest(f"a JSON body must be UTF-8 (RFC 8259), not {encoding}")
    return body.translate(_SHAPES)


def _bound(body: bytes, shapes: bytes, max_values: int) -> None:
    """Refuse a body past ``max_values`` values or ``MAX_DEPTH`` levels, counted without
    its strings' text, which is looked at only when the screen finds a candidate."""
    for _ in _bounding(body, shapes, max_values):
        pass


def _bounding(body: bytes, shapes: bytes, max_values: int) -> Iterator[None]:
    """``_bound`` in steps, each one pass over the body (tens of milliseconds on 16 MiB):
    it yields between them, where ``loads_yielding`` lets the event loop run."""
    nests = shapes.count(b"[") > MAX_DEPTH
    if not nests and len(body) * MEMBER_WEIGHT < max_values:
        return
    yield
    if not nests and _values(shapes) <= max_values:
        return
    yield
    structure = _structure(body)  # counted again without the strings' text
    yield
    if _values(structure) > max_values:
        raise BadRequest(
            f"the JSON body holds more than {max_values} values (server.max_json_values)"
        )
    if nests:
        yield
        if _depth_over(structure):
            raise BadRequest(f"the JSON body nests deeper than {MAX_DEPTH} levels")


def _decode(body: bytes, shapes: bytes) -> Any:
    decoder = _BOUNDED if _long_number(shapes) else _STRICT
    collecting = gc.isenabled()
    gc.disable()  # a body of many containers would set the collector off again and again
    try:
        # json.loads(body, **hooks) would build a decoder per call; these are built once
        return decoder.decode(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    except (ValueError, RecursionError) as exc:  # the hooks' refusals, a digit limit
        raise BadRequest(f"request body is not acceptable JSON: {exc}") from exc
    finally:
        if collecting:
            gc.enable()


def _surrogates(data: Any) -> None:
    """Refuse a lone surrogate escape (``"\\ud800"`` cannot be encoded again)."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest("request body has a lone surrogate escape (\\ud800-\\udfff)") from exc


def _long_number(shapes: bytes) -> bool:
    """Whether the body (as ``_SHAPES``) holds a run of more than ``MAX_INT_DIGITS`` digits
    or an exponent of three digits or more (anywhere, strings included: a screen).  The
    regular expression ``\\d{21}|[eE][+-]?\\d{3}`` says the same, but the regex engine tries
    it at every byte (0.8 ms on a 20 KB conversation, 17 times the JSON parse); substring
    searches run at memory speed, and both need three digits in a row."""
    return b"000" in shapes and (_LONG_RUN in shapes or b"e000" in shapes or b"e+000" in shapes)


def _values(text: bytes) -> int:
    """At least the values ``text`` (the body, or its structure) holds: one per comma and
    opening bracket, ``MEMBER_WEIGHT`` per member (on the body, an upper bound: commas and
    brackets inside strings count too)."""
    return text.count(b",") + MEMBER_WEIGHT * text.count(b":") + text.count(b"[") + 1


def _structure(body: bytes) -> bytes:
    """The body without its strings' text: the escaped backslashes and quotes blanked (in
    place, so that the rest keeps its shape), then every other stretch between quotes.  It
    costs a piece per string, and runs only when a screen found a candidate."""
    if b"\\" in body:
        body = body.replace(b"\\\\", b"__").replace(b'\\"', b"__")
    return b"".join(body.split(b'"')[0::2])


def _depth_over(structure: bytes) -> bool:
    """Whether the body (``_structure``) nests past ``MAX_DEPTH``: every round deletes the
    innermost bracket pairs, so a body ``MAX_DEPTH`` deep is gone after that many rounds,
    each a C-speed replace.  Unbalanced brackets are the parser's to refuse."""
    brackets = structure.translate(_BRACKETS_ONLY, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        if not brackets:
            return False
        shorter = brackets.replace(b"[]", b"")
        if len(shorter) == len(brackets):
            return False  # unbalanced: not JSON, which the parse says
        brackets = shorter
    return bool(brackets)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"the number {text[:20]} overflows")
    return value


_STRICT = json.JSONDecoder(parse_constant=_no_constant)
_BOUNDED = json.JSONDecoder(
    parse_constant=_no_constant, parse_int=_bounded_int, parse_float=_finite_float
)

_REQUIRED: dict[str, tuple[str, type | tuple[type, ...]]] = {
    "/v1/chat/completions": ("messages", list),
    "/v1/completions": ("prompt", (str, list)),
    "/v1/embeddings": ("input", (str, list)),
    "/v1/responses": ("input", (str, list)),
    "/v1/messages": ("messages", list),
    "/v1/messages/count_tokens": ("messages", list),
}
_MESSAGE_LISTS = frozenset({"/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens"})


def one_spelling(data: dict[str, Any]) -> None:
    """``BadRequest`` for an object naming one member under two spellings (``max_tokens``
    and ``MAX_TOKENS``).  A server written in Go (Ollama, its OpenAI API too) matches a
    JSON key to its field case-insensitively, the last one winning, so the gateway would
    read one value (the model a tenant may use, the bound it clamped) and the server the
    other."""
    if len(data) < 2 or len({key.lower() for key in data}) == len(data):
        return
    seen: dict[str, str] = {}
    for key in data:
        folded = key.lower()
        if folded in seen:
            raise BadRequest(
                f"the body names {seen[folded]!r} twice, also as {key!r}: send it once"
            )
        seen[folded] = key


async def native_object(
    raw: bytes, encoding: str | None, max_values: int, reader: str
) -> dict[str, Any]:
    """The JSON object of a call to a server's own API, where the gateway must read it
    (``reader``: why, in the 415's words).  Such a body is forwarded as sent, never decoded,
    so a compressed one is a 415; anything but one object naming each member once
    (``one_spelling``) is a 400."""
    if encoding not in (None, "identity"):
        raise UnsupportedEncoding(f"{reader}: send the body uncompressed")
    data = await loads_yielding(raw, max_values) if raw else None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    one_spelling(data)
    return data


def texts_read(
    data: dict[str, Any], names: Iterable[str], max_values: int
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """``data`` with each member of ``names`` that holds a JSON text (vLLM's backend for
    Triton reads ``sampling_parameters`` so) read into the object it holds, and the members
    read; a text that is not one JSON object is a 400."""
    read = tuple(name for name in names if isinstance(data.get(name), str))
    if not read:
        return data, read
    data = dict(data)
    for name in read:
        try:
            value = loads(data[name].encode(), max_values)
        except BadRequest as exc:
            raise BadRequest(f"'{name}' is not the JSON text of an object: {exc}") from exc
        if not isinstance(value, dict):
            raise BadRequest(f"'{name}' is not the JSON text of an object")
        one_spelling(value)
        data[name] = value
    return data, read


def texts_written(data: dict[str, Any], read: tuple[str, ...]) -> dict[str, Any]:
    """``data`` with the members ``texts_read`` read written back as JSON text."""
    return {**data, **{name: dumps(data[name]).decode() for name in read}} if read else data


def parse(path: str, body: bytes, max_values: int = DEFAULT_MAX_VALUES) -> dict[str, Any]:
    """The body as a JSON object, checked for what routing, caching and batching rely on."""
    if not body:
        raise BadRequest("request body is empty; this endpoint expects a JSON object")
    return checked(path, loads(body, max_values))


async def parse_yielding(
    path: str, body: bytes, max_values: int = DEFAULT_MAX_VALUES
) -> dict[str, Any]:
    """``parse``, letting the event loop run between its passes over a large body."""
    if not body:
        raise BadRequest("request body is empty; this endpoint expects a JSON object")
    return checked(path, await loads_yielding(body, max_values))


def checked(path: str, data: Any) -> dict[str, Any]:
    """``data`` if it is the object ``path`` expects, else ``BadRequest``."""
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    one_spelling(data)
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    field, kind = _REQUIRED[path]
    if field not in data:
        raise BadRequest(f"'{field}' is required")
    if not isinstance(data[field], kind):
        raise BadRequest(f"'{field}' has the wrong type")
    if path in _MESSAGE_LISTS:
        messages = data["messages"]
        if not messages or not all(isinstance(m, dict) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of message objects")
    return data
