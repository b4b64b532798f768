"""The Responses API's ids bound to the tenant that created them
(``tenants.response_id_secret``).

A server that stores responses (vLLM with its store on) serves ``GET /v1/responses/<id>``,
``DELETE``, ``/cancel``, ``/input_items`` and a continuation (``previous_response_id``) to
whoever names the id: it knows no tenants.  With the secret set, the gateway shows each
client only ids bound to its own credentials: ``<id>~<tag>``, the tag an HMAC-SHA256 over
the tenant scope (``Call.scope``, the same one the cache keys on) and the id, under the
secret.  A request naming an id, in its path or in ``previous_response_id``, has the tag
checked and taken off before it goes upstream; an id without a tag, or with another
tenant's, is a 404 (in the path) or a 400 (in the body), answered before any backend is
asked.

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
the id also names that instance: ``<id>~<endpoint>~<tag>``, the endpoint a short HMAC of
its URL under the secret (it tells nothing of the URL), covered by the tag.  A request
naming the id is pinned to that endpoint (``Call.pin``), wherever the backend's balancing
would have sent it.  Ids tagged before endpoints were named (``<id>~<tag>``) are still
accepted, unpinned.

The Conversations API's ids (``conv_...``) are bound the same way, on the same secret: the
id of a conversation the server made (``POST /v1/conversations``), tagged with its tenant
and instance; ``/v1/conversations/<id>`` and everything below it (its items), and a
response's ``conversation`` (an id, or ``{"id": ...}``), checked, untagged and pinned; an id
that is not the caller's is a 404 before any backend.  A tagged id of one kind never passes
as the other's: the kind's prefix is part of what the tag covers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import re
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any
from urllib.parse import unquote

from gateway.errors import RequestError
from gateway.metrics import Metrics
from gateway.openai.allowed_models import uncompressed
from gateway.openai.body import dumps_yielding
from gateway.openai.sse import whole_events
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy
from gateway.wire import RESPONSES_PATH

CONVERSATIONS_PATH = "/v1/conversations"
TAG_CHARS = 24
SEPARATOR = "~"
HANDLE_CHARS = 8
"""Hex characters of an endpoint's name in an id (a backend has at most 64 endpoints)."""
MAX_HANDLES = 1024
"""Endpoint names remembered (discovery may bring new URLs); all forgotten when full."""
CHOSEN_ID_FIELDS = ("request_id",)
"""Body fields through which a client would choose the response's id (vLLM's)."""


class ResponseNotFound(RequestError):
    """A response id in the path that is not this tenant's: OpenAI's answer for an id it
    does not have."""

    status = 404
    code = "response_not_found"


class PreviousResponseNotFound(RequestError):
    """A ``previous_response_id`` that is not this tenant's."""

    code = "previous_response_not_found"


class ConversationNotFound(RequestError):
    """A conversation id, in the path or a response's ``conversation``, that is not this
    tenant's."""

    status = 404
    code = "conversation_not_found"


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """A kind of stored object whose ids are bound: its ids' prefix, its ``object`` name in
    an answer, the path that makes one and the paths that name one (the id, then the rest)."""

    prefix: str
    object: str
    path: str
    by_id: re.Pattern[str]
    noun: str
    not_found: type[RequestError]


RESPONSE = Kind(
    "resp_",
    "response",
    RESPONSES_PATH,
    re.compile(r"/v1/responses/(resp_[^/]*)(/.*)?"),  # not /v1/responses/input_tokens
    "Response",
    ResponseNotFound,
)
CONVERSATION = Kind(
    "conv_",
    "conversation",
    CONVERSATIONS_PATH,
    re.compile(r"/v1/conversations/([^/]*)(/.*)?"),  # each path below names one
    "Conversation",
    ConversationNotFound,
)


Owned = tuple[str, str]
"""An id a caller owns, and the name of the endpoint that holds it ("" for none known)."""


