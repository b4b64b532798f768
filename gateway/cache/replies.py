"""Replies to and from the cache: a hit answered in the shape the client asked for, and a
miss's stream relayed untouched while it is recorded for storing.

A hit is one ``Reply`` body: SSE events (OpenAI chunks ending in ``[DONE]``) for a streaming
request, a JSON answer otherwise, whichever shape was stored.  Anthropic's Messages API's
streams are stored and replayed byte for byte (``verbatim``), only once they ended with
``message_stop`` and no ``error`` event; a whole answer is never made of them, nor they of
one (their shape is in their key).  A miss's stream goes through
``Tee``, which hands each chunk on as it arrives and, only once the stream has ended
normally, passes what it recorded to a callback that stores it.  A stream that breaks off
(an upstream error) or that the client abandons never reaches the callback.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable

from gateway.cache.entry import CachedResponse
from gateway.cache.keys import AS_SENT_PATHS
from gateway.openai.sse import StreamRecorder, events_to_json, json_to_events, render_sse
from gateway.pipeline import Headers, Reply
from gateway.transport.headers import SSE_TYPE, is_event_stream, is_streamed
from gateway.wire import MESSAGES_PATH

log = logging.getLogger("gateway.cache")

HIT, MISS, BYPASS, NONE = "hit", "miss", "bypass", "none"
"""``X-Gateway-Cache`` values and the ``match`` label of a lookup that did not hit."""
CACHE_HEADER = "X-Gateway-Cache"
MATCH_HEADER = "X-Gateway-Cache-Match"
SIMILARITY_HEADER = "X-Gateway-Cache-Similarity"
ITEMS_HEADER = "X-Gateway-Cache-Items"
KEY_HEADER = "X-Gateway-Cache-Key"
"""Names a whole cached answer's entry, for ``POST /cache/feedback`` (``cache.feedback``)."""
MAX_RECORDED_BYTES = 4 * 1024 * 1024
JSON_TYPE = "application/json"


def verbatim(path: str) -> bool:
    """Whether a stream of ``path`` is stored and replayed as it came (Anthropic's, the
    Responses API's)."""
    return path.endswith(AS_SENT_PATHS)


_MESSAGES_END = (  # how a stream ends well, and the event that says it failed
    re.compile(rb"^event: ?message_stop\r?$", re.MULTILINE),
    re.compile(rb"^event: ?error\r?$", re.MULTILINE),
)
_RESPONSES_END = (
    re.compile(rb"^event: ?response\.(completed|incomplete)\r?$", re.MULTILINE),
    re.compile(rb"^event: ?(error|response\.failed)\r?$", re.MULTILINE),
)


Put = Callable[[tuple[str, ...] | None, bytes | None], Awaitable[None]]
"""Stores an answer once whole: the SSE events of an OpenAI stream, or the body as it came."""
UNFINISHED, TOO_LARGE = "unfinished", "too_large"
"""Why an answer was not kept (``gateway_cache_not_stored_total``'s reasons besides the
backend's): a stream that did not end well (cut, an error event, no end), one over
``MAX_RECORDED_BYTES``."""


def whole_stream(put: Put, path: str, refused: Callable[[str], None]) -> Put:
    """``put`` for a verbatim stream of ``path``: only one that ended (``message_stop``;
    the Responses API's ``response.completed`` or ``response.incomplete``) without an
    ``error`` event (or ``response.failed``) is stored; ``refused`` hears of any other."""
    ended, failed = _MESSAGES_END if path.endswith(MESSAGES_PATH) else _RESPONSES_END

    async def checked(events: tuple[str, ...] | None, body: bytes | None) -> None:
        if body is not None and ended.search(body) and not failed.search(body):
            await put(None, body)
        else:
            refused(UNFINISHED)

    return checked


async def keep(
    reply: Reply, put: Put, path: str, own: bool, refused: Callable[[str], None]
) -> Reply:
    """``reply``, its answer handed to ``put`` once whole: a body now, a stream once it has
    ended normally (the reply returned tees it).  An OpenAI stream is stored as its events;
    Anthropic's and the Responses API's (``verbatim``) and a server's own answer (``own``)
    as they came.  ``refused`` hears why an answer was not kept (``UNFINISHED``,
    ``TOO_LARGE``)."""
    events = is_event_stream(reply.headers)
    verbatim_stream = events and verbatim(path)  # stored as it came, once whole
    as_sent = verbatim_stream or own
    store = whole_stream(put, path, refused) if verbatim_stream else put
    if reply.body is not None and (not events or as_sent):
        await store(None, reply.body)
    elif reply.body is not None:
        async for _ in Tee(once(reply.body), events=True, on_complete=put, refused=refused):
            pass
    elif reply.stream is not None:
        tee = Tee(reply.stream, events=events and not as_sent, on_complete=store, refused=refused)
        return reply.replace(stream=tee)
    return reply


