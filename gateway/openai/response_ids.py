"""The Responses API's and the Conversations API's ids bound to the tenant that created them
(``tenants.response_id_secret``); the tags themselves are ``openai.bound_ids``.

A server that stores responses (vLLM with its store on) serves ``GET /v1/responses/<id>``,
``DELETE``, ``/cancel``, ``/input_items`` and a continuation (``previous_response_id``) to
whoever names the id: it knows no tenants.  With the secret set, the gateway shows each
client only ids bound to its own credentials: ``<id>~<endpoint>~<tag>``.  A request naming
an id, in its path or in ``previous_response_id``, has the tag checked and taken off before
it goes upstream; an id without a tag, or with another tenant's, is a 404 (in the path) or a
400 (in the body), answered before any backend is asked.

Only ids the caller owns are tagged, wherever they stand in the answer: the id the server
gave the response it made for this request (the answer's own ``id``, or its ``response``'s
in the first stream event that carries one), and an id the request named and proved its own.
Any other ``resp_...`` in an answer (echoed ``metadata``, input items) stays as it was, so a
client cannot have the gateway sign an id it was never given; and a body that would choose
the response's id itself (vLLM's ``request_id``) is refused.  No state is kept: every
replica that shares the secret (a Secret, through ``${ENV}``) accepts the others' ids, and a
restart keeps them valid.  Answers of these paths are asked for uncompressed, so they can be
read.

A stored response lives on the instance that made it (vLLM keeps them in its memory), so
the id also names that instance, and a request naming the id is pinned to that endpoint
(``Call.pin``), wherever the backend's balancing would have sent it.

The Conversations API's ids (``conv_...``) are bound the same way, on the same secret: the
id of a conversation the server made (``POST /v1/conversations``), tagged with its tenant
and instance; ``/v1/conversations/<id>`` and everything below it (its items), and a
response's ``conversation`` (an id, or ``{"id": ...}``), checked, untagged and pinned; an id
that is not the caller's is a 404 before any backend.

So are items (``msg_...``, ``rs_...``, ``fc_...``): a server resolves an ``item_reference``
in a response's input, or an input item given with its ``id``, to the item it stored under
that id, whoever made it.  The items of an answer whose response or list the caller owns (a
response's ``output``, a list's ``data``: input items, a conversation's items, streamed
``item``\\ s) reach it tagged; every ``id`` among the items a request gives (a response's
``input``, a conversation's ``items``), a conversation item's id in the path, and a list's
``after`` and ``before`` cursors must be the caller's own, and are untagged; else a 404
``item_not_found``.  The container a code interpreter ran in (an item's ``container_id``:
one the server made for the response, ``"container": {"type": "auto"}``) reaches it tagged
as a container, and the files an item cites (a file search's results, a ``file_citation``)
as files (``openai.file_ids`` checks where either is named).  Bodies on these paths that
the edge does not read (a conversation's, a token count's) are read here.  The collections
themselves are not listed (``GET /v1/responses``, ``GET /v1/conversations``: OpenAI has no
such listing, and a backend that had one would show every tenant's).

OpenAI's stored chat completions too (``"store": true``): the id of a completion stored for
its request, whole or in each chunk of its stream, reaches its maker tagged, and every path
below ``/v1/chat/completions/`` (read, update, delete, its messages) must carry the caller's
own; their listing (``GET /v1/chat/completions``) is refused.  A chat request not stored
passes straight on.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any
from urllib.parse import quote, unquote

from gateway.errors import BadRequest, RequestError, shown
from gateway.metrics import Metrics
from gateway.openai.body import decode, dumps_yielding, json_object, loads_yielding
from gateway.openai.bound_answers import (
    Answer,
    answer_json,
    forward,
    refuser,
    untag_cursors,
    untag_or_refuse,
)
from gateway.openai.bound_ids import (
    CHAT_COMPLETION,
    CHAT_PATH,
    CONTAINER,
    CONVERSATION,
    CONVERSATIONS_PATH,
    FILE,
    ITEM,
    RESPONSE,
    Kind,
    Owned,
    PreviousResponseNotFound,
    ResponseIds,
)
from gateway.openai.sse import whole_events
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy
from gateway.wire import RESPONSES_PATH

CHOSEN_ID_FIELDS = ("request_id",)
"""Body fields through which a client would choose the response's id (vLLM's)."""
RESPONSE_BODY_PATHS = frozenset(
    {RESPONSES_PATH, f"{RESPONSES_PATH}/input_tokens", f"{RESPONSES_PATH}/compact"}
)
"""Paths whose body is a response's request (its ids checked); only the first makes one."""
BODY_PATHS = RESPONSE_BODY_PATHS | {CONVERSATIONS_PATH}
COLLECTIONS = {RESPONSES_PATH: RESPONSE, CONVERSATIONS_PATH: CONVERSATION}
"""The paths where a POST makes a stored object (never listed)."""
ITEM_FIELDS = ("input", "items")
"""Body fields holding items: a response's input, a conversation's first or added items."""
LISTS = ("/items", "/input_items", "/messages")
"""What follows a stored object's id in the path of its list of items (a conversation's, a
response's input, a stored chat completion's messages)."""
YIELD_EVERY = 4096
"""Input items checked between turns of the event loop."""
CITING = frozenset({"file_citation", "file_path"})
"""Annotations citing a file by its ``file_id`` (a container's files are named below it)."""
ITEM_ID = re.compile(rb'"item_id":\s*"([^"\\]+)"')
"""A stream event's name of the item it adds to (never inside a string, whose quotes are
escaped)."""


