"""Hugging Face Text Embeddings Inference ``POST /embed``: ``inputs`` -> a bare list of vectors.

``inputs`` is a string, a list of strings, or token ids; the answer is a JSON list with one
vector per input, in input order (TEI answers a single string with a list of one vector).
Every other field (``normalize``, ``truncate``, ``truncation_direction``, ``prompt_name``)
is part of the compat key.  Keep the route's ``max_size`` at or below the server's
``--max-client-batch-size`` (32 by default); a 413 from a merged call is bisected anyway.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from gateway.batching.adapters.base import canonical, slices, text_or_tokens
from gateway.errors import BatchSplitError


class TEIEmbed:
    """``POST /embed`` of TEI."""

    name = "tei-embed"
    opaque_arrays = True

    def batchable(self, body: Any) -> bool:
        return isinstance(body, dict) and text_or_tokens(body.get("inputs")) is not None

    def compat_key(self, body: Any) -> Hashable:
        kind = text_or_tokens(body.get("inputs"))
        return (kind[0] if kind else None, canonical(body, ("inputs",)))

    def items(self, body: Any) -> list[Any]:
        kind = text_or_tokens(body.get("inputs"))
        return kind[1] if kind else []

    def count(self, body: Any) -> int:
        value = body.get("inputs")
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return 1
        return len(value) if isinstance(value, list) else 0

    def merge(self, bodies: Sequence[Any]) -> Any:
        merged = dict(bodies[0])
        inputs: list[Any] = []
        for body in bodies:
            inputs.extend(self.items(body))
        merged["inputs"] = inputs
        return merged

    def split(self, status: int, response: Any, bodies: Sequence[Any]) -> list[Any]:
        if not isinstance(response, list):
            raise BatchSplitError("the backend's /embed answer is not a list of vectors")
        return slices(response, [self.count(b) for b in bodies])
