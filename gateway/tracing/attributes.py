"""What a request's spans say, from the facts its ``Call``, ``Record`` and ``Reply`` carry:
names and attributes by the OpenTelemetry GenAI semantic conventions (``gen_ai.*``,
``server.*``, ``http.*``, ``error.type``) and the gateway's own under ``gateway.``.

Plain dicts and tuples: nothing here imports OpenTelemetry, and nothing here runs unless a
request is traced.  The answer's model, id and finish reasons are read with regular
expressions (``AnswerFacts``), for a whole body and line by line for an SSE stream, rather
than by parsing answers that can be a megabyte of embeddings.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from urllib.parse import urlsplit

from gateway.pipeline import Call, Record, Reply
from gateway.policy.show import redact_url

Value = str | bool | int | float | tuple[str, ...]
Attributes = dict[str, Value]
ChildSpan = tuple[str, float, float, Attributes]
"""A span built after the fact: name, start and end (``perf_counter`` s), attributes."""

OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
}
"""``gen_ai.operation.name`` of each OpenAI path."""
CACHE_LOOKUP, QUEUE_WAIT, BATCH_WAIT = "cache lookup", "queue wait", "batch wait"
MAX_LINE_BYTES = 65536
"""An SSE line longer than this is not read for facts (it is still relayed)."""

# Keys at JSON level, not inside a string value (where their quotes would be escaped).
_MODEL = re.compile(rb'(?<!\\)"model"\s*:\s*"((?:[^"\\]|\\.){1,256})"')
_FINISH = re.compile(rb'(?<!\\)"(?:finish|stop)_reason"\s*:\s*"([^"\\]{1,64})"')
"""OpenAI's ``finish_reason``, Anthropic's ``stop_reason``."""
_ID = re.compile(rb'\s*\{\s*"id"\s*:\s*"([^"\\]{1,256})"')  # the answer's first key


class AnswerFacts:
    """The model, id and finish reasons of an answer, from its JSON body or its SSE chunks
    (``feed``, which keeps only the current partial line)."""

    __slots__ = ("_partial", "finish_reasons", "id", "model")

    def __init__(self) -> None:
        self.model: str | None = None
        self.id: str | None = None
        self.finish_reasons: list[str] = []
        self._partial = b""

    def read_body(self, body: bytes) -> None:
        self._read(body)

    def feed(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        partial = lines.pop()
        self._partial = partial if len(partial) <= MAX_LINE_BYTES else b""
        for line in lines:
            if line.startswith(b"data:"):
                self._read(line[5:])

    def _read(self, data: bytes) -> None:
        if self.id is None and (found := _ID.match(data)) is not None:
            self.id = found.group(1).decode("utf-8", "replace")
        if self.model is None and (found := _MODEL.search(data)) is not None:
            try:
                self.model = json.loads(b'"' + found.group(1) + b'"')
            except ValueError:
                pass
        if b'_reason"' in data:
            self.finish_reasons.extend(r.decode("utf-8", "replace") for r in _FINISH.findall(data))

    def __repr__(self) -> str:
        return f"<AnswerFacts model={self.model!r} finish={self.finish_reasons}>"


def requested_model(call: Call | None) -> str | None:
    """The ``model`` an OpenAI request asked for."""
    model = call.json.get("model") if call is not None and call.json is not None else None
    return model if isinstance(model, str) and model else None


def span_name(call: Call | None, method: str) -> str:
    """``{gen_ai.operation.name} {gen_ai.request.model}`` for the OpenAI endpoints (the
    GenAI conventions' name), else ``{method} {route}``."""
    if call is None:
        return method
    operation = OPERATIONS.get(call.path)
    if operation is None:
        return f"{method} {call.route.name}"
    model = requested_model(call)
    return f"{operation} {model}" if model else operation


def request_attributes(call: Call) -> Attributes:
    """What a span of ``call`` says of the request itself."""
    attrs: Attributes = {}
    operation = OPERATIONS.get(call.path)
    if operation is not None:
        attrs["gen_ai.operation.name"] = operation
    model = requested_model(call)
    if model is not None:
        attrs["gen_ai.request.model"] = model
    return attrs


def server_attributes(
    call: Call | None,
    reply: Reply | None,
    status: int,
    tokens: tuple[int, int] | None,
    answer: AnswerFacts,
    error: str | None,
) -> Attributes:
    """The server span's attributes once the request is over."""
    attrs: Attributes = {"http.response.status_code": status}
    if call is not None:
        attrs.update(request_attributes(call))
        attrs["gateway.route"] = call.route.name
        attrs["gateway.backend"] = (reply.backend if reply is not None else "") or call.backend
        if call.record is not None:
            attrs.update(record_attributes(call.record))
    if reply is not None:
        attrs["gateway.coalesced"] = reply.coalesced
    if tokens is not None:
        attrs["gen_ai.usage.input_tokens"], attrs["gen_ai.usage.output_tokens"] = tokens
    if answer.model is not None:
        attrs["gen_ai.response.model"] = answer.model
    if answer.id is not None:
        attrs["gen_ai.response.id"] = answer.id
    if answer.finish_reasons:
        attrs["gen_ai.response.finish_reasons"] = tuple(answer.finish_reasons)
    if error is not None or status >= 500:
        attrs["error.type"] = error or str(status)
    return attrs


def record_attributes(record: Record) -> Attributes:
    """The facts the stages wrote, as ``gateway.*`` (and the endpoint as ``server.*``)."""
    attrs: Attributes = {}
    if record.cache is not None:
        attrs.update(cache_attributes(record.cache))
    if record.endpoint:
        attrs.update(endpoint_attributes(record.endpoint))
    if record.batch is not None:
        attrs["gateway.batch.size"] = record.batch[0]
    if record.queue_wait is not None:
        began, ended = record.queue_wait
        attrs["gateway.queue.wait_ms"] = round((ended - began) * 1000, 3)
    if record.priority is not None:
        attrs["gateway.priority"] = record.priority
    if record.fallback is not None:
        attrs["gateway.fallback.reason"] = record.fallback
    if record.generation is not None:
        attrs["gateway.generation.action"], attrs["gateway.generation.max_tokens"] = (
            record.generation
        )
    if record.throttle is not None:
        attrs["gateway.throttle.rule"] = record.throttle
    return attrs


def cache_attributes(result: str) -> Attributes:
    """``hit:simhash`` as ``gateway.cache.result`` and ``gateway.cache.tier``."""
    outcome, _, tier = result.partition(":")
    attrs: Attributes = {"gateway.cache.result": outcome}
    if tier:
        attrs["gateway.cache.tier"] = tier
    return attrs


def child_spans(record: Record) -> list[ChildSpan]:
    """The spans built from the stages' timings: the cache lookup, the wait for company
    in a batch, the wait in the admission queue."""
    spans: list[ChildSpan] = []
    if record.cache_lookup is not None:
        attrs = cache_attributes(record.cache) if record.cache is not None else {}
        spans.append((CACHE_LOOKUP, *record.cache_lookup, attrs))
    if record.batch is not None:
        size, began, ended = record.batch
        spans.append((BATCH_WAIT, began, ended, {"gateway.batch.size": size}))
    if record.queue_wait is not None:
        spans.append((QUEUE_WAIT, *record.queue_wait, {}))
    return spans


@lru_cache(maxsize=256)
def endpoint_attributes(url: str) -> Attributes:
    """``server.address``, ``server.port`` and ``gateway.endpoint`` of an endpoint URL."""
    if not url:
        return {}
    parts = urlsplit(url)
    attrs: Attributes = {"gateway.endpoint": redact_url(url)}
    if parts.hostname:
        attrs["server.address"] = parts.hostname
        attrs["server.port"] = parts.port or (443 if parts.scheme == "https" else 80)
    return attrs
