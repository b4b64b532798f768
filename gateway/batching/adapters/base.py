"""What a batch adapter is, and the helpers the adapters share.

An adapter knows one array-taking API: which requests may share an upstream call (the
compat key), how many items a request carries, how to merge many bodies into one, and how to
split the merged answer back into one answer per caller.  Adapters are pure functions of
parsed JSON; the batcher owns time, concurrency and failures.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Protocol

from gateway.errors import BatchSplitError


class Adapter(Protocol):
    """One array-taking API, seen as a list of independent items per request."""

    name: str
    opaque_arrays: bool
    """True when ``split`` never looks inside an array of numbers (see ``rawjson``)."""

    def batchable(self, body: Any) -> bool:
        """True when ``body`` may share an upstream call with others (never streams)."""
        ...

    def compat_key(self, body: Any) -> Hashable:
        """Every non-input field, canonicalised: only bodies with equal keys are merged."""
        ...

    def items(self, body: Any) -> list[Any]:
        """The inputs of one request, in order (a request may carry several)."""
        ...

    def count(self, body: Any) -> int:
        """``len(items(body))`` without building the list."""
        ...

    def merge(self, bodies: Sequence[Any]) -> Any:
        """One upstream body carrying every item of ``bodies``, in order."""
        ...

    def split(self, status: int, response: Any, bodies: Sequence[Any]) -> list[Any]:
        """The merged answer to ``bodies`` cut into one answer per body, in order.

        Raises ``BatchSplitError`` when the answer does not match the inputs.  Takes the
        bodies rather than their counts so that per-request fields (a KServe ``id``) can be
        echoed back to their own caller.
        """
        ...


def canonical(fields: dict[str, Any], skip: Iterable[str]) -> str:
    """A stable text form of ``fields`` without the ``skip`` keys (the inputs)."""
    dropped = set(skip)
    kept = {k: v for k, v in fields.items() if k not in dropped}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def text_or_tokens(value: Any) -> tuple[str, list[Any]] | None:
    """Classify an OpenAI-style input into ``(kind, items)``, or None when it is not valid.

    A string is one text item; a list of strings is many; a list of ints is one token array;
    a list of int lists is many token arrays.  Texts and token arrays never share a call,
    since the APIs reject a list that mixes them.
    """
    if isinstance(value, str):
        return "text", [value]
    if not isinstance(value, list) or not value:
        return None
    if all(isinstance(v, str) for v in value):
        return "text", value
    if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return "tokens", [value]
    if all(
        isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
        for v in value
    ):
        return "tokens", value
    return None


def apportion(total: int, counts: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``counts``, whole numbers summing exactly to ``total``.

    Largest remainder: each share is rounded down, and the units left over go to the shares
    with the largest fractional parts (earlier callers first on ties).
    """
    items = sum(counts)
    if items <= 0:
        return [0] * len(counts)
    exact = [total * c / items for c in counts]
    shares = [int(x) for x in exact]
    left = total - sum(shares)
    order = sorted(range(len(counts)), key=lambda i: (shares[i] - exact[i], i))
    for i in order[:left]:
        shares[i] += 1
    return shares


def split_usage(
    usage: Any, prompt: Sequence[int], completion: Sequence[int] | None = None
) -> list[Any]:
    """An OpenAI ``usage`` object shared among callers: ``prompt_tokens`` (and every other
    integer field) in proportion to ``prompt``, each caller's prompt tokens (exact where the
    backend counted each entry, else estimated: ``usage.token_weight``), never to its number
    of inputs; ``completion_tokens`` to ``completion`` (each caller's share of the generated
    text), and ``total_tokens`` the sum of each caller's two."""
    if not isinstance(usage, dict):
        return [usage] * len(prompt)
    parts: list[dict[str, Any]] = [{} for _ in prompt]
    for key, value in usage.items():
        if key == "total_tokens" or not isinstance(value, int) or isinstance(value, bool):
            for part in parts:
                part[key] = value
            continue
        weights = completion if key == "completion_tokens" and completion else prompt
        for part, share in zip(parts, apportion(value, weights), strict=True):
            part[key] = share
    if isinstance(usage.get("total_tokens"), int):
        for part in parts:
            part["total_tokens"] = part.get("prompt_tokens", 0) + part.get("completion_tokens", 0)
    return parts


def slices(seq: Sequence[Any], counts: Sequence[int], per_item: int = 1) -> list[list[Any]]:
    """``seq`` cut into consecutive runs of ``count * per_item`` elements, one per caller."""
    if len(seq) != sum(counts) * per_item:
        raise BatchSplitError(
            f"the backend answered {len(seq)} results for {sum(counts) * per_item} inputs"
        )
    out: list[list[Any]] = []
    at = 0
    for c in counts:
        n = c * per_item
        out.append(list(seq[at : at + n]))
        at += n
    return out