class ResponseIdChosen(RequestError):
    """A body choosing the id of the response it asks for, while ids are bound."""

    code = "response_id_chosen"


class NotListed(RequestError):
    """A listing of every stored response, conversation or chat completion, while ids are
    bound."""

    status = 404
    code = "not_found"


class ResponseIdStage:
    """The stage: untags what a request names, tags what its answer carries."""

    def __init__(self, ids: ResponseIds, refused: Callable[[str, str], None]) -> None:
        self._ids = ids
        self._refused = refused

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        makes: Kind | None = None
        if call.method == "OPTIONS":  # a CORS preflight names and reads nothing
            return await call_next(call)
        if call.path == CHAT_PATH:  # chat's hot path: only a stored completion is bound
            if call.method != "POST":
                raise not_listed(CHAT_COMPLETION)
            if call.json is None or call.json.get("store") is not True:
                return await call_next(call)
            changes: dict[str, Any] = {}
            named: list[Owned] = []
            makes = CHAT_COMPLETION
        elif call.path in BODY_PATHS:
            makes = COLLECTIONS.get(call.path)  # a POST there makes one, a GET would list all
            if makes is not None and call.method != "POST":
                raise not_listed(makes)
            changes, named = await self._untag_body(call)
        elif (found := RESPONSE.by_id.fullmatch(call.path)) is not None:
            changes, named = self._untag_path(call, found.group(1), found.group(2), RESPONSE)
        elif (found := CONVERSATION.by_id.fullmatch(call.path)) is not None:
            changes, named = self._untag_path(call, found.group(1), found.group(2), CONVERSATION)
            if call.body:  # items added to it
                more, items = await self._untag_body(call)
                changes, named = {**changes, **more}, [*named, *items]
        elif (found := CHAT_COMPLETION.by_id.fullmatch(call.path)) is not None:
            changes, named = self._untag_path(call, found.group(1), found.group(2), CHAT_COMPLETION)
        else:
            return await call_next(call)
        scope = call.scope
        return await forward(
            call,
            changes,
            named,
            call_next,
            self._ids,
            lambda made_at: _Answer(self._ids, scope, named, makes=makes, made_at=made_at),
        )

    async def _untag_body(self, call: Call) -> tuple[dict[str, Any], list[Owned]]:
        """What changes in the call (its body, with ``previous_response_id``,
        ``conversation`` and its items' ids untagged), and the ids it proved."""
        data, changes = await read_json(call)
        if data is None:
            return changes, []
        chosen = [name for name in CHOSEN_ID_FIELDS if name in data]
        if chosen and call.path in RESPONSE_BODY_PATHS:
            raise ResponseIdChosen(
                f"'{chosen[0]}' may not be set: the server names each response, and its id "
                "is bound to your credentials"
            )
        named: list[Owned] = []
        changed: dict[str, Any] = {}
        previous = data.get("previous_response_id")
        if isinstance(previous, str):  # else none, or not a string: the backend's to refuse
            owned = self._ids.untag(call.scope, previous)
            if owned is None:
                self._refused(call.tenant, "previous_response_id")
                raise PreviousResponseNotFound(
                    f"Previous response with id '{shown(previous)}' not found."
                )
            changed["previous_response_id"] = owned.id
            named.append(owned)
        conversation = data.get("conversation")
        cid = conversation.get("id") if isinstance(conversation, dict) else conversation
        if isinstance(cid, str):
            owned = self._untag(call, cid, CONVERSATION, "conversation")
            changed["conversation"] = (
                {**conversation, "id": owned.id} if isinstance(conversation, dict) else owned.id
            )
            named.append(owned)
        for field in ITEM_FIELDS:
            items = await self._untag_items(call, data.get(field), named)
            if items is not None:
                changed[field] = items
        if not changed:
            return changes, named
        data = {**data, **changed}
        body = await dumps_yielding(data, len(call.body))
        if call.json is not None:  # the edge's reading, kept up to date
            changes["json"] = data
        return {**changes, "body": body}, named

    async def _untag_items(self, call: Call, items: Any, named: list[Owned]) -> list[Any] | None:
        """``items`` with each item's ``id`` untagged (None when none has one), the ids
        proved added to ``named``; the loop runs between every ``YIELD_EVERY`` items (a body
        may hold a hundred thousand)."""
        if not isinstance(items, list):  # a string input, or the backend's to refuse
            return None
        untagged: list[Any] | None = None
        for at, item in enumerate(items):
            if at and not at % YIELD_EVERY:
                await asyncio.sleep(0)
            iid = item.get("id") if isinstance(item, dict) else None
            if not isinstance(iid, str):
                continue
            owned = self._untag(call, iid, ITEM, "item")
            if untagged is None:
                untagged = list(items)
            untagged[at] = {**item, "id": owned.id}
            named.append(owned)
        return untagged

    def _untag_path(
        self, call: Call, named: str, rest: str | None, kind: Kind
    ) -> tuple[dict[str, Any], list[Owned]]:
        """What changes in the call (its path, with the ids in it and in its query
        untagged), and the ids it proved."""
        owned = [self._untag(call, unquote(named), kind, "path")]
        rest = rest or ""
        if kind is CONVERSATION and (item := ITEM.by_id.fullmatch(rest)) is not None:
            owned.append(self._untag(call, unquote(item.group(1)), ITEM, "path"))
            rest = f"/items/{quote(owned[-1].id, safe='')}{item.group(2) or ''}"
        path = f"{kind.path}/{owned[0].id}{rest}"
        query = call.query
        if rest in LISTS:
            query = untag_cursors(query, lambda v: self._untag(call, v, ITEM, "item"), owned)
        target = f"{path}?{query}" if query else path
        return {"path": path, "query": query, "raw_target": target}, owned

    def _untag(self, call: Call, tagged: str, kind: Kind, where: str) -> Owned:
        """The id of ``kind`` that ``tagged`` carries, if the caller's; else its refusal."""
        return untag_or_refuse(self._ids, self._refused, call, tagged, kind, where)

    def __repr__(self) -> str:
        return "<ResponseIdStage>"


