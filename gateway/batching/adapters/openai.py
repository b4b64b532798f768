"""OpenAI ``/v1/embeddings`` and ``/v1/completions``: inputs as a list, answers by ``index``.

Both accept one string, a list of strings, one token array or a list of token arrays, and
answer with a list whose entries carry ``index``.  Merged calls are split by that index (not
by position), renumbered from 0 for each caller, and ``usage`` is shared by tokens: the
backend's own count of each entry where it gives one, else each caller's inputs' estimated
tokens (``openai.usage.token_weight``), and for completions the generated text's.

Completions merge only when greedy (``temperature`` given and 0) and not streamed: the issue
allows no merging of sampled requests, and a ``seed`` means one random stream per call, which
a merged call would share.  vLLM and TGI batch continuously and submit each prompt of a list
as its own engine request, so merging completions gains nothing there; the adapter exists for
servers that do not (static-batch servers, custom ones).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

from gateway.batching.adapters.base import canonical, slices, split_usage, text_or_tokens
from gateway.errors import BatchSplitError
from gateway.openai.usage import entry_tokens, token_weight


def _indexed(entries: Any, what: str) -> list[dict[str, Any]]:
    if not isinstance(entries, list) or not all(
        isinstance(e, dict) and isinstance(e.get("index"), int) for e in entries
    ):
        raise BatchSplitError(f"the backend's {what} is not a list of indexed entries")
    ordered = sorted(entries, key=lambda e: e["index"])
    if [e["index"] for e in ordered] != list(range(len(ordered))):
        raise BatchSplitError(f"the backend's {what} indexes are not 0..n-1")
    return ordered


class _ListInput:
    """An OpenAI endpoint whose ``field`` takes texts or token arrays and answers a list."""

    name = ""
    opaque_arrays = True
    field = ""
    answers = ""

    def batchable(self, body: Any) -> bool:
        return (
            isinstance(body, dict)
            and not body.get("stream")
            and text_or_tokens(body.get(self.field)) is not None
        )

    def compat_key(self, body: Any) -> Hashable:
        kind = text_or_tokens(body.get(self.field))
        return (kind[0] if kind else None, canonical(body, (self.field,)))

    def items(self, body: Any) -> list[Any]:
        kind = text_or_tokens(body.get(self.field))
        return kind[1] if kind else []

    def count(self, body: Any) -> int:
        value = body.get(self.field)
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return 1
        return len(value) if isinstance(value, list) else 0

    def merge(self, bodies: Sequence[Any]) -> Any:
        merged = dict(bodies[0])
        inputs: list[Any] = []
        for body in bodies:
            inputs.extend(self.items(body))
        merged[self.field] = inputs
        return merged

    def _per_item(self, response: dict[str, Any], counts: Sequence[int]) -> int:
        return 1

    def split(self, status: int, response: Any, bodies: Sequence[Any]) -> list[Any]:
        counts = [self.count(b) for b in bodies]
        if not isinstance(response, dict):
            raise BatchSplitError(f"the backend's {self.name} answer is not an object")
        per_item = self._per_item(response, counts)
        entries = _indexed(response.get(self.answers), self.answers)
        parts = slices(entries, counts, per_item)
        usages = split_usage(
            response.get("usage"), self._prompt_tokens(bodies, parts), self._generated(parts)
        )
        out: list[Any] = []
        for part, usage in zip(parts, usages, strict=True):
            base = part[0]["index"] if part else 0
            answer = dict(response)
            answer[self.answers] = [{**e, "index": e["index"] - base} for e in part]
            if "usage" in response:
                answer["usage"] = usage
            out.append(answer)
        return out

    def _prompt_tokens(self, bodies: Sequence[Any], parts: list[list[Any]]) -> list[int]:
        """Each caller's prompt tokens: the backend's own per-entry counts where every entry
        has one, else its inputs' estimates."""
        counted = [entry_tokens(part) for part in parts]
        if all(c is not None for c in counted):
            return [sum(c or ()) for c in counted]
        return [sum(token_weight(item) for item in self.items(body)) for body in bodies]

    def _generated(self, parts: list[list[Any]]) -> list[int] | None:
        """Each caller's share of the generated tokens (None: nothing is generated)."""
        return None


class OpenAIEmbeddings(_ListInput):
    """``POST /v1/embeddings``: ``input`` -> ``data[i].embedding``."""

    name = "openai-embeddings"
    field = "input"
    answers = "data"


class OpenAICompletions(_ListInput):
    """``POST /v1/completions``: ``prompt`` -> ``choices``, ``n`` choices per prompt."""

    name = "openai-completions"
    field = "prompt"
    answers = "choices"

    def batchable(self, body: Any) -> bool:
        if not super().batchable(body):
            return False
        temperature = body.get("temperature")
        greedy = isinstance(temperature, int | float) and temperature == 0
        return greedy and isinstance(body.get("n", 1), int)

    def _generated(self, parts: list[list[Any]]) -> list[int] | None:
        return [sum(token_weight(c.get("text") or "") for c in part) for part in parts]

    def _per_item(self, response: dict[str, Any], counts: Sequence[int]) -> int:
        # Choices come n per prompt (index = prompt * n + j), so n is read off the answer.
        choices, total = response.get("choices"), sum(counts)
        if isinstance(choices, list) and total and len(choices) % total == 0:
            return max(1, len(choices) // total)
        return 1
