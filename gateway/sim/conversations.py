"""The sim's Conversations API (OpenAI's ``/v1/conversations``): conversations kept in this
process's memory, as stored responses are (``other_apis``), so another instance of the sim
has none of them.

``POST /v1/conversations`` makes one (with up to 20 first ``items`` and its ``metadata``);
``GET``, ``POST`` (its metadata) and ``DELETE /v1/conversations/<id>``; its items listed,
added (``POST .../items``), read and deleted (``.../items/<item>``).  A response made with
``conversation`` (an id, or ``{"id": ...}``) reads the conversation's tokens as its input
and adds its input and its answer to it.  Bounded: the last ``MAX_CONVERSATIONS``, least
recently used forgotten first, and ``MAX_ITEMS`` items each."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from gateway.errors import RequestError
from gateway.sim import requests as req
from gateway.sim.openai_api import ENGINE
from gateway.sim.outputs import count_tokens

MAX_CONVERSATIONS = 4096
MAX_ITEMS = 1000
MAX_ADDED = 20
"""Items one request may add (OpenAI's limit)."""
CONVERSATIONS = web.AppKey("conversations", OrderedDict)


class ConversationNotFound(RequestError):
    status = 404
    code = "conversation_not_found"


class ItemNotFound(RequestError):
    status = 404
    code = "item_not_found"


@dataclass
class Conversation:
    id: str
    created_at: int
    metadata: dict[str, Any]
    items: list[dict[str, Any]] = field(default_factory=list)
    tokens: int = 0  # what the conversation so far adds to a response's input

    def shown(self) -> dict[str, Any]:
        made = {"id": self.id, "object": "conversation", "created_at": self.created_at}
        return {**made, "metadata": self.metadata}

    def add(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(self.items) + len(items) > MAX_ITEMS:
            raise req.BadRequest(f"a conversation holds at most {MAX_ITEMS} items")
        added = [{"id": f"msg_{uuid.uuid4().hex}", **item} for item in items]
        self.items.extend(added)
        self.tokens += sum(_tokens(item) for item in added)
        return added


def kept(request: web.Request) -> OrderedDict[str, Conversation]:
    found: OrderedDict[str, Conversation] = request.app[CONVERSATIONS]
    return found


def _named(request: web.Request, cid: str) -> Conversation:
    found = kept(request).get(cid)
    if found is None:
        raise ConversationNotFound(f"Conversation with id '{cid}' not found.")
    kept(request).move_to_end(cid)
    return found


def joined(request: web.Request, body: dict[str, Any]) -> Conversation | None:
    """The conversation a Responses body names in ``conversation``, if any."""
    named = body.get("conversation")
    if named is None:
        return None
    cid = named.get("id") if isinstance(named, dict) else named
    if not isinstance(cid, str):
        raise req.BadRequest("'conversation' must be an id or an object with an 'id'")
    return _named(request, cid)


async def create(request: web.Request) -> web.Response:
    body = await req.read_body(request)
    made = Conversation(
        f"conv_{uuid.uuid4().hex}",
        int(request.app[ENGINE].clock.wall()),
        _metadata(body),
    )
    made.add(_items(body))
    conversations = kept(request)
    conversations[made.id] = made
    while len(conversations) > MAX_CONVERSATIONS:
        conversations.popitem(last=False)
    return web.json_response(made.shown())


async def conversation(request: web.Request) -> web.Response:
    """``GET``, ``POST`` (new metadata) or ``DELETE`` one conversation."""
    found = _named(request, request.match_info["cid"])
    if request.method == "POST":
        found.metadata = _metadata(await req.read_body(request))
    elif request.method == "DELETE":
        del kept(request)[found.id]
        return web.json_response(
            {"id": found.id, "object": "conversation.deleted", "deleted": True}
        )
    return web.json_response(found.shown())


async def items(request: web.Request) -> web.Response:
    """List a conversation's items (oldest first, or ``order=desc``), or add some."""
    found = _named(request, request.match_info["cid"])
    if request.method == "POST":
        shown = found.add(_items(await req.read_body(request), required=True))
    else:
        newest = request.query.get("order", "desc") == "desc"
        shown = list(reversed(found.items)) if newest else list(found.items)
    first, last = (shown[0]["id"], shown[-1]["id"]) if shown else (None, None)
    page = {"object": "list", "data": shown, "first_id": first, "last_id": last}
    return web.json_response({**page, "has_more": False})


async def item(request: web.Request) -> web.Response:
    """``GET`` or ``DELETE`` one item of a conversation."""
    found = _named(request, request.match_info["cid"])
    iid = request.match_info["iid"]
    for at, each in enumerate(found.items):
        if each["id"] == iid:
            if request.method == "DELETE":
                del found.items[at]
                return web.json_response(found.shown())
            return web.json_response(each)
    raise ItemNotFound(f"Item with id '{iid}' not found.")


def _metadata(body: dict[str, Any]) -> dict[str, Any]:
    metadata = body.get("metadata") or {}
    if not isinstance(metadata, dict) or len(metadata) > 16:
        raise req.BadRequest("'metadata' must be an object of at most 16 keys")
    return metadata


def _items(body: dict[str, Any], *, required: bool = False) -> list[dict[str, Any]]:
    given = body.get("items", None if required else [])
    if not isinstance(given, list) or (required and not given):
        raise req.BadRequest("'items' must be a non-empty array" if required else "bad 'items'")
    if len(given) > MAX_ADDED or not all(isinstance(item, dict) for item in given):
        raise req.BadRequest(f"'items' must hold at most {MAX_ADDED} objects")
    return [{"type": "message", **item} for item in given]


def _tokens(item: dict[str, Any]) -> int:
    content = item.get("content")
    if isinstance(content, str):
        return count_tokens(content)
    if isinstance(content, list):
        texts = [part.get("text") for part in content if isinstance(part, dict)]
        return sum(count_tokens(text) for text in texts if isinstance(text, str))
    return 0