def hit_body(
    entry: CachedResponse, *, streaming: bool, include_usage: bool, as_sent: bool = False
) -> tuple[bytes, str]:
    """(body, content type) of a cached answer in the shape the client asked for;
    ``ValueError`` when a stored JSON answer cannot be converted, or when an answer stored
    as sent (``as_sent``, ``verbatim``) is not in that shape."""
    stored = _content_type(entry.headers) or ""
    sent_as_stream = entry.body is not None and is_streamed((("content-type", stored),))
    if as_sent or sent_as_stream:
        if entry.body is None or sent_as_stream != streaming:  # its own shape only
            raise ValueError("an answer stored as sent is replayed in its own shape only")
        return entry.body, stored
    if streaming:
        if entry.events is not None:
            return render_sse(entry.events, include_usage=include_usage), SSE_TYPE
        answer = _json_object(entry.body or b"")
        events = json_to_events(answer, include_usage=include_usage)
        return render_sse(events, include_usage=include_usage), SSE_TYPE
    if entry.body is not None:
        return entry.body, _content_type(entry.headers) or JSON_TYPE
    answer_bytes = json.dumps(events_to_json(entry.events or ()), separators=(",", ":"))
    return answer_bytes.encode(), JSON_TYPE


def hit_reply(
    entry: CachedResponse, body: bytes, content_type: str, cache_headers: Headers
) -> Reply:
    """The reply for a hit: the stored headers with the content type of its shape."""
    kept = tuple((k, v) for k, v in entry.headers if k.lower() != "content-type")
    headers = (*kept, ("Content-Type", content_type), *cache_headers)
    return Reply(200, headers, body=body, backend=entry.backend)


async def once(data: bytes) -> AsyncIterator[bytes]:
    """A whole body as a stream of one chunk."""
    yield data


class Tee:
    """An async iterator relaying ``stream`` and recording it; ``on_complete`` gets the
    stored form once the stream has ended normally: the SSE events of an event stream
    (only when ``StreamRecorder`` finds it complete) or the whole body of any other.
    ``refused`` hears why a stream was not handed on (``UNFINISHED``: cut off, or not
    complete; ``TOO_LARGE``)."""

    def __init__(
        self,
        stream: AsyncIterator[bytes],
        *,
        events: bool,
        on_complete: Put,
        max_bytes: int = MAX_RECORDED_BYTES,
        refused: Callable[[str], None] = lambda _: None,
    ) -> None:
        self._stream = stream
        self._events = events
        self._recorder = StreamRecorder(max_bytes) if events else None
        self._body = bytearray()
        self._max_bytes = max_bytes
        self._overflowed = False
        self._on_complete = on_complete
        self._refused = refused
        self._done = False

    def __aiter__(self) -> Tee:
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            if not self._done:
                self._done = True
                await self._complete()
            raise
        except Exception:  # the stream was cut off: its error goes on to the client
            if not self._done:
                self._done = True
                self._refused(UNFINISHED)
            raise
        if self._recorder is not None:
            self._recorder.feed(chunk)
        elif not self._overflowed:
            self._body += chunk
            if len(self._body) > self._max_bytes:
                self._overflowed = True
                self._body = bytearray()
        return chunk

    async def _complete(self) -> None:
        try:
            if self._recorder is not None:
                events = self._recorder.result()
                if events is not None:
                    await self._on_complete(events, None)
                else:
                    self._refused(TOO_LARGE if self._recorder.overflowed else UNFINISHED)
            elif self._overflowed:
                self._refused(TOO_LARGE)
            else:
                await self._on_complete(None, bytes(self._body))
        except Exception:  # storing must never break the client's stream
            log.exception("storing a completed stream failed")

    def __repr__(self) -> str:
        return f"<Tee events={self._events} done={self._done} recorder={self._recorder!r}>"


async def read_whole(reply: Reply) -> bytes:
    """A reply's whole body, its stream drained if it came as one."""
    if reply.body is not None:
        return reply.body
    assert reply.stream is not None
    data = bytearray()
    async for chunk in reply.stream:
        data += chunk
    return bytes(data)


def _json_object(body: bytes) -> dict[str, object]:
    try:
        answer = json.loads(body)
    except RecursionError:  # stored as the backend sent it: nested past the parser's depth
        raise ValueError("stored answer nests past what json reads") from None
    if not isinstance(answer, dict):
        raise ValueError("stored answer is not a JSON object")
    return answer


def _content_type(headers: Headers) -> str | None:
    for key, value in headers:
        if key.lower() == "content-type":
            return value
    return None
