"""The forward of a request whose ids are bound (``openai.response_ids``,
``openai.file_ids``), and the reading of its answer: pinned to the instance that keeps what
it names, its answer asked for uncompressed and read whole where it can be, so that every
id the caller owns is found and tagged."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol
from urllib.parse import quote, unquote_plus

from gateway.errors import shown
from gateway.metrics import Metrics
from gateway.openai.allowed_models import uncompressed
from gateway.openai.bound_ids import Kind, Owned, ResponseIds
from gateway.openai.sse import is_event_stream
from gateway.pipeline import Call, Handler, Reply

CURSORS = ("after", "before")
"""Query parameters of lists naming an item of the list."""


def refuser(metrics: Metrics) -> Callable[[str, str], None]:
    """What counts a request refused for naming what is not its tenant's: by tenant, and
    where the id stood."""

    def refused(tenant: str, where: str) -> None:
        metrics.response_ids_refused.labels(tenant, where).inc()

    return refused


class Tagging(Protocol):
    """Tags the ids one answer's caller owns: in a whole body, or in a stream's events."""

    def whole(self, body: bytes) -> bytes: ...

    def events(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]: ...


class Answer:
    """What a stage's ``Tagging`` of one answer starts from: the ids, the caller's scope, the
    ids it owns (those the request proved, and those the answer teaches: ``owned`` grows),
    the kind of object the request makes (None for none) and the endpoint that answered."""

    __slots__ = ("_ids", "_learned", "_made_at", "_makes", "_owned", "_scope")

    def __init__(
        self, ids: ResponseIds, scope: str, owned: list[Owned], *, makes: Kind | None, made_at: str
    ) -> None:
        self._ids, self._scope, self._owned, self._makes = ids, scope, owned, makes
        self._made_at = made_at
        self._learned = {each.id for each in owned}

    def _own(self, oid: Any, kind: Kind) -> None:
        """Own ``oid`` (an id the answer teaches, held where it answered), once."""
        if isinstance(oid, str) and oid and oid not in self._learned:
            self._learned.add(oid)
            self._owned.append(Owned(oid, self._made_at, kind))


def pinned(changes: dict[str, Any], named: Sequence[Owned], ids: ResponseIds) -> dict[str, Any]:
    """``changes`` with the call pinned to the endpoint of the first of ``named`` that names
    one (none: as they were)."""
    handles = [owned.handle for owned in named if owned.handle]
    return {**changes, "pin": ids.pin(handles[0])} if handles else changes


async def forward(
    call: Call,
    changes: dict[str, Any],
    named: Sequence[Owned],
    call_next: Handler,
    ids: ResponseIds,
    tagging: Callable[[str], Tagging],
) -> Reply:
    """``call`` with ``changes``, pinned (``pinned``) and asked for an uncompressed answer,
    whose ids are tagged by ``tagging(made_at)`` (``made_at``: the name of the endpoint that
    answered)."""
    changes = pinned(changes, named, ids)
    headers = changes.pop("headers", call.headers)
    reply = await call_next(dataclasses.replace(call, headers=uncompressed(headers), **changes))
    answer = tagging(ids.handle(reply.endpoint) if reply.endpoint else "")
    if reply.stream is not None and not is_event_stream(reply.headers):
        reply = await read_whole(reply, call.policy.server.max_body_bytes)
    if reply.body is not None:
        return reply.replace(body=answer.whole(reply.body))
    assert reply.stream is not None
    return reply.replace(stream=answer.events(reply.stream), content_length=None)


async def read_whole(reply: Reply, limit: int) -> Reply:
    """An answer that is no event stream but came as one (larger than the transport reads
    whole) read whole, up to ``limit`` bytes, so that its ids are found wherever they stand;
    past it, the stream as it came (its ids then tagged piece by piece: one split between
    two pieces stays as the server wrote it)."""
    assert reply.stream is not None
    stream = aiter(reply.stream)
    pieces: list[bytes] = []
    size = 0
    async for piece in stream:
        pieces.append(piece)
        size += len(piece)
        if size > limit:
            return reply.replace(stream=_chained(pieces, stream))
    return reply.replace(body=b"".join(pieces), stream=None, content_length=None)


async def _chained(read: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    for piece in read:
        yield piece
    async for piece in rest:
        yield piece


def untag_cursors(query: str, untag: Callable[[str], Owned], named: list[Owned]) -> str:
    """``query`` with a list's cursors (``after``, ``before``) untagged by ``untag``, the ids
    proved added to ``named``."""
    if not query:
        return query
    params = query.split("&")
    for at, param in enumerate(params):
        name, _, value = param.partition("=")
        if unquote_plus(name) in CURSORS:  # however the name is spelled
            named.append(untag(unquote_plus(value)))
            params[at] = f"{name}={quote(named[-1].id, safe='')}"
    return "&".join(params)


def untag_or_refuse(
    ids: ResponseIds,
    refused: Callable[[str, str], None],
    call: Call,
    tagged: str,
    kind: Kind,
    where: str,
) -> Owned:
    """The id of ``kind`` that ``tagged`` carries, if ``call``'s caller's; else its refusal
    (a 404 in ``kind``'s words), counted by ``refused`` under ``where``."""
    owned = ids.untag(call.scope, tagged, kind)
    if owned is None:
        refused(call.tenant, where)
        raise kind.not_found(f"{kind.noun} with id '{shown(tagged)}' not found.")
    return owned


def answer_json(data: bytes) -> Any:
    """``data`` read as JSON; None for what is not."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
