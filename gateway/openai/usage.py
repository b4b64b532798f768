"""Token counts from OpenAI ``usage`` objects, in whole bodies and in SSE streams."""

from __future__ import annotations

import json
import re
from typing import Any

_MARK = b'"usage"'
_PIECE = re.compile(r"\w+|[^\w\s]")
# Keys at JSON level, not inside a string value (where their quotes would be escaped).
_PROMPT = re.compile(rb'(?<!\\)"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION = re.compile(rb'(?<!\\)"completion_tokens"\s*:\s*(\d+)')
_NO_USAGE = re.compile(rb'"usage"\s*:\s*null')
"""A chunk's ``usage`` of ``null``: every chunk but the last once ``include_usage`` is asked.
(No look-behind: inside a string the closing quote would be escaped too, and a pattern that
opens with its literal is searched at C speed.)"""


def from_body(body: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a JSON answer that carries ``usage``.

    Read with two regular expressions rather than a parse of the whole answer: this runs
    for every response and the answer itself is not needed."""
    start = body.rfind(_MARK)  # a key: inside a JSON string its quotes would be escaped
    if start < 0:
        return None
    prompt = _PROMPT.search(body, start)
    if prompt is None:
        return None
    completion = _COMPLETION.search(body, start)
    return int(prompt.group(1)), int(completion.group(1)) if completion else 0


def asks_usage(body: dict[str, Any]) -> bool:
    """Whether a request asks for a stream's usage chunk (``stream_options.include_usage``)."""
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def token_weight(item: Any) -> int:
    """About how many tokens one input costs, for sharing a merged call's ``usage`` among
    its callers: a token array's length, or a text's words and punctuation marks (what a
    tokenizer's count follows, where a count of inputs does not: one 40-word input and one
    2-word input are not two halves).  At least 1."""
    if isinstance(item, str):
        return max(1, len(_PIECE.findall(item)))
    if isinstance(item, list):
        return max(1, len(item))
    return 1


def entry_tokens(entries: Any) -> list[int] | None:
    """The backend's own token count of each answer entry (``data[i].usage.prompt_tokens``
    or ``data[i].prompt_tokens``), when every entry carries one; else None."""
    if not isinstance(entries, list) or not entries:
        return None
    counts: list[int] = []
    for entry in entries:
        if not isinstance(entry, dict):
            return None
        usage = entry.get("usage")
        count = (
            usage.get("prompt_tokens") if isinstance(usage, dict) else entry.get("prompt_tokens")
        )
        if not isinstance(count, int) or isinstance(count, bool):
            return None
        counts.append(count)
    return counts


def _counts(usage: Any) -> tuple[int, int] | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    return prompt, completion


def _nothing(line: bytes) -> bool:
    """Whether a line's only ``usage`` is ``null`` (no parse needed to know it counts none)."""
    return line.count(_MARK) == 1 and _NO_USAGE.search(line) is not None


class StreamUsage:
    """Watches an SSE stream for a chunk with a non-null ``usage`` (OpenAI's
    ``stream_options.include_usage``); keeps only the current partial line."""

    __slots__ = ("_partial", "counts")

    def __init__(self) -> None:
        self._partial = b""
        self.counts: tuple[int, int] | None = None

    def feed(self, chunk: bytes) -> None:
        if not self._partial and (
            _MARK not in chunk or chunk.count(_MARK) == len(_NO_USAGE.findall(chunk))
        ):
            # the common case: a content chunk; keep only a possible split marker
            cut = chunk.rfind(b"\n")
            tail = chunk[cut + 1 :] if cut >= 0 else chunk
            self._partial = tail if b'"' in tail and b"data:" in tail else b""
            return
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if len(self._partial) > 65536:
            self._partial = b""
        for line in lines:
            if line.startswith(b"data:") and _MARK in line and not _nothing(line):
                try:
                    event = json.loads(line[5:])
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue
                counts = _counts(event.get("usage") if isinstance(event, dict) else None)
                if counts is not None:
                    self.counts = counts
