"""Streams as stored events, and conversion between stored JSON answers and SSE streams.

A stream is stored as its events exactly as sent: each event block's text, every field
(``event:``, ``id:``, several ``data:`` lines, comments) and line ending as they came, the
closing ``[DONE]`` included, so a replay is byte for byte the stream that was recorded
(``render_sse``), except for usage-only chunks a client did not ask for.

A hit must answer in the shape the client asked for, whatever shape was stored: a JSON
answer is replayed to a streaming client as OpenAI chunks (role delta, content in several
deltas, finish_reason, an optional usage chunk, ``[DONE]``); a stored stream is assembled
into one JSON answer for a non-streaming client from its events' data.  Both
``chat.completion`` and ``text_completion`` shapes are handled.  ``StreamRecorder`` watches
a stream pass through and yields its events only if it completed normally: a stream cut off
before ``[DONE]``, with an error event, or without a finish_reason for every choice, is
never stored.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterable
from typing import Any

SSE_TYPE = "text/event-stream"
DONE = "[DONE]"
DONE_EVENT = f"data: {DONE}\n\n"
DEFAULT_CHUNK_CHARS = 24
DEFAULT_MAX_STREAM_BYTES = 4 * 1024 * 1024
_PIECE = re.compile(r"\s*\S+\s*|\s+")
_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)")
MAX_PENDING_BYTES = 1024 * 1024
"""The most of an unended event ``whole_events`` holds back; past it the bytes go on as they
came (a backend that never ends its events must not grow the gateway's memory)."""


def media_type(headers: Iterable[tuple[str, str]]) -> str:
    """The first ``Content-Type``'s media type, lower-cased, without parameters ("" if none)."""
    for key, value in headers:
        if key.lower() == "content-type":
            return value.split(";", 1)[0].strip().lower()
    return ""


def is_event_stream(headers: Iterable[tuple[str, str]]) -> bool:
    """True for an SSE body (``text/event-stream``)."""
    return media_type(headers) == SSE_TYPE


def split_events(text: str) -> list[str]:
    """The complete event blocks of a stream's text, each as sent: its lines and the blank
    line that ends it, line endings kept (a block not yet ended is left out)."""
    blocks: list[str] = []
    start = 0
    for line in _LINE.finditer(text):
        if line.end() - line.start() <= 2 and line.group().strip("\r\n") == "":
            if line.start() > start:  # a blank line ends a block with lines in it
                blocks.append(text[start : line.end()])
            start = line.end()
    return blocks


def event_data(block: str) -> str | None:
    """An event block's data: its ``data:`` lines joined by line feeds (one leading space
    of each value dropped), None for a block without data (a comment, a bare ``id:``)."""
    lines: list[str] = []
    for line in block.splitlines():
        if line.startswith("data:"):
            value = line[5:]
            lines.append(value[1:] if value.startswith(" ") else value)
        elif line == "data":
            lines.append("")
    return "\n".join(lines) if lines else None


def parse_sse(data: bytes | str) -> list[str]:
    """The ``data`` payloads of the complete events in ``data`` (multi-line data joined)."""
    text = data.decode("utf-8") if isinstance(data, bytes) else data
    return [d for block in split_events(text) if (d := event_data(block)) is not None]


STREAM_PROBLEMS = ("error_event", "unfinished", "malformed_event")
"""Why a well-framed stream is no answer: an ``error`` event (vLLM's mid-stream error), an
end without ``[DONE]`` or without a ``finish_reason`` for every choice, or an event whose
data is not a JSON object (or comes after ``[DONE]``)."""


class StreamCheck:
    """Judges an OpenAI chat or completions event stream as it passes, keeping only the line
    not yet ended: ``problem()`` once it has ended is None for a stream that completed
    normally, else one of ``STREAM_PROBLEMS``.  What the cache stores, single flight assembles
    and the breaker counts as a success are the same streams."""

    __slots__ = ("_data", "_done", "_finished", "_tail", "found")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []
        self._done = False
        self._finished: dict[int, bool] = {}
        self.found: str | None = None

    def feed(self, chunk: bytes) -> None:
        if self.found is not None:
            return
        lines = (self._tail + chunk).split(b"\n")
        self._tail = lines.pop()
        for line in lines:
            self._line(line.rstrip(b"\r"))
            if self.found is not None:
                return

    def problem(self) -> str | None:
        """Why the stream, now ended, is not a whole answer (None: it is)."""
        if self.found is not None:
            return self.found
        if self._tail.strip(b"\r") or self._data:
            self._line(self._tail.rstrip(b"\r"))
            self._line(b"")  # an event the end of the stream left open
            self._tail = b""
            if self.found is not None:
                return self.found
        if not self._done or not self._finished or not all(self._finished.values()):
            return "unfinished"
        return None

    def _line(self, line: bytes) -> None:
        if not line:
            if self._data:
                payload = b"\n".join(self._data)
                self._data = []
                self._event(payload)
        elif line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        elif line == b"data":
            self._data.append(b"")

    def _event(self, payload: bytes) -> None:
        if self._done:
            self.found = "malformed_event"  # anything after [DONE]
            return
        if payload == b"[DONE]":
            self._done = True
            return
        try:
            chunk = json.loads(payload)
        except (ValueError, UnicodeDecodeError, RecursionError):
            self.found = "malformed_event"
            return
        if not isinstance(chunk, dict):
            self.found = "malformed_event"
        elif chunk.get("error") is not None:
            self.found = "error_event"
        else:
            for choice in chunk.get("choices") or ():
                index = choice.get("index", 0) if isinstance(choice, dict) else 0
                done = isinstance(choice, dict) and bool(choice.get("finish_reason"))
                self._finished[index] = self._finished.get(index, False) or done

    def __repr__(self) -> str:
        return f"<StreamCheck done={self._done} found={self.found}>"


class StreamRecorder:
    """Collects a passing SSE stream; ``result()`` is its events if it may be stored."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_STREAM_BYTES) -> None:
        self._buffer = bytearray()
        self._max_bytes = max_bytes
        self._check = StreamCheck()
        self.overflowed = False

    def feed(self, chunk: bytes) -> None:
        if self.overflowed:
            return
        self._buffer += chunk
        self._check.feed(chunk)
        if len(self._buffer) > self._max_bytes:
            self.overflowed = True
            self._buffer.clear()

    def result(self) -> tuple[str, ...] | None:
        """The stored form of the stream (its event blocks as sent, ``[DONE]`` last), or
        None if it must not be stored."""
        if self.overflowed or self._check.problem() is not None:
            return None
        try:
            blocks = split_events(bytes(self._buffer).decode("utf-8"))
        except UnicodeDecodeError:
            return None
        if not blocks or event_data(blocks[-1]) != DONE:
            return None
        return tuple(blocks)

    def __repr__(self) -> str:
        return f"<StreamRecorder bytes={len(self._buffer)} overflowed={self.overflowed}>"


def render_sse(events: tuple[str, ...] | list[str], *, include_usage: bool = True) -> bytes:
    """Stored event blocks as the stream's bytes, as recorded; usage-only chunks dropped
    unless ``include_usage`` (the client's ``stream_options.include_usage``)."""
    if include_usage:
        return "".join(events).encode()
    return "".join(e for e in events if not usage_only(event_data(e))).encode()


def carries_usage(events: tuple[str, ...] | list[str]) -> bool:
    """Whether stored events include a chunk with a ``usage`` (``include_usage`` asked)."""
    return any(usage_only(event_data(e)) for e in events if '"usage"' in e)


def stored_blocks(payloads: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """Data payloads (the stored form before events were kept as sent) as event blocks."""
    return (*(f"data: {p}\n\n" for p in payloads if p != DONE), DONE_EVENT)


def json_to_events(
    answer: dict[str, Any], *, include_usage: bool = True, chunk_chars: int = DEFAULT_CHUNK_CHARS
) -> tuple[str, ...]:
    """An OpenAI JSON answer (chat or text completion) as the events of its stream."""
    chat = answer.get("object") == "chat.completion"
    base: dict[str, Any] = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    base["object"] = "chat.completion.chunk" if chat else "text_completion"
    if answer.get("system_fingerprint") is not None:
        base["system_fingerprint"] = answer["system_fingerprint"]
    events: list[str] = []

    def emit(choice: dict[str, Any], **extra: Any) -> None:
        events.append(_dumps({**base, "choices": [choice], **extra}))

    for choice in answer.get("choices") or ():
        index = choice.get("index", 0)
        if chat:
            _chat_choice(choice, index, chunk_chars, emit)
        else:
            text, logprobs = choice.get("text") or "", choice.get("logprobs")
            pieces = [text] if logprobs is not None else _pieces(text, chunk_chars)
            for piece in pieces:
                emit({"text": piece, "index": index, "logprobs": logprobs, "finish_reason": None})
            emit(
                {
                    "text": "",
                    "index": index,
                    "logprobs": None,
                    "finish_reason": choice.get("finish_reason"),
                }
            )
    if include_usage and answer.get("usage") is not None:
        events.append(_dumps({**base, "choices": [], "usage": answer["usage"]}))
    return stored_blocks(events)


def _chat_choice(choice: dict[str, Any], index: int, chunk_chars: int, emit: Any) -> None:
    message = choice.get("message") or {}
    logprobs = choice.get("logprobs")

    def delta(d: dict[str, Any], finish: str | None = None, lp: Any = None) -> None:
        emit({"index": index, "delta": d, "logprobs": lp, "finish_reason": finish})

    content = "" if isinstance(message.get("content"), str) else None
    delta({"role": message.get("role", "assistant"), "content": content})
    for field in ("reasoning_content", "content", "refusal"):
        value = message.get(field)
        if not value:
            continue
        if field == "content" and logprobs is not None:
            delta({field: value}, lp=logprobs)
        else:
            for piece in _pieces(value, chunk_chars):
                delta({field: piece})
    for i, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        head = {"index": i, "id": call.get("id"), "type": call.get("type", "function")}
        delta(
            {"tool_calls": [{**head, "function": {"name": function.get("name"), "arguments": ""}}]}
        )
        for piece in _pieces(function.get("arguments") or "", chunk_chars):
            delta({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
    delta({}, finish=choice.get("finish_reason"))


def events_to_json(events: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Assemble stored stream events into the JSON answer a non-streaming call would get."""
    data = (event_data(e) for e in events)
    chunks = [json.loads(d) for d in data if d is not None and d != DONE]
    if not chunks:
        raise ValueError("no events to assemble")
    first = chunks[0]
    chat = first.get("object") == "chat.completion.chunk"
    answer: dict[str, Any] = {k: first[k] for k in ("id", "created", "model") if k in first}
    answer["object"] = "chat.completion" if chat else "text_completion"
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if chunk.get("system_fingerprint") is not None:
            answer["system_fingerprint"] = chunk["system_fingerprint"]
        if chunk.get("usage") is not None:
            usage = chunk["usage"]
        for part in chunk.get("choices") or ():
            index = part.get("index", 0)
            slot = choices.setdefault(index, _empty_choice(index, chat))
            if chat:
                _merge_delta(slot, part.get("delta") or {})
            else:
                slot["text"] += part.get("text") or ""
            _merge_logprobs(slot, part.get("logprobs"))
            if part.get("finish_reason"):
                slot["finish_reason"] = part["finish_reason"]
    answer["choices"] = [choices[i] for i in sorted(choices)]
    if usage is not None:
        answer["usage"] = usage
    return answer


def _empty_choice(index: int, chat: bool) -> dict[str, Any]:
    if chat:
        message = {"role": "assistant", "content": None}
        return {"index": index, "message": message, "logprobs": None, "finish_reason": None}
    return {"index": index, "text": "", "logprobs": None, "finish_reason": None}


def _merge_delta(slot: dict[str, Any], delta: dict[str, Any]) -> None:
    message = slot["message"]
    if delta.get("role"):
        message["role"] = delta["role"]
    for field in ("content", "refusal", "reasoning_content"):
        if delta.get(field) is not None:
            message[field] = (message.get(field) or "") + delta[field]
    for call in delta.get("tool_calls") or ():
        calls = message.setdefault("tool_calls", [])
        i = call.get("index", len(calls))
        while len(calls) <= i:
            calls.append(
                {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
        target = calls[i]
        if call.get("id"):
            target["id"] = call["id"]
        if call.get("type"):
            target["type"] = call["type"]
        function = call.get("function") or {}
        if function.get("name"):
            target["function"]["name"] += function["name"]
        target["function"]["arguments"] += function.get("arguments") or ""


def _merge_logprobs(slot: dict[str, Any], logprobs: Any) -> None:
    if not isinstance(logprobs, dict):
        return
    if slot["logprobs"] is None:
        slot["logprobs"] = {k: list(v) if isinstance(v, list) else v for k, v in logprobs.items()}
        return
    for key, value in logprobs.items():
        if isinstance(value, list) and isinstance(slot["logprobs"].get(key), list):
            slot["logprobs"][key].extend(value)


def _pieces(text: str, chunk_chars: int) -> list[str]:
    pieces: list[str] = []
    current = ""
    for match in _PIECE.finditer(text):
        if current and len(current) + len(match.group(0)) > chunk_chars:
            pieces.append(current)
            current = ""
        current += match.group(0)
    if current:
        pieces.append(current)
    return pieces


def usage_only(payload: str | None) -> bool:
    """Whether an event's data is a chunk with only ``usage`` news (no ``choices``)."""
    if payload is None or '"usage"' not in payload:
        return False
    try:
        chunk = json.loads(payload)
    except (ValueError, RecursionError):
        return False
    return isinstance(chunk, dict) and not chunk.get("choices") and chunk.get("usage") is not None


def _dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


async def whole_events(
    stream: AsyncIterator[bytes], max_pending: int = MAX_PENDING_BYTES
) -> AsyncIterator[bytes]:
    """``stream`` cut where events end, so each piece holds whole events only: but an event
    that outgrows ``max_pending``, and the tail of a stream that ends mid-event, go on as
    they came.  Every byte is passed on, in order."""
    pending = b""
    async for chunk in stream:
        data = pending + chunk if pending else chunk
        cut = _last_event_end(data)
        if cut == 0:
            pending = b"" if len(data) > max_pending else data
            if not pending:
                yield data
            continue
        pending = data[cut:]
        yield data[:cut]
    if pending:
        yield pending


def _last_event_end(data: bytes) -> int:
    """Where the last complete event of ``data`` ends (0: none does)."""
    found = 0
    for blank in (b"\n\n", b"\r\n\r\n", b"\r\r"):
        at = data.rfind(blank)
        if at >= 0:
            found = max(found, at + len(blank))
    return found
