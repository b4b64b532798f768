"""Token counts for streams whose clients did not ask for them (a route's
``stream_usage: ask``).

A streamed chat or completion carries its ``usage`` only when the client asks for it
(``stream_options.include_usage``), and most do not (Spring AI leaves it off unless
``stream-usage: true``), so the gateway could count none of their tokens: not per backend,
not per tenant.  On a route with ``stream_usage: ask``, such a request is asked for the
usage chunk anyway (its body written again), and the chunk is taken out of what the client
receives: its stream is framed into events, and an event whose only news is ``usage`` (no
``choices``) is dropped, every other byte passed on as it came.  Its counts reach the edge
through the reply (``Reply.usage``), so they are counted as if the client had asked.

The stage stands before the cache and single flight: they see the request as it goes
upstream, so a stored stream holds its usage, and requests that differ only in whether they
asked share one flight, each client getting the stream it asked for.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator

from gateway.openai.body import dumps_yielding
from gateway.openai.sse import (
    MAX_PENDING_BYTES,
    event_data,
    is_event_stream,
    usage_only,
    whole_events,
)
from gateway.openai.usage import StreamUsage, asks_usage, from_body
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy

STREAMED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")
"""The blank line that ends an SSE event (RFC: CRLF, LF or CR line endings)."""
_MARK = b'"usage"'
_NO_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*\]')
"""An empty ``choices``, which a usage-only chunk has and a content chunk never does."""


class StreamUsageStage:
    """The stage; see the module docstring."""

    def __init__(self, routes: frozenset[str]) -> None:
        self._routes = routes

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        data = call.json
        options = data.get("stream_options", {}) if data is not None else None
        if (
            call.route.name not in self._routes
            or data is None
            or data.get("stream") is not True
            or call.path not in STREAMED_PATHS
            or not isinstance(options, dict)  # the backend's to refuse, as it was sent
            or asks_usage(data)
        ):
            return await call_next(call)
        asked = {**data, "stream_options": {**options, "include_usage": True}}
        body = await dumps_yielding(asked, len(call.body))
        reply = await call_next(dataclasses.replace(call, json=asked, body=body))
        if reply.status != 200 or not is_event_stream(reply.headers):
            return reply
        usage = StreamUsage()
        if reply.body is not None:
            return reply.replace(body=without_usage_events(reply.body, usage), usage=usage)
        assert reply.stream is not None
        return reply.replace(
            stream=_without_usage(reply.stream, usage), usage=usage, content_length=None
        )

    def __repr__(self) -> str:
        return f"<StreamUsageStage routes={sorted(self._routes)}>"


async def _without_usage(stream: AsyncIterator[bytes], usage: StreamUsage) -> AsyncIterator[bytes]:
    """``stream`` as whole events, usage-only events dropped (``usage`` counts them)."""
    async for events in whole_events(stream, MAX_PENDING_BYTES):
        if _MARK in events:
            events = without_usage_events(events, usage)
        if events:
            yield events


def without_usage_events(data: bytes, usage: StreamUsage | None = None) -> bytes:
    """Whole SSE events with those carrying only ``usage`` left out (the rest byte for
    byte, an unended tail included); ``usage`` gets the counts of the last one dropped."""
    if _NO_CHOICES.search(data) is None:  # content chunks: no event can be usage-only
        return data
    kept: list[bytes] = []
    start = 0
    for end in _END.finditer(data):
        event = data[start : end.end()]
        start = end.end()
        if _MARK in event and _NO_CHOICES.search(event) and _is_usage_only(event):
            counts = from_body(event)
            if usage is not None and counts is not None:
                usage.counts = counts
            continue
        kept.append(event)
    kept.append(data[start:])
    return b"".join(kept)


def _is_usage_only(event: bytes) -> bool:
    try:
        text = event.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return usage_only(event_data(text))


def build(policy: Policy) -> list[Stage]:
    """The stage, when a route asks for its streams' usage."""
    routes = frozenset(r.name for r in policy.routes if r.stream_usage == "ask")
    return [StreamUsageStage(routes)] if routes else []
