"""Ids of stored objects bound to the tenant that made them and the instance that keeps them
(``tenants.response_id_secret``): the tags, their checks, and the kinds of object.

An id reaches its owner as ``<id>~<endpoint>~<tag>``: the endpoint a short HMAC of its URL
under the secret (it tells nothing of the URL), the tag an HMAC-SHA256 over the tenant scope
(``Call.scope``, the same one the cache keys on), the id and the endpoint.  Ids tagged
before endpoints were named (``<id>~<tag>``) are still accepted, unpinned.  A tagged id of
one kind never passes as another's: a response's and a conversation's prefix is part of what
the tag covers, and an item's tag is made under a salt of its own (items have no one
prefix: ``msg_``, ``rs_``, ``fc_`` and more).  The stage that uses them:
``openai.response_ids``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from gateway.errors import RequestError
from gateway.wire import RESPONSES_PATH

CONVERSATIONS_PATH = "/v1/conversations"
CHAT_PATH = "/v1/chat/completions"
TAG_CHARS = 24
SEPARATOR = "~"
HANDLE_CHARS = 8
"""Hex characters of an endpoint's name in an id (a backend has at most 64 endpoints)."""
MAX_HANDLES = 1024
"""Endpoint names remembered (discovery may bring new URLs); all forgotten when full."""
FEW_OWNED = 8
"""Past this many ids to tag in one body, they are tagged in one pass over it."""


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


class ItemNotFound(RequestError):
    """An item id (an input item's, an ``item_reference``'s, a conversation item's in the
    path, a list's cursor) that is not this tenant's."""

    status = 404
    code = "item_not_found"


class FileNotFound(RequestError):
    """A file id, in the path or a body, that is not this tenant's."""

    status = 404
    code = "file_not_found"


class ContainerNotFound(RequestError):
    """A container id, in the path or a body, that is not this tenant's."""

    status = 404
    code = "container_not_found"


class ChatCompletionNotFound(RequestError):
    """A stored chat completion's id in the path that is not this tenant's."""

    status = 404
    code = "chat_completion_not_found"


@dataclasses.dataclass(frozen=True, slots=True)
class Kind:
    """A kind of stored object whose ids are bound: its ids' prefix, its ``object`` name in
    an answer, the path that makes one and the paths that name one (the id, then the rest),
    and the salt its tags are made under ("" for the kinds bound before items were)."""

    prefix: str
    object: str
    path: str
    by_id: re.Pattern[str]
    noun: str
    not_found: type[RequestError]
    salt: str = ""


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
ITEM = Kind(
    "",  # msg_, rs_, fc_, ...: any prefix, told apart from the others by the salt
    "item",
    "",  # made with a response or a conversation, not by a path of their own
    re.compile(r"/items/([^/]*)(/.*)?"),  # below a conversation's path
    "Item",
    ItemNotFound,
    salt="item",
)

CHAT_COMPLETION = Kind(
    "",  # chatcmpl-... at OpenAI, vLLM and llama.cpp; any, told apart by the salt
    "chat.completion",  # a stream's chunks: chat.completion.chunk
    CHAT_PATH,
    re.compile(r"/v1/chat/completions/([^/]*)(/.*)?"),  # each path below names one
    "Chat completion",
    ChatCompletionNotFound,
    salt="chat",
)
FILE = Kind(
    "",  # file-... at OpenAI, file_... at Anthropic: any, told apart by the salt
    "file",
    "/v1/files",
    re.compile(r"/v1/files/([^/]*)(/.*)?"),
    "File",
    FileNotFound,
    salt="file",
)
"""A file: made by ``POST /v1/files`` or an upload completed (``openai.file_ids``), cited by a
response's file search (``openai.response_ids``)."""
CONTAINER = Kind(
    "",  # cntr_... at OpenAI; any, told apart by the salt
    "container",
    "/v1/containers",
    re.compile(r"/v1/containers/([^/]*)(/.*)?"),  # each path below names one
    "Container",
    ContainerNotFound,
    salt="container",
)
"""A code interpreter's container: made by a POST, or by a response whose tool asked for one
(``"container": {"type": "auto"}``); its files are named below it."""


