"""Token counts from ``usage`` objects, in whole bodies and in SSE streams.

Three shapes are read, as the model servers write them:

- OpenAI's chat and completions: ``prompt_tokens`` and ``completion_tokens``;
- OpenAI's Responses API (``/v1/responses``): ``input_tokens`` (cached ones included) and
  ``output_tokens``; a stream carries them in its ``response.completed`` event's
  ``response``;
- Anthropic's Messages API (``/v1/messages``): ``input_tokens`` (only the tokens not read
  from the prompt cache), ``cache_read_input_tokens``, ``cache_creation_input_tokens`` and
  ``output_tokens``; a stream carries the input in ``message_start``'s ``message`` and the
  output in ``message_delta``.

The prompt count is every token of the prompt, cached or not (OpenAI's meaning), so the
three add up alike: Anthropic's three input counts are summed.
"""

from __future__ import annotations

import json
import re
from typing import Any

_MARK = b'"usage"'
_EVENT, _DONE = b"data:", b"data: [DONE]"
_PIECE = re.compile(r"\w+|[^\w\s]")
# Keys at JSON level, not inside a string value (where their quotes would be escaped); a
# count of at most 9 digits (a longer one is no count: past 4,300 digits int() raises).
_PROMPT = re.compile(rb'(?<!\\)"prompt_tokens"\s*:\s*(\d{1,9})(?!\d)')
_COMPLETION = re.compile(rb'(?<!\\)"completion_tokens"\s*:\s*(\d{1,9})(?!\d)')
_INPUT = re.compile(rb'(?<!\\)"input_tokens"\s*:\s*(\d{1,9})(?!\d)')
_OUTPUT = re.compile(rb'(?<!\\)"output_tokens"\s*:\s*(\d{1,9})(?!\d)')
_CACHED_INPUT = re.compile(rb'(?<!\\)"cache_(?:read|creation)_input_tokens"\s*:\s*(\d{1,9})(?!\d)')
MAX_LINE_BYTES = 65536
"""The most of one SSE line ``StreamUsage`` holds while it waits for the line's end."""
_NO_USAGE = re.compile(rb'"usage"\s*:\s*null')
"""A chunk's ``usage`` of ``null``: every chunk but the last once ``include_usage`` is asked.
(No look-behind: inside a string the closing quote would be escaped too, and a pattern that
opens with its literal is searched at C speed.)"""


