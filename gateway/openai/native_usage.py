"""Token counts of the model servers' own APIs (``policy.generation.NATIVE_PATHS``), whose
answers carry no OpenAI ``usage``: without them, a token limit or a spend budget would
charge a call to llama.cpp's ``/completion`` one token, however much it generated.

Each server names its counts its own way, in a whole answer and in a stream's last event:

- llama.cpp's ``/completion``: ``tokens_evaluated`` (the prompt) and ``tokens_predicted``
  (an array of answers, one per prompt, for several prompts);
- Ollama's ``/api/generate`` and ``/api/chat``: ``prompt_eval_count`` and ``eval_count`` (its
  streams are lines of JSON, not SSE; the last, ``done: true``, carries them);
- TGI's ``/generate`` and ``/generate_stream``: ``details.generated_tokens``, and no prompt
  count (a whole answer has ``details`` only when asked, ``parameters.details``);
- SGLang's ``/generate``: ``meta_info.prompt_tokens`` and ``meta_info.completion_tokens``
  (each streamed event carries them so far);
- llama.cpp's OpenAI chat and Responses API without ``/v1`` (``/chat/completions``,
  ``/responses``): their ``usage``, ``prompt_tokens`` and ``completion_tokens``, or
  ``input_tokens`` and ``output_tokens`` (a Responses stream's in its last event);
- Triton's ``/v2/models/<m>/generate`` and ``generate_stream``: its vLLM backend's
  ``num_input_tokens`` and ``num_output_tokens`` when a call asks for them (a streamed
  event's count is its own tokens'); TensorRT-LLM's name none.

They are read as ``usage.from_body`` reads OpenAI's: without a parse, keys at JSON level only
(inside a string, a quote is escaped, so a model cannot write a count into its answer).  A
prompt count an answer does not carry is the caller's ``prompt`` (the estimate it was
admitted at; a stream's watcher says whether one was named, ``prompt_named``); a stream that
names no count is counted a token per event, as a stream without ``usage`` is.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.errors import RequestError
from gateway.openai.body import native_object, texts_read
from gateway.openai.usage import MAX_LINE_BYTES, StreamUsage
from gateway.pipeline import Call
from gateway.policy.generation import (
    CHOICE_FIELDS,
    LISTED_CALLS,
    PARAMETER_LISTS,
    TEXT_MEMBERS,
    dotted,
    is_native,
    output_fields,
    prompts_of,
    tensor_value,
)


def _count(name: str, tensor: bool = False) -> re.Pattern[bytes]:
    """A count under the key ``name`` at JSON level (inside a string its quote is escaped),
    of at most 9 digits (``usage``'s rule); a ``tensor``'s may be a list of one (Triton's
    output tensors)."""
    opening = rb"\[?\s*" if tensor else b""
    return re.compile(rb'(?<!\\)"' + name.encode() + rb'"\s*:\s*' + opening + rb"(\d{1,9})(?!\d)")


_FAMILIES = (  # (the completion key, its count, the prompt's count, whether events add up)
    (b'"tokens_predicted"', _count("tokens_predicted"), _count("tokens_evaluated"), False),
    (b'"eval_count"', _count("eval_count"), _count("prompt_eval_count"), False),
    (b'"generated_tokens"', _count("generated_tokens"), None, False),  # TGI counts no prompt
    (b'"completion_tokens"', _count("completion_tokens"), _count("prompt_tokens"), False),
    (b'"output_tokens"', _count("output_tokens"), _count("input_tokens"), False),  # Responses
    (  # Triton's vLLM backend, when asked (return_num_output_tokens): each event its own
        b'"num_output_tokens"',
        _count("num_output_tokens", tensor=True),
        _count("num_input_tokens", tensor=True),
        True,
    ),
)
"""One server's counts are read, the first whose words an answer holds: never two
servers' words added up.  A stream's events name the counts so far, or (``True``) each
the tokens it carries."""
_DONE = b"[DONE]"
_INDEX = re.compile(rb'(?<!\\)"index"\s*:\s*(\d{1,9})')
"""Which of the answers a stream interleaves an event belongs to (at JSON level)."""
MAX_ANSWERS = 4096
"""The most answers of one stream counted apart; the events of any more count as one."""


def _counts(data: bytes) -> tuple[list[int], list[int], bool] | None:
    """Every (completion, prompt) count of the first server's words ``data`` holds, and
    whether a stream's events add up."""
    for mark, completion, prompt, adding in _FAMILIES:
        if mark in data:
            completions = [int(n) for n in completion.findall(data)]
            if completions:
                prompts = [int(n) for n in prompt.findall(data)] if prompt else []
                return completions, prompts, adding
    return None


def native(method: str, path: str) -> bool:
    """Whether a call is to a server's own generation API."""
    return method == "POST" and is_native(path)


def from_native_body(body: bytes, prompt: int = 0) -> tuple[int, int] | None:
    """(prompt, completion) tokens of a whole answer of a server's own API: every answer's
    counts summed (llama.cpp answers several prompts with an array); ``prompt`` where it
    names no prompt count.  None when it names no completion count."""
    found = _counts(body)
    if found is None:
        return None
    completions, prompts, _ = found
    return (sum(prompts) if prompts else prompt), sum(completions)


class NativeStreamUsage(StreamUsage):
    """Watches a server's own stream (SSE events, or Ollama's lines of JSON) for its counts,
    however it is split into chunks: ``events`` counts its events (``data:`` lines, or
    lines holding an object), ``counts`` holds the last counts an event named (SGLang's
    grow event by event, llama.cpp's too; the others name them once, at the end), added up
    over the answers a stream interleaves, each event naming its own by ``"index"`` (a
    batch of prompts, several samples: SGLang's, llama.cpp's).  A line longer than
    ``MAX_LINE_BYTES`` (llama.cpp's last event repeats its settings and prompt after its
    counts) is read at its start, and of the rest its last ``MAX_LINE_BYTES``."""

    __slots__ = ("_answers", "prompt_named")

    def __init__(self) -> None:
        super().__init__()
        self.prompt_named = False
        """Whether an event named the prompt's count (TGI's never do: ``counts`` holds 0)."""
        self._answers: dict[int, tuple[int, int]] = {}
        """The last counts each answer's events named, by their ``"index"`` (-1: none)."""

    def feed(self, chunk: bytes) -> None:
        data = self._partial + chunk if self._partial else chunk
        lines = data.split(b"\n")
        tail = lines.pop()
        for i, line in enumerate(lines):
            self._line(line, started=not (self._clipped and i == 0))
        clipped = self._clipped and not lines
        if len(tail) > MAX_LINE_BYTES:
            if not clipped:  # its start is read before it goes: the event, and its counts
                self._line(tail, started=True)
            tail, clipped = tail[-MAX_LINE_BYTES:], True
        self._partial, self._clipped = tail, clipped

    def _line(self, line: bytes, *, started: bool) -> None:
        if started:
            self._count(line)
        self._scan(line)

    def _scan(self, line: bytes) -> None:
        """The counts ``line`` names, if any."""
        found = _counts(line)
        if found is not None:
            completions, prompts, adding = found
            prompt = prompts[-1] if prompts else None
            self.prompt_named = self.prompt_named or prompt is not None
            if adding:
                before = self.counts if self.counts is not None else (0, 0)
                self.counts = (
                    before[0] if prompt is None else prompt,
                    before[1] + sum(completions),
                )
                return
            named = _INDEX.search(line)
            index = int(named.group(1)) if named and len(self._answers) < MAX_ANSWERS else -1
            before = self._answers.get(index, (0, 0))
            now = (before[0] if prompt is None else prompt, completions[-1])
            self._answers[index] = now
            total = self.counts or (0, 0)  # kept added up: an event costs one answer's change
            self.counts = (total[0] + now[0] - before[0], total[1] + now[1] - before[1])

    def _count(self, line: bytes) -> None:
        """One more event when ``line`` opens one: a ``data:`` line but ``[DONE]``, or a
        line of JSON."""
        line = line.lstrip()
        if line.startswith(b"data:"):
            self.events += line[5:].strip() != _DONE
        elif line.startswith(b"{"):
            self.events += 1


async def native_bound(call: Call) -> int:
    """The most tokens a call to a server's own API may generate, as its body bounds it
    (none, or a body the gateway cannot read: 0): its bound (``OUTPUT_FIELDS``) times the
    prompts it sends (llama.cpp answers a list of texts or token lists one by one)."""
    limit = call.policy.server.max_json_values
    try:
        data = await native_object(call.body, call.header("Content-Encoding"), limit, "a limit")
        data, _ = texts_read(data, TEXT_MEMBERS, limit)
    except RequestError:  # the backend's to refuse, as it was sent
        return 0
    if (listed := LISTED_CALLS.get(call.path)) is not None:  # each call's own, added up
        member, each = listed
        calls = data.get(member)
        calls = calls if isinstance(calls, list) else []
        return sum(_bound_of(one, each) for one in calls if isinstance(one, dict))
    return _bound_of(data, call.path)


def _bound_of(data: dict[str, Any], path: str) -> int:
    """The bound ``data``, a call to ``path``, names, times the answers it asks for (its
    prompts, times the samples of each: SGLang's ``n``, TGI's ``best_of``); 0 for none.
    Parameters listed one for each prompt (``PARAMETER_LISTS``): each one's, added up."""
    member = PARAMETER_LISTS.get(path)
    if member is not None and isinstance(data.get(member), list):
        return sum(_bound_of({member: one}, path) for one in data[member] if isinstance(one, dict))
    answers = prompts_of(path, data) * max(
        [1, *(count_of(dotted(data, name)) for name in CHOICE_FIELDS.get(path, ()))]
    )
    for name in output_fields(path) or ():
        value = tensor_value(path, name, dotted(data, name))
        if isinstance(value, int) and not isinstance(value, bool):
            return value * answers if value > 0 else 0
    return 0


def count_of(value: object) -> int:
    """``value`` as a count: an integer above 0, else 0 (a negative bound: none)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
