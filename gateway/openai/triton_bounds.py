"""Triton's ``infer`` bounded as its ``generate`` is (a route's ``generation``), and Triton's
bodies read as Triton reads them.

TensorRT-LLM's models take a call's output bound as an input tensor, ``max_tokens``, and
vLLM's backend for Triton as the JSON text of its ``sampling_parameters`` tensor or as the
request's ``parameters.max_tokens``.  On ``/v2/models/<m>[/versions/<v>]/infer`` (KServe
V2, which Triton serves beside its generate extension) a call naming more than a route's
``max_tokens`` in any of them is clamped to it, or refused (``over: refuse``), as at
``generate``; a value below 1, or not an integer, is a 400 (TensorRT-LLM and vLLM refuse it
too).  Both framings Triton reads are read and written back as they came: JSON (a tensor's
``data`` flat or nested as its shape) and the binary tensor extension
(``Inference-Header-Content-Length`` bytes of JSON, then the data of each input whose
``parameters`` give a ``binary_data_size``, in their order, little-endian; a ``BYTES``
element is a 4-byte length, then its bytes).  A bounded tensor in shared memory
(``shared_memory_region``) cannot be read, so it is refused under a bound, as a compressed
body naming one is, and one in a coding the gateway does not decode (a 415).

A call naming none is sent as it came: TensorRT-LLM requires ``max_tokens``, and vLLM's
default is 16 tokens.  Any other model's call (an image, a vector) goes untouched: a body is
read only when its JSON names one of those tensors (a byte scan; a ``\\u`` escape, which
could spell one, has it read too).

Triton reads JSON with RapidJSON, whose lookup finds the first of two members of one name
where Python's parser keeps the last: a body naming a member twice
(``"parameters": {"max_tokens": 5000, "max_tokens": 10}``) would be bounded in one and
generate the other, so under a bound such a body is a 400 on Triton's paths
(``single_members``), at ``generate`` too.
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Callable
from typing import Any

from gateway.errors import (
    BadRequest,
    FieldRefused,
    RequestError,
    UnsupportedEncoding,
    integer_field,
    shown,
)
from gateway.openai.body import YIELD_FROM_BYTES, decode, dumps, loads, loads_yielding
from gateway.pipeline import Call, Headers
from gateway.policy.generation import Generation

FRAMED = "Inference-Header-Content-Length"
TENSOR = "max_tokens"  # TensorRT-LLM's
TEXTS = "sampling_parameters"  # vLLM's backend's: the JSON text of its sampling parameters
_SCANNED = (TENSOR.encode(), TEXTS.encode(), b"\\u")
_INTEGERS = {
    "INT8": "b",
    "UINT8": "B",
    "INT16": "h",
    "UINT16": "H",
    "INT32": "i",
    "UINT32": "I",
    "INT64": "q",
    "UINT64": "Q",
}
"""Triton's integer datatypes, as ``struct`` reads them."""
READER = "this route bounds what a call may generate"

Clamp = Callable[[Any, str], int | None]
"""A value read under a bound, and the field it was read in: the value to write instead
(None: as it is); ``FieldRefused`` for one refused."""


def single_members(raw: bytes) -> None:
    """``BadRequest`` for JSON (read already, so valid and bounded) naming a member twice in
    one object, at any depth: RapidJSON reads the first of them, the gateway the last."""

    def pairs(items: list[tuple[str, Any]]) -> None:
        seen: set[str] = set()
        for name, _ in items:  # one pass: an object may hold 100,000 members
            if name in seen:
                raise BadRequest(f"the body names {shown(name)} twice in one object: send it once")
            seen.add(name)

    json.loads(raw, object_pairs_hook=pairs)


async def _read(call: Call) -> tuple[dict[str, Any], list[Any], bytes] | None:
    """An ``infer`` call's JSON, its ``inputs`` and its binary data, when its JSON names a
    bounded tensor (None: it names none, or no list of inputs, Triton's to refuse);
    ``RequestError`` for one that cannot be read as Triton reads it."""
    raw, compressed = call.body, call.header("Content-Encoding") not in (None, "identity")
    if compressed:
        raw = decode(raw, call.header("Content-Encoding") or "", call.policy.server.max_body_bytes)
    length = _header_length(call.header(FRAMED), len(raw))
    head = raw[:length]
    if not await _names_in(head):
        return None
    if compressed:
        raise UnsupportedEncoding(f"{READER}: send the body uncompressed")
    data = await loads_yielding(head, call.policy.server.max_json_values)
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    single_members(head)
    inputs = data.get("inputs")
    return (data, inputs, raw[length:]) if isinstance(inputs, list) else None