def from_body(body: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a JSON answer that carries ``usage``.

    Read with regular expressions rather than a parse of the whole answer: this runs for
    every response and the answer itself is not needed.  The last ``"usage"`` that is
    followed by counts is the answer's: a string value ``"usage"`` after it (the Responses
    API echoes the client's ``user`` and ``metadata`` after its ``usage``) is passed over,
    so a client cannot hide its tokens by naming itself so.  At most
    ``MAX_USAGE_MARKERS`` are tried."""
    start = body.rfind(_MARK)  # inside a JSON string its quotes would be escaped
    for _ in range(MAX_USAGE_MARKERS):
        if start < 0:
            return None
        found = _counts_from(body, start)
        if found is not None:
            return found
        start = body.rfind(_MARK, 0, start)
    return None


MAX_USAGE_MARKERS = 16


def _counts_from(body: bytes, start: int) -> tuple[int, int] | None:
    prompt = _PROMPT.search(body, start)
    if prompt is not None:
        completion = _COMPLETION.search(body, start)
        return int(prompt.group(1)), int(completion.group(1)) if completion else 0
    given = _INPUT.search(body, start)
    if given is None:
        return None
    cached = sum(int(found.group(1)) for found in _CACHED_INPUT.finditer(body, start))
    output = _OUTPUT.search(body, start)
    return int(given.group(1)) + cached, int(output.group(1)) if output else 0


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


def _counts(usage: Any) -> tuple[int | None, int | None] | None:
    """(prompt, completion) of a ``usage`` object, None for a count it does not carry (an
    Anthropic ``message_delta`` carries the output only); None when it is no usage."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        prompt = usage.get("prompt_tokens") or 0
        completion = usage.get("completion_tokens") or 0
        if not _whole(prompt) or not _whole(completion):
            return None
        return prompt, completion
    inputs: list[int] = [usage[name] for name in _INPUT_KEYS if usage.get(name) is not None]
    output = usage.get("output_tokens")
    if not all(_whole(n) for n in inputs) or (output is not None and not _whole(output)):
        return None
    if not inputs and output is None:
        return None
    return (sum(inputs) if inputs else None), output


_INPUT_KEYS = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")


def _whole(count: Any) -> bool:
    return isinstance(count, int) and not isinstance(count, bool) and count >= 0


def _event_usage(event: Any) -> Any:
    """An event's ``usage``: at its top (OpenAI's chunks, Anthropic's ``message_delta``), in
    its ``response`` (the Responses API's ``response.completed``) or in its ``message``
    (Anthropic's ``message_start``)."""
    if not isinstance(event, dict):
        return None
    usage = event.get("usage")
    if usage is not None:
        return usage
    for holder in ("response", "message"):
        inner = event.get(holder)
        if isinstance(inner, dict) and inner.get("usage") is not None:
            return inner["usage"]
    return None


def _nothing(line: bytes) -> bool:
    """Whether a line's only ``usage`` is ``null`` (no parse needed to know it counts none)."""
    return line.count(_MARK) == 1 and _NO_USAGE.search(line) is not None


class StreamUsage:
    """Watches an SSE stream for events with a non-null ``usage`` (OpenAI's
    ``stream_options.include_usage`` chunk, the Responses API's ``response.completed``,
    Anthropic's ``message_start`` and ``message_delta``), however the stream is split into
    chunks; keeps only the line under way, and of a line longer than ``MAX_LINE_BYTES`` (a
    ``response.completed`` repeats the whole answer) its last ``MAX_LINE_BYTES``, where the
    ``usage`` is, then read without a parse.  ``events`` counts the ``data:`` events but
    ``[DONE]``: a model server streams a token an event, so for a stream that carries no
    usage it is the tokens it generated, near enough (``rates.py`` settles on it)."""

    __slots__ = ("_clipped", "_partial", "counts", "events")

    def __init__(self) -> None:
        self._partial = b""
        self._clipped = False
        self.counts: tuple[int, int] | None = None
        self.events = 0

    def feed(self, chunk: bytes) -> None:
        self.events += chunk.count(_EVENT) - chunk.count(_DONE)
        data = self._partial + chunk if self._partial else chunk
        if _MARK not in data or data.count(_MARK) == len(_NO_USAGE.findall(data)):
            # the common case: content only; keep the line under way (a marker may be split)
            cut = data.rfind(b"\n")
            self._keep(data[cut + 1 :], self._clipped and cut < 0)
            return
        lines = data.split(b"\n")
        tail = lines.pop()
        for i, line in enumerate(lines):
            if _MARK in line and not _nothing(line):
                self._read(line, clipped=self._clipped and i == 0)
        self._keep(tail, self._clipped and not lines)

    def _keep(self, tail: bytes, clipped: bool) -> None:
        if len(tail) > MAX_LINE_BYTES:
            tail, clipped = tail[-MAX_LINE_BYTES:], True
        self._partial, self._clipped = tail, clipped

    def _read(self, line: bytes, *, clipped: bool) -> None:
        if clipped:  # its start is gone: the last ``usage`` of what is left
            whole = from_body(line)
            if whole is not None:
                self._add(*whole)
            return
        if not line.startswith(b"data:"):
            return
        try:
            event = json.loads(line[5:])
        except (UnicodeDecodeError, ValueError, RecursionError):  # a digit limit, deep nesting
            return
        found = _counts(_event_usage(event))
        if found is not None:
            self._add(*found)

    def _add(self, prompt: int | None, completion: int | None) -> None:
        """A usage event's counts; one that carries only one count keeps the other."""
        before = self.counts or (0, 0)
        self.counts = (
            before[0] if prompt is None else prompt,
            before[1] if completion is None else completion,
        )