class Owned(NamedTuple):
    """An id a caller owns, the name of the endpoint that holds it ("" for none known), and
    its kind."""

    id: str
    handle: str
    kind: Kind


class ResponseIds:
    """Tags ids for a scope, and checks them; see the module docstring."""

    __slots__ = ("_handles", "_keyed", "_proved")

    def __init__(self, secret: str) -> None:
        self._keyed = hmac.new(secret.encode(), digestmod=hashlib.sha256)
        self._handles: dict[str, str] = {}
        self._proved: dict[tuple[str, str, str, str], str] = {}  # ids just proved, as shown

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

    def tag(self, scope: str, rid: str, handle: str = "", kind: Kind = RESPONSE) -> str:
        """``rid``'s tag for ``scope``, remembered: the answer that carries the id again
        (each chunk of a chat stream does) does not compute it again."""
        key = (scope, rid, handle, kind.salt)
        known = self._proved.get(key)
        if known is None:
            known = self._mac(scope, rid, handle, kind)
            self._remember(key, known)
        return known

    def untag(self, scope: str, tagged: str, kind: Kind = RESPONSE) -> Owned | None:
        """The id of ``kind`` that ``tagged`` carries and its endpoint's name, if its tag is
        ``scope``'s; else None.  Only an id proved is remembered: a client's guesses, of any
        length, are not."""
        shown, separator, _ = tagged.rpartition(SEPARATOR)
        if not separator:
            return None
        rid, separator, handle = shown.rpartition(SEPARATOR)
        readings = (  # with its endpoint's name, or one from before endpoints were named
            Owned(rid, handle, kind) if separator and len(handle) == HANDLE_CHARS else None,
            Owned(shown, "", kind),
        )
        for owned in readings:
            if owned is None or not owned.id.startswith(kind.prefix):
                continue
            key = (scope, owned.id, owned.handle, kind.salt)
            known = self._proved.get(key) or self._mac(scope, owned.id, owned.handle, kind)
            if hmac.compare_digest(known, tagged):
                self._remember(key, known)
                return owned
        return None

    def _mac(self, scope: str, rid: str, handle: str, kind: Kind) -> str:
        """``rid`` tagged for ``scope`` (and the endpoint ``handle``, if any)."""
        mac = self._keyed.copy()
        salt = f"{kind.salt}\0" if kind.salt else ""
        if handle:
            mac.update(f"{salt}{scope}\0{rid}\0{handle}".encode())
            return f"{rid}{SEPARATOR}{handle}{SEPARATOR}{mac.hexdigest()[:TAG_CHARS]}"
        mac.update(f"{salt}{scope}\0{rid}".encode())  # no endpoint: from before they were named
        return f"{rid}{SEPARATOR}{mac.hexdigest()[:TAG_CHARS]}"

    def _remember(self, key: tuple[str, str, str, str], tagged: str) -> None:
        """Remember a tag (the last ``MAX_HANDLES``)."""
        if len(self._proved) >= MAX_HANDLES:
            self._proved.clear()
        self._proved[key] = tagged

    def tag_owned(self, scope: str, data: bytes, owned: Sequence[Owned]) -> bytes:
        """``data`` with each id ``scope`` owns, as a JSON string, tagged."""
        if len(owned) > FEW_OWNED:
            return self._tag_strings(scope, data, owned)
        for rid, handle, kind in owned:
            quoted = f'"{rid}"'.encode()
            if quoted in data:  # never inside a string: its quotes would be escaped
                data = data.replace(quoted, f'"{self.tag(scope, rid, handle, kind)}"'.encode())
        return data

    def _tag_strings(self, scope: str, data: bytes, owned: Sequence[Owned]) -> bytes:
        """``tag_owned`` in one pass over ``data``: a list of a hundred items, each searched
        for in the whole body, would cost a hundred passes.  What stands between two quotes
        is an id to tag only where ``"<id>"`` stands whole, as above."""
        ids = {each.id.encode(): each for each in owned}
        pieces = data.split(b'"')
        for at, piece in enumerate(pieces):
            each = ids.get(piece)
            if each is not None and 0 < at < len(pieces) - 1:
                pieces[at] = self.tag(scope, each.id, each.handle, each.kind).encode()
        return b'"'.join(pieces)
