"""KServe / Triton open inference protocol v2 ``POST /v2/models/{m}/infer`` (JSON only).

Requests are merged by concatenating every named input along its first dimension, which
needs the same input names, datatypes, other dimensions and input parameters in every
request (all part of the compat key, with the request's ``parameters`` and ``outputs``).
Tensor ``data`` may be flat (row-major) or nested; a merged input is nested only when every
part was, otherwise flat.  Each output of the answer is cut along its first dimension, which
must equal the number of rows sent: a model whose outputs are not batched that way must not
be batched.  The binary tensor extension (``binary_data_size``/``binary_data``) is left
alone.  A request's ``id`` stays out of the key and is echoed back to its own caller.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

from gateway.batching.adapters.base import canonical
from gateway.errors import BatchSplitError


def _flatten(data: list[Any]) -> list[Any]:
    if not data or not isinstance(data[0], list):
        return data
    out: list[Any] = []
    for row in data:
        out.extend(_flatten(row))
    return out


def _nested(data: list[Any], shape: Sequence[int]) -> bool:
    """True when ``data`` is a list of rows rather than flat row-major values."""
    return len(shape) > 1 and bool(data) and isinstance(data[0], list)


def _valid_tensor(tensor: Any) -> bool:
    if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
        return False
    shape, data = tensor.get("shape"), tensor.get("data")
    if not isinstance(shape, list) or not shape or not isinstance(data, list):
        return False
    if not all(isinstance(d, int) and d >= 0 for d in shape) or shape[0] < 1:
        return False
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict) or "binary_data_size" in params:
        return False
    expected = shape[0] if _nested(data, shape) else math.prod(shape)
    return len(data) == expected


def _rows(tensor: dict[str, Any], counts: Sequence[int]) -> list[dict[str, Any]]:
    shape, data = tensor.get("shape"), tensor.get("data")
    if not isinstance(shape, list) or not shape or not isinstance(data, list):
        raise BatchSplitError(f"output {tensor.get('name')!r} has no shape or data")
    if shape[0] != sum(counts):
        raise BatchSplitError(
            f"output {tensor.get('name')!r} has {shape[0]} rows for {sum(counts)} inputs"
        )
    per_row = 1 if _nested(data, shape) else math.prod(shape[1:])
    if len(data) != shape[0] * per_row:
        raise BatchSplitError(f"output {tensor.get('name')!r} data does not match its shape")
    out, at = [], 0
    for c in counts:
        out.append({**tensor, "shape": [c, *shape[1:]], "data": data[at : at + c * per_row]})
        at += c * per_row
    return out


class KServeInfer:
    """``POST /v2/models/{m}/infer`` with JSON tensors."""

    name = "kserve-v2-infer"
    opaque_arrays = False  # split slices the data arrays

    def batchable(self, body: Any) -> bool:
        if not isinstance(body, dict):
            return False
        inputs = body.get("inputs")
        if not isinstance(inputs, list) or not inputs or not all(map(_valid_tensor, inputs)):
            return False
        if len({t["name"] for t in inputs}) != len(inputs):
            return False
        if len({t["shape"][0] for t in inputs}) != 1:
            return False
        for out in body.get("outputs") or ():
            if isinstance(out, dict) and "binary_data" in (out.get("parameters") or {}):
                return False
        return not (body.get("parameters") or {}).get("binary_data_output")

    def compat_key(self, body: Any) -> Hashable:
        tensors = tuple(
            sorted(
                (t["name"], t.get("datatype"), tuple(t["shape"][1:]), canonical(t, _TENSOR_DATA))
                for t in body["inputs"]
            )
        )
        return (tensors, canonical(body, ("inputs", "id")))

    def items(self, body: Any) -> list[Any]:
        """One dict per row: input name -> that row's flat values."""
        rows: list[dict[str, Any]] = [{} for _ in range(self.count(body))]
        for tensor in body["inputs"]:
            for i, part in enumerate(_rows(tensor, [1] * len(rows))):
                rows[i][tensor["name"]] = _flatten(part["data"])
        return rows

    def count(self, body: Any) -> int:
        return int(body["inputs"][0]["shape"][0])

    def merge(self, bodies: Sequence[Any]) -> Any:
        merged = {k: v for k, v in bodies[0].items() if k != "id"}
        inputs = []
        for first in bodies[0]["inputs"]:
            name = first["name"]
            parts = [next(t for t in body["inputs"] if t["name"] == name) for body in bodies]
            nested = all(_nested(p["data"], p["shape"]) for p in parts)
            data: list[Any] = []
            for part in parts:
                data.extend(part["data"] if nested else _flatten(part["data"]))
            rows = sum(p["shape"][0] for p in parts)
            inputs.append({**first, "shape": [rows, *first["shape"][1:]], "data": data})
        merged["inputs"] = inputs
        return merged

    def split(self, status: int, response: Any, bodies: Sequence[Any]) -> list[Any]:
        if not isinstance(response, dict) or not isinstance(response.get("outputs"), list):
            raise BatchSplitError("the backend's infer answer has no outputs list")
        counts = [self.count(b) for b in bodies]
        per_output = [_rows(t, counts) for t in response["outputs"] if isinstance(t, dict)]
        answers = []
        for i, body in enumerate(bodies):
            answer = {k: v for k, v in response.items() if k != "id"}
            if "id" in body:
                answer["id"] = body["id"]
            answer["outputs"] = [rows[i] for rows in per_output]
            answers.append(answer)
        return answers


_TENSOR_DATA = ("data", "shape", "name", "datatype")