class ResponseIds:
    """Tags ids for a scope, and checks them; see the module docstring."""

    __slots__ = ("_handles", "_keyed", "_proved")

    def __init__(self, secret: str) -> None:
        self._keyed = hmac.new(secret.encode(), digestmod=hashlib.sha256)
        self._handles: dict[str, str] = {}
        self._proved: dict[tuple[str, str, str], str] = {}  # ids just proved, as shown

    def handle(self, url: str) -> str:
        """The name of the endpoint at ``url`` in the ids it holds."""
        known = self._handles.get(url)
        if known is None:
            if len(self._handles) >= MAX_HANDLES:
                self._handles.clear()
            mac = self._keyed.copy()
            mac.update(f"endpoint\0{url}".encode())
            known = self._handles[url] = mac.hexdigest()[:HANDLE_CHARS]
        return known

    def pin(self, handle: str) -> Callable[[str], bool]:
        """The test of endpoint URLs that picks the endpoint named ``handle``."""
        return lambda url: self.handle(url) == handle

    def tag(self, scope: str, rid: str, handle: str = "") -> str:
        proved = self._proved.get((scope, rid, handle))
        if proved is not None:  # an id a request named, tagged again in its answer
            return proved
        mac = self._keyed.copy()
        if handle:
            mac.update(f"{scope}\0{rid}\0{handle}".encode())
            return f"{rid}{SEPARATOR}{handle}{SEPARATOR}{mac.hexdigest()[:TAG_CHARS]}"
        mac.update(f"{scope}\0{rid}".encode())  # an id from before endpoints were named
        return f"{rid}{SEPARATOR}{mac.hexdigest()[:TAG_CHARS]}"

    def untag(self, scope: str, tagged: str, kind: Kind = RESPONSE) -> Owned | None:
        """The id of ``kind`` that ``tagged`` carries and its endpoint's name, if its tag is
        ``scope``'s; else None."""
        shown, separator, _ = tagged.rpartition(SEPARATOR)
        if not separator:
            return None
        rid, separator, handle = shown.rpartition(SEPARATOR)
        if separator and len(handle) == HANDLE_CHARS and rid.startswith(kind.prefix):
            if hmac.compare_digest(self.tag(scope, rid, handle), tagged):
                return self._proves(scope, rid, handle, tagged)
        if shown.startswith(kind.prefix) and hmac.compare_digest(self.tag(scope, shown), tagged):
            return self._proves(scope, shown, "", tagged)
        return None

    def _proves(self, scope: str, rid: str, handle: str, tagged: str) -> Owned:
        """``tagged`` is ``rid``'s tag for ``scope``: remembered, so that the answer that
        carries the id again does not compute it again (the last ``MAX_HANDLES``)."""
        if len(self._proved) >= MAX_HANDLES:
            self._proved.clear()
        self._proved[(scope, rid, handle)] = tagged
        return rid, handle

    def tag_owned(self, scope: str, data: bytes, owned: Iterable[Owned]) -> bytes:
        """``data`` with each id ``scope`` owns, as a JSON string, tagged."""
        for rid, handle in owned:
            quoted = f'"{rid}"'.encode()
            if quoted in data:  # never inside a string: its quotes would be escaped
                data = data.replace(quoted, f'"{self.tag(scope, rid, handle)}"'.encode())
        return data


class ResponseIdChosen(RequestError):
    """A body choosing the id of the response it asks for, while ids are bound."""

    code = "response_id_chosen"


