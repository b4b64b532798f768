"""What a caller of a batch gets back: its share of the upstream's answer, or that answer
as it came.

A 2xx answer to a merged call is split by the adapter into one answer per caller
(``split_answer``; with ``opaque_arrays`` the vectors pass through as raw bytes, never
decoded); any other answer is passed on unsplit, with the upstream's own body and content
type (``as_is``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.batching import rawjson
from gateway.batching.adapters import Adapter
from gateway.errors import BatchSplitError
from gateway.pipeline import Headers


@dataclass(frozen=True, slots=True)
class Answer:
    """One caller's answer: its share of a split answer, or the upstream's body as it came.

    ``body`` is ready to send.  ``split`` is False when the body is the upstream's own,
    passed through unsplit (an error for this caller alone, or for the whole call).
    """

    status: int
    body: bytes
    content_type: str = "application/json"
    split: bool = True

    @property
    def json(self) -> Any:
        """The body decoded (on every access), or None when it is not JSON."""
        try:
            return json.loads(self.body) if self.body else None
        except (ValueError, RecursionError):
            return None


def split_answer(adapter: Adapter, status: int, raw: bytes, bodies: Sequence[Any]) -> list[bytes]:
    """The upstream's answer to the merged ``bodies``, as one encoded answer per body."""
    try:
        if adapter.opaque_arrays:
            response, arrays = rawjson.decode(raw)
        else:
            response, arrays = json.loads(raw), []
        answers = adapter.split(status, response, bodies)
        return [rawjson.encode(answer, arrays) for answer in answers]
    except (ValueError, TypeError, KeyError, IndexError, RecursionError) as exc:
        raise BatchSplitError(f"the backend's answer cannot be split: {exc}") from exc


def as_is(status: int, headers: Headers, raw: bytes) -> Answer:
    """The upstream's answer passed on unsplit, with its own content type."""
    content_type = next((v for k, v in headers if k.lower() == "content-type"), "")
    return Answer(status, raw, content_type or "application/octet-stream", split=False)
