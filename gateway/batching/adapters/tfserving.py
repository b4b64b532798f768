"""TensorFlow Serving REST ``POST /v1/models/{m}:predict``: ``instances`` -> ``predictions``.

Only the row format is merged.  The columnar format (``inputs`` -> ``outputs``) is left
alone (``batchable`` is False): its tensors may be batched along any axis the signature
chooses, which the gateway cannot know.  ``signature_name`` and every other non-input field
is part of the compat key, and so is the form of the instances (named inputs and their
nested shapes, or the shape of a bare value), since TF Serving stacks instances into one
tensor and rejects ragged ones.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from gateway.batching.adapters.base import canonical, slices
from gateway.errors import BatchSplitError


def _shape(value: Any) -> tuple[int, ...]:
    dims: list[int] = []
    while isinstance(value, list):
        dims.append(len(value))
        value = value[0] if value else None
    return tuple(dims)


def _form(instance: Any) -> Hashable:
    if isinstance(instance, dict) and "b64" not in instance:
        return tuple(sorted((k, _shape(v)) for k, v in instance.items()))
    return _shape(instance)


class TFServingPredict:
    """``POST /v1/models/{m}:predict`` with ``instances``."""

    name = "tfserving-predict"
    opaque_arrays = False  # split slices the data arrays

    def batchable(self, body: Any) -> bool:
        if not isinstance(body, dict) or "inputs" in body:
            return False
        instances = body.get("instances")
        if not isinstance(instances, list) or not instances:
            return False
        first = _form(instances[0])
        return all(_form(i) == first for i in instances[1:])

    def compat_key(self, body: Any) -> Hashable:
        return (_form(body["instances"][0]), canonical(body, ("instances",)))

    def items(self, body: Any) -> list[Any]:
        return list(body["instances"])

    def count(self, body: Any) -> int:
        return len(body["instances"])

    def merge(self, bodies: Sequence[Any]) -> Any:
        merged = dict(bodies[0])
        merged["instances"] = [i for body in bodies for i in body["instances"]]
        return merged

    def split(self, status: int, response: Any, bodies: Sequence[Any]) -> list[Any]:
        if not isinstance(response, dict) or not isinstance(response.get("predictions"), list):
            raise BatchSplitError("the backend's :predict answer has no predictions list")
        parts = slices(response["predictions"], [self.count(b) for b in bodies])
        return [{**response, "predictions": part} for part in parts]