class ResponseIdStage:
    """The stage: untags what a request names, tags what its answer carries."""

    def __init__(self, ids: ResponseIds, refused: Callable[[str, str], None]) -> None:
        self._ids = ids
        self._refused = refused

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        makes: Kind | None = None
        if call.path == RESPONSES_PATH:
            changes, named = await self._untag_body(call)
            makes = RESPONSE if call.method == "POST" else None
        elif call.path == CONVERSATIONS_PATH:
            changes, named = {}, []
            makes = CONVERSATION if call.method == "POST" else None
        elif (found := RESPONSE.by_id.fullmatch(call.path)) is not None:
            changes, named = self._untag_path(call, found, RESPONSE)
        elif (found := CONVERSATION.by_id.fullmatch(call.path)) is not None:
            changes, named = self._untag_path(call, found, CONVERSATION)
        else:
            return await call_next(call)
        handles = [handle for _, handle in named if handle]
        if handles:
            changes["pin"] = self._ids.pin(handles[0])
        scope = call.scope
        reply = await call_next(
            dataclasses.replace(call, headers=uncompressed(call.headers), **changes)
        )
        made_at = self._ids.handle(reply.endpoint) if reply.endpoint else ""
        answer = _Answer(self._ids, scope, named, makes=makes, made_at=made_at)
        if reply.body is not None:
            return reply.replace(body=answer.whole(reply.body))
        assert reply.stream is not None
        return reply.replace(stream=answer.events(reply.stream), content_length=None)

    async def _untag_body(self, call: Call) -> tuple[dict[str, Any], list[Owned]]:
        """What changes in the call (its body, with ``previous_response_id`` and
        ``conversation`` untagged), and the ids it proved."""
        data = call.json
        if data is None:
            return {}, []
        chosen = [name for name in CHOSEN_ID_FIELDS if name in data]
        if chosen:
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
                    f"Previous response with id '{_shown(previous)}' not found."
                )
            changed["previous_response_id"] = owned[0]
            named.append(owned)
        conversation = data.get("conversation")
        cid = conversation.get("id") if isinstance(conversation, dict) else conversation
        if isinstance(cid, str):
            owned = self._ids.untag(call.scope, cid, CONVERSATION)
            if owned is None:
                self._refused(call.tenant, "conversation")
                raise ConversationNotFound(f"Conversation with id '{_shown(cid)}' not found.")
            changed["conversation"] = (
                {**conversation, "id": owned[0]} if isinstance(conversation, dict) else owned[0]
            )
            named.append(owned)
        if not changed:
            return {}, []
        data = {**data, **changed}
        body = await dumps_yielding(data, len(call.body))
        return {"json": data, "body": body}, named

    def _untag_path(
        self, call: Call, found: re.Match[str], kind: Kind
    ) -> tuple[dict[str, Any], list[Owned]]:
        """What changes in the call (its path, with the id untagged), and the id it proved."""
        named = unquote(found.group(1))
        owned = self._ids.untag(call.scope, named, kind)
        if owned is None:
            self._refused(call.tenant, "path")
            raise kind.not_found(f"{kind.noun} with id '{_shown(named)}' not found.")
        path = f"{kind.path}/{owned[0]}{found.group(2) or ''}"
        target = f"{path}?{call.query}" if call.query else path
        return {"path": path, "raw_target": target}, [owned]

    def __repr__(self) -> str:
        return "<ResponseIdStage>"


class _Answer:
    """One answer's ids to tag: those the request proved its own, and, for a request that
    makes a stored object (``makes``: a response, a conversation), the id the server gave
    it, read from the answer, held by the endpoint named ``made_at``."""

    __slots__ = ("_ids", "_made_at", "_makes", "_owned", "_scope")

    def __init__(
        self,
        ids: ResponseIds,
        scope: str,
        owned: list[Owned],
        *,
        makes: Kind | None,
        made_at: str,
    ) -> None:
        self._ids, self._scope, self._owned, self._makes = ids, scope, owned, makes
        self._made_at = made_at

    def whole(self, body: bytes) -> bytes:
        if self._makes is not None:
            self._made(_json(body))
        return self._ids.tag_owned(self._scope, body, self._owned)

    async def events(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for events in whole_events(stream):
            if self._makes is not None:  # until the first event that carries the response
                for line in events.splitlines():
                    if line.startswith(b"data:") and b'"response"' in line:
                        event = _json(line[5:])
                        if isinstance(event, dict) and self._made(event.get("response")):
                            break
            yield self._ids.tag_owned(self._scope, events, self._owned)

    def _made(self, made: Any) -> bool:
        """Learn the id of ``made``, when it is an object of the kind made, with an id."""
        kind = self._makes
        if kind is None or not isinstance(made, dict) or made.get("object") != kind.object:
            return False
        rid = made.get("id")
        if not isinstance(rid, str) or not rid.startswith(kind.prefix):
            return False
        self._owned = [*self._owned, (rid, self._made_at)]
        self._makes = None
        return True


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError):
        return None


def _shown(value: str) -> str:
    return value if len(value) <= 200 else value[:200] + "..."


def build(policy: Policy, metrics: Metrics) -> list[Stage]:
    """The stage, when the policy binds response ids to tenants."""
    secret = policy.tenants.response_id_secret
    if not secret:
        return []

    def refused(tenant: str, where: str) -> None:
        metrics.response_ids_refused.labels(tenant, where).inc()

    return [ResponseIdStage(ResponseIds(secret), refused)]