def not_listed(kind: Kind) -> NotListed:
    plural = f"{kind.noun}{'es' if kind.noun.endswith('ch') else 's'}"
    return NotListed(
        f"{plural} are not listed here: their ids are bound to their tenants; name one by its id"
    )


async def read_json(
    call: Call, *, strict: bool = True
) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The call's JSON body (None for none), and what changes in the call to send it as
    read: a body the edge did not read is decoded here, and must be a JSON object.  Not
    ``strict`` (a body not typed as JSON, which a lenient server may read as JSON all the
    same): one that does not open as a JSON object is None, to be passed as it is; one that
    does is read as strictly as any."""
    if call.json is not None or not call.body:
        return call.json, {}
    body, changes = call.body, {}
    encoding = call.header("content-encoding")
    server = call.policy.server
    if encoding is not None:  # one the gateway cannot decode is refused, whatever the type
        body = decode(body, encoding, server.max_body_bytes)
        headers = tuple((k, v) for k, v in call.headers if k.lower() != "content-encoding")
        changes = {"body": body, "headers": headers}
    if not strict and not json_object(body):  # a form, audio, text: no JSON object at all
        return None, {}
    data = await loads_yielding(body, server.max_json_values)  # not UTF-8: refused
    if not isinstance(data, dict):
        raise BadRequest(f"the body of {call.path} must be a JSON object")
    return data, changes


class _Answer(Answer):
    """One answer's ids to tag: those the request proved its own; for a request that makes
    a stored object (``makes``: a response, a conversation), the id the server gave it; and
    the items the answer carries (its response's, its list's, a stream's events').  Those it
    learns are held by the endpoint named ``made_at``."""

    __slots__ = ()

    def whole(self, body: bytes) -> bytes:
        data = answer_json(body)
        if isinstance(data, dict):
            self._made(data)
            self._learn(data.get("output") if data.get("object") == "response" else None)
            self._learn(data.get("data") if data.get("object") == "list" else None)
        return self._ids.tag_owned(self._scope, body, self._owned)

    async def events(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for events in whole_events(stream):
            chunk = self._makes is CHAT_COMPLETION  # its id in the chunk itself
            for line in events.splitlines():
                if line.startswith(b"data:") and (
                    b'"response"' in line or b'"item"' in line or b'"annotation"' in line or chunk
                ):
                    event = answer_json(line[5:])
                    if isinstance(event, dict):
                        self._made(event if chunk else None)
                        chunk = self._makes is CHAT_COMPLETION
                        made = event.get("response")
                        self._made(made)
                        self._learn(made.get("output") if isinstance(made, dict) else None)
                        self._learn([event.get("item")])
                        for fid in _annotated([event.get("annotation")]):  # one added
                            self._own(fid, FILE)
            if b'"item_id"' in events:  # a server may name the item first in its deltas
                self._learn(
                    [{"id": iid.decode(errors="replace")} for iid in ITEM_ID.findall(events)]
                )
            yield self._ids.tag_owned(self._scope, events, self._owned)

    def _made(self, made: Any) -> None:
        """Learn the id of ``made``, when it is an object of the kind made, with an id."""
        kind = self._makes
        if kind is None or not isinstance(made, dict):
            return
        if made.get("object") not in (kind.object, f"{kind.object}.chunk"):  # chat streams
            return
        rid = made.get("id")
        if isinstance(rid, str) and rid.startswith(kind.prefix):
            self._owned.append(Owned(rid, self._made_at, kind))
            self._makes = None

    def _learn(self, items: Any) -> None:
        """Learn the ids of ``items`` (an answer's, whose response or list the caller owns),
        the container each ran in and the files each cites."""
        if not isinstance(items, list):
            return
        for item in items:
            if not isinstance(item, dict):
                continue
            self._own(item.get("id"), ITEM)
            self._own(item.get("container_id"), CONTAINER)  # a code interpreter's
            for fid in _cited(item):
                self._own(fid, FILE)


def _cited(item: dict[str, Any]) -> Iterator[Any]:
    """The files an item cites: a message's file citations, a file search's results.  A
    request naming one is checked (``openai.file_ids``), so one given back is the caller's."""
    results = item.get("results")
    if item.get("type") == "file_search_call" and isinstance(results, list):
        yield from (each.get("file_id") for each in results if isinstance(each, dict))
    content = item.get("content")
    for part in content if isinstance(content, list) else ():
        notes = part.get("annotations") if isinstance(part, dict) else None
        yield from _annotated(notes)


def _annotated(notes: Any) -> Iterator[Any]:
    """The files ``notes`` (an output text's annotations) cite."""
    for note in notes if isinstance(notes, list) else ():
        if isinstance(note, dict) and note.get("type") in CITING:
            yield note.get("file_id")


def build(policy: Policy, metrics: Metrics) -> list[Stage]:
    """The stage, when the policy binds response ids to tenants."""
    secret = policy.tenants.response_id_secret
    if not secret:
        return []
    return [ResponseIdStage(ResponseIds(secret), refuser(metrics))]