async def infer_bound(call: Call) -> int:
    """The most tokens an ``infer`` call may generate, as its tensors bound it: the values
    of its ``max_tokens`` tensor (one a row of a batch), else of its ``sampling_parameters``
    texts, else its ``parameters.max_tokens``, added up (none, or a body the gateway cannot
    read: 0), for a token limit's estimate."""
    try:
        read = await _read(call)
        if read is None:
            return 0
        asked: list[int] = []

        def counted(value: Any, _: str) -> None:
            asked.append(value if isinstance(value, int) and value > 0 else 0)

        _bounded_inputs(read[1], read[2], counted, call)
    except RequestError:  # the backend's to refuse, as it was sent
        return 0
    parameters = read[0].get("parameters")
    if not asked and isinstance(parameters, dict):
        counted(parameters.get(TENSOR), TENSOR)
    return sum(asked)


async def bounded_infer(call: Call, bounds: Generation) -> tuple[bytes, Headers, int] | None:
    """The body and headers an ``infer`` call is sent with under ``bounds``, and the bound
    written (None: it goes as it came); ``RequestError`` for a call refused."""
    most = bounds.max_tokens
    if most is None:  # a default is never written here (see the module docstring)
        return None
    read = await _read(call)
    if read is None:
        return None
    data, inputs, blob = read
    clamp = _clamping(most, bounds.over == "refuse")
    changed, written, rest = _bounded_inputs(inputs, blob, clamp, call)
    parameters = data.get("parameters")
    if isinstance(parameters, dict) and parameters.get(TENSOR) is not None:
        value = clamp(parameters[TENSOR], f"parameters.{TENSOR}")
        if value is not None:
            data["parameters"], changed = {**parameters, TENSOR: value}, True
    if not changed:
        return None
    data["inputs"] = [one for one, _ in written]
    head = dumps(data)
    if call.header(FRAMED) is None:
        return head, call.headers, most
    blob = b"".join(piece for _, piece in written) + rest
    headers = tuple(
        (name, str(len(head)) if name.lower() == FRAMED.lower() else value)
        for name, value in call.headers
    )
    return head + blob, headers, most


async def _names_in(head: bytes) -> bool:
    """Whether ``head`` holds a bounded tensor's name (or an escape that could spell one):
    scanned a ``YIELD_FROM_BYTES`` window at a time, the event loop run between them (8 MB
    of an image's JSON takes 14 ms to scan for the three)."""
    overlap = max(map(len, _SCANNED)) - 1
    for start in range(0, len(head), YIELD_FROM_BYTES):
        end = start + YIELD_FROM_BYTES + overlap
        if any(head.find(name, start, end) >= 0 for name in _SCANNED):
            return True
        if end < len(head):
            await asyncio.sleep(0)
    return False


def _header_length(given: str | None, size: int) -> int:
    """The length of a body's JSON: its ``Inference-Header-Content-Length``, else all of it."""
    if given is None:
        return size
    if not (given.isascii() and given.isdigit() and len(given) <= 18) or int(given) > size:
        raise BadRequest(f"{FRAMED} must be the length of the body's JSON, at most {size}")
    return int(given)


def _clamping(most: int, refuse: bool) -> Clamp:
    def clamp(asked: Any, name: str) -> int | None:
        value = integer_field(asked, name)
        if value < 1:
            raise FieldRefused(
                f"Invalid '{name}': {value}; it must be at least 1", name, "integer_below_min_value"
            )
        if value <= most:
            return None
        if refuse:
            raise FieldRefused(
                f"'{name}' is {value}; this route allows at most {most} output tokens",
                name,
                "integer_above_max_value",
            )
        return most

    return clamp


def _bounded_inputs(
    inputs: list[Any], blob: bytes, clamp: Clamp, call: Call
) -> tuple[bool, list[tuple[Any, bytes]], bytes]:
    """Whether any input changed, each input as it is sent with its binary data (``b""``
    for none), and the binary data past the last input's, kept after it."""
    written: list[tuple[Any, bytes]] = []
    changed, at = False, 0
    for one in inputs:
        params = one.get("parameters") if isinstance(one, dict) else None
        params = params if isinstance(params, dict) else {}
        size = params.get("binary_data_size")
        if size is not None and (not isinstance(size, int) or size < 0 or at + size > len(blob)):
            raise BadRequest(f"an input's binary_data_size ({size}) is past the body's data")
        piece = blob[at : at + size] if size is not None else b""
        at += size or 0
        name = one.get("name") if isinstance(one, dict) else None
        if name not in (TENSOR, TEXTS):
            written.append((one, piece))
            continue
        if "shared_memory_region" in params:
            raise BadRequest(f"{READER}: send '{name}' in the body, not in shared memory")
        sent = _tensor(one, piece, size is not None, clamp, call)
        if sent is not None:
            changed, (one, piece) = True, sent
            if size is not None:
                one = {**one, "parameters": {**params, "binary_data_size": len(piece)}}
        written.append((one, piece))
    return changed, written, blob[at:]


def _tensor(
    one: dict[str, Any], piece: bytes, binary: bool, clamp: Clamp, call: Call
) -> tuple[dict[str, Any], bytes] | None:
    """A bounded input (``max_tokens``, ``sampling_parameters``) as it is sent, with its
    binary data (None: as it came)."""
    name, datatype = one["name"], one.get("datatype")
    if name == TENSOR:
        fmt = _INTEGERS.get(datatype) if isinstance(datatype, str) else None
        if fmt is None:
            raise FieldRefused(
                f"'{name}' is a {shown(str(datatype))} tensor; a bound is an integer one",
                name,
                "invalid_type",
            )
        if binary:
            width = struct.calcsize(fmt)
            if len(piece) % width:
                raise BadRequest(f"'{name}' holds {len(piece)} bytes, not {datatype} values")
            values = list(struct.unpack(f"<{len(piece) // width}{fmt}", piece))
            sent = [clamp(value, name) for value in values]
            if not any(value is not None for value in sent):
                return None
            new = [value if low is None else low for value, low in zip(values, sent, strict=True)]
            return one, struct.pack(f"<{len(new)}{fmt}", *new)
        mapped = _mapped(one.get("data"), lambda value: clamp(value, name))
        return None if mapped is None else ({**one, "data": mapped}, piece)
    if datatype != "BYTES":
        raise FieldRefused(f"'{name}' must be a BYTES tensor", name, "invalid_type")
    limit = call.policy.server.max_json_values
    if binary:
        texts = _bytes_elements(piece, name)
        bounded = [_parameters_text(text, clamp, limit) for text in texts]
        if not any(text is not None for text in bounded):
            return None
        elements = [old if low is None else low for old, low in zip(texts, bounded, strict=True)]
        return one, b"".join(struct.pack("<I", len(text)) + text for text in elements)

    def each(text: Any) -> Any:
        if not isinstance(text, str):
            raise FieldRefused(f"'{name}' holds the JSON text of an object", name, "invalid_type")
        sent = _parameters_text(text.encode(), clamp, limit)
        return None if sent is None else sent.decode()

    mapped = _mapped(one.get("data"), each)
    return None if mapped is None else ({**one, "data": mapped}, piece)


def _mapped(data: Any, change: Callable[[Any], Any]) -> Any:
    """``data`` (a tensor's values, flat or nested) with each value ``change`` changes
    (None: none changed)."""
    if not isinstance(data, list):
        return change(data)
    sent = [_mapped(value, change) for value in data]
    if all(value is None for value in sent):
        return None
    return [old if new is None else new for old, new in zip(data, sent, strict=True)]


def _bytes_elements(piece: bytes, name: str) -> list[bytes]:
    """A binary ``BYTES`` tensor's elements: each a 4-byte little-endian length, then that
    many bytes."""
    texts, at = [], 0
    while at < len(piece):
        if at + 4 > len(piece):
            raise BadRequest(f"'{name}' ends inside an element's length")
        (size,) = struct.unpack_from("<I", piece, at)
        if at + 4 + size > len(piece):
            raise BadRequest(f"'{name}' ends inside an element")
        texts.append(piece[at + 4 : at + 4 + size])
        at += 4 + size
    return texts


def _parameters_text(text: bytes, clamp: Clamp, limit: int) -> bytes | None:
    """One ``sampling_parameters`` text with its ``max_tokens`` bounded (None: as it came)."""
    field = f"{TEXTS}.{TENSOR}"
    try:
        data = loads(text, limit)
    except BadRequest as exc:
        raise BadRequest(f"'{TEXTS}' is not the JSON text of an object: {exc}") from exc
    if not isinstance(data, dict):
        raise BadRequest(f"'{TEXTS}' is not the JSON text of an object")
    asked = data.get(TENSOR)
    value = clamp(asked, field) if asked is not None else None
    return None if value is None else dumps({**data, TENSOR: value})
