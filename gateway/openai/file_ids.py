"""Files, batches, uploads, vector stores and containers bound to the tenant that made them
and the instance that keeps them (``tenants.response_id_secret``), as stored responses are
(``openai.response_ids``).

A server with OpenAI's Files API (OpenAI itself, LocalAI, a LiteLLM proxy; Anthropic's Files
API has the same path) serves ``/v1/files/<id>`` and its content to whoever names the id, and
resolves a ``file_id`` in a chat message, a response's input or a batch to any tenant's file;
a vector store is searched by whoever names it, and a code interpreter's container (its
files, what its code wrote) is read and run in by whoever names it.  With the secret set:

- the id of a file the server made for the request (``POST /v1/files``, or an upload
  completed), of a batch (``POST /v1/batches``), an upload (``POST /v1/uploads``), a
  vector store (``POST /v1/vector_stores``) and a container (``POST /v1/containers``, a
  response's code interpreter: ``openai.response_ids``, or an Anthropic message's code
  execution) reaches its maker tagged; so do a batch's files
  (its input, output and error files) in every answer about a batch the caller owns, and the
  files of a vector store it owns (its files list, a search's results);
- a path naming one (``/v1/files/<id>`` and its ``/content``, ``/v1/batches/<id>`` and its
  ``/cancel``, ``/v1/uploads/<id>/parts``, ``/complete``, ``/cancel``,
  ``/v1/vector_stores/<id>`` and all below it, a file there, a list's cursors,
  ``/v1/containers/<id>`` and all below it) must carry
  the caller's own; it is untagged and pinned to the instance that keeps it, else a 404
  before any backend;
- every ``file_id``, ``input_file_id``, ``file_ids``, ``vector_store_id``,
  ``vector_store_ids`` and ``container_id`` in a JSON body, however deep (a chat message's
  file part, a response's ``input_file`` or ``file_search`` tool, a batch's input, a code
  interpreter's files, an output item given back), a code interpreter's ``container`` and
  an Anthropic Messages body's own ``container`` (an id, or ``{"id": ...}``), must be the
  caller's own, and is untagged; else a 404 (a body is read whatever
  its type: a lenient server reads JSON under any; one in UTF-16 or 32 is a 400);
- the collections are not listed (``GET /v1/files``, ``/v1/batches``, ``/v1/vector_stores``,
  ``/v1/containers``).

A file's content passes as the server wrote it.  A vector store's file batches and a
container's files are named below their store or container, which is checked.  The ids of
the Assistants API's objects are not bound: they pass as they are (docs/security.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any
from urllib.parse import quote, unquote

from gateway.errors import RequestError
from gateway.metrics import Metrics
from gateway.openai.body import dumps_yielding, json_object, utf8
from gateway.openai.bound_answers import (
    Answer,
    answer_json,
    forward,
    pinned,
    refuser,
    untag_cursors,
    untag_or_refuse,
)
from gateway.openai.bound_ids import CONTAINER, FILE, Kind, Owned, ResponseIds
from gateway.openai.response_ids import YIELD_EVERY, not_listed, read_json
from gateway.openai.sse import whole_events
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy
from gateway.wire import MESSAGES_PATH


class BatchNotFound(RequestError):
    """A batch id in the path that is not this tenant's."""

    status = 404
    code = "batch_not_found"


class VectorStoreNotFound(RequestError):
    """A vector store id, in the path or a body, that is not this tenant's."""

    status = 404
    code = "vector_store_not_found"


class UploadNotFound(RequestError):
    """An upload id in the path that is not this tenant's."""

    status = 404
    code = "upload_not_found"


BATCH = Kind(
    "",
    "batch",
    "/v1/batches",
    re.compile(r"/v1/batches/([^/]*)(/.*)?"),
    "Batch",
    BatchNotFound,
    salt="batch",
)
UPLOAD = Kind(
    "",
    "upload",
    "/v1/uploads",
    re.compile(r"/v1/uploads/([^/]*)(/.*)?"),
    "Upload",
    UploadNotFound,
    salt="upload",
)
VECTOR_STORE = Kind(
    "",
    "vector_store",
    "/v1/vector_stores",
    re.compile(r"/v1/vector_stores/([^/]*)(/.*)?"),
    "Vector store",
    VectorStoreNotFound,
    salt="vector_store",
)
KINDS = (FILE, BATCH, UPLOAD, VECTOR_STORE, CONTAINER)
MADE = {kind.path: kind for kind in KINDS}
"""The paths where a POST makes one; a GET there would list every tenant's."""
FIELDS = {
    "file_id": FILE,
    "input_file_id": FILE,
    "vector_store_id": VECTOR_STORE,
    "container_id": CONTAINER,
}
"""Body fields naming one file, vector store or container, wherever they stand."""
TOOL_CONTAINER = ("container", "code_interpreter")
"""A code interpreter's ``container``: a container's id (or ``{"type": "auto"}``)."""
MESSAGES_CONTAINER = "container"
"""An Anthropic Messages body's own container, for its code execution tool: an id, or
``{"id": ..., "skills": [...]}``; the answer names the one used (``{"id", "expires_at"}``)."""
WRITTEN = "code_execution_output"
"""How the type of a file Anthropic's code execution wrote ends (``bash_...``): its
``file_id`` is in the Files API, the run's maker's."""
CODE_EXECUTION = "code_execution"
"""How the type of Anthropic's code execution tool begins (``code_execution_20250825``)."""
LISTS = {"file_ids": FILE, "vector_store_ids": VECTOR_STORE}
"""Body fields naming a list of them."""
OPAQUE = frozenset({"metadata", "parameters", "input_schema", "schema", "json_schema"})
"""Fields whose values name no object of the server's: the client's own metadata, and the
JSON schemas of tools and structured output (a tool may well take a ``file_id``)."""
NAMES = (b"file", b"vector_store", b"container", b"\\u")
"""What a body's bytes hold if it names one (or spells a key with ``\\u`` escapes)."""
STORE_FILE = re.compile(r"/files/([^/]*)(/content)?")
"""A file in a vector store's path."""
STORE_FILE_OBJECT = "vector_store.file"
"""A file in a vector store, named by the file's own id."""
BATCH_FILES = ("input_file_id", "output_file_id", "error_file_id")
"""A batch's files, its owner's too."""


class FileIdStage:
    """The stage: untags the files, batches and uploads a request names, tags those its
    answer carries."""

    def __init__(self, ids: ResponseIds, refused: Callable[[str, str], None]) -> None:
        self._ids = ids
        self._refused = refused

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        if call.method == "OPTIONS" or not call.path.startswith("/v1/"):
            return await call_next(call)
        makes = MADE.get(call.path)
        named: list[Owned] = []
        changes: dict[str, Any] = {}
        content = False  # a file's content (or a container's file's): passed as it is
        messages = False  # an Anthropic message running code: its container learned
        if makes is not None:
            if call.method != "POST":
                raise not_listed(makes)
            if makes is not FILE:  # a file comes as a form, a batch and an upload as JSON
                changes = await self._untag_body(call, named)
        elif (kind_found := _by_id(call.path)) is not None:
            kind, found = kind_found
            owned = self._untag(call, unquote(found.group(1)), kind, "path")
            named.append(owned)
            rest = found.group(2) or ""
            content = rest.endswith("/content") and kind in (FILE, CONTAINER)  # a file's
            query = call.query
            if kind is VECTOR_STORE:  # its files, by their ids
                rest, query = self._untag_store_files(call, rest, named)
            path = f"{kind.path}/{quote(owned.id, safe='')}{rest}"
            target = f"{path}?{query}" if query else path
            changes = {"path": path, "query": query, "raw_target": target}
            if call.body and not (kind is UPLOAD and rest == "/parts"):  # a part is a form
                more = await self._untag_body(dataclasses.replace(call, **changes), named)
                changes = {**changes, **more}
        elif call.body:  # whatever its type: a lenient server reads JSON under any
            changes = await self._untag_body(call, named)
            messages = call.path == MESSAGES_PATH and _runs_code(changes.get("json", call.json))
            if not named and not messages:  # nothing named or made: nothing to tag
                return await call_next(dataclasses.replace(call, **changes) if changes else call)
        else:
            return await call_next(call)
        if content:
            return await call_next(dataclasses.replace(call, **pinned(changes, named, self._ids)))
        scope = call.scope
        return await forward(
            call,
            changes,
            named,
            call_next,
            self._ids,
            lambda made_at: _Answer(
                self._ids, scope, named, makes=makes, made_at=made_at, messages=messages
            ),
        )

    async def _untag_body(self, call: Call, named: list[Owned]) -> dict[str, Any]:
        """What changes in the call for its body's files untagged (none when it names
        none); the files proved are added to ``named``."""
        strict = _is_json(call)
        if call.json is not None or call.header("content-encoding") is None:
            body = call.body
            if call.json is None and not strict and not json_object(body):
                return {}  # a form, audio, text: no JSON object a server could read
            if not any(name in body for name in NAMES) and utf8(body):
                return {}  # names none: nothing to read
        data, changes = await read_json(call, strict=strict)
        if data is None:
            return changes
        places = await _files_in(data, messages=call.path == MESSAGES_PATH)
        if not places:
            return changes
        for at, (holder, key, kind) in enumerate(places):  # in place: this call's reading
            if at and not at % YIELD_EVERY:  # a body may name a hundred thousand
                await asyncio.sleep(0)
            owned = self._untag(call, holder[key], kind, kind.object)
            holder[key] = owned.id
            named.append(owned)
        body = await dumps_yielding(data, len(call.body))
        if call.json is not None:
            changes["json"] = data
        return {**changes, "body": body}

    def _untag_store_files(self, call: Call, rest: str, named: list[Owned]) -> tuple[str, str]:
        """A vector store's path below its id, and the query, with the file it names (in
        the path, or a list's cursors) untagged."""
        found = STORE_FILE.fullmatch(rest)
        if found is not None:
            named.append(self._untag(call, unquote(found.group(1)), FILE, "path"))
            rest = f"/files/{quote(named[-1].id, safe='')}{found.group(2) or ''}"
        if not rest.endswith("/files"):  # a list of its files, or a batch's
            return rest, call.query
        untag = partial(self._untag, call, kind=FILE, where="path")
        return rest, untag_cursors(call.query, untag, named)

    def _untag(self, call: Call, tagged: str, kind: Kind, where: str) -> Owned:
        """The id of ``kind`` that ``tagged`` carries, if the caller's; else its refusal."""
        return untag_or_refuse(self._ids, self._refused, call, tagged, kind, where)

    def __repr__(self) -> str:
        return "<FileIdStage>"


def _by_id(path: str) -> tuple[Kind, re.Match[str]] | None:
    for kind in KINDS:
        found = kind.by_id.fullmatch(path)
        if found is not None:
            return kind, found
    return None


def _is_json(call: Call) -> bool:
    if call.json is not None:
        return True
    kind = call.header("content-type")
    return kind is None or "json" in kind.lower()  # FastAPI reads a body without one as JSON


def _runs_code(data: Any) -> bool:
    """Whether an Anthropic Messages body gives the model its code execution tool: the
    answer then names the container it ran in, made for it unless one was named."""
    tools = data.get("tools") if isinstance(data, dict) else None
    return isinstance(tools, list) and any(
        isinstance(t, dict) and str(t.get("type", "")).startswith(CODE_EXECUTION) for t in tools
    )


async def _files_in(data: Any, *, messages: bool = False) -> list[tuple[Any, Any, Kind]]:
    """Where ``data`` names files, vector stores or containers: (its holder, the key or
    index, the kind), every one however deep, and an Anthropic Messages body's own
    ``container`` (``messages``); the loop runs between every ``YIELD_EVERY`` values."""
    places: list[tuple[Any, Any, Kind]] = []
    own = data.get(MESSAGES_CONTAINER) if messages and isinstance(data, dict) else None
    if isinstance(own, str):  # a container's id
        places.append((data, MESSAGES_CONTAINER, CONTAINER))
    elif isinstance(own, dict) and isinstance(own.get("id"), str):  # its id and its skills
        places.append((own, "id", CONTAINER))
    stack = [data]
    seen = 0
    while stack:
        node = stack.pop()
        seen += 1
        if not seen % YIELD_EVERY:
            await asyncio.sleep(0)
        if isinstance(node, dict):
            for key, value in node.items():
                if key in FIELDS and isinstance(value, str):
                    places.append((node, key, FIELDS[key]))
                elif (key, node.get("type")) == TOOL_CONTAINER and isinstance(value, str):
                    places.append((node, key, CONTAINER))
                elif key in LISTS and isinstance(value, list):
                    places += [
                        (value, at, LISTS[key]) for at, v in enumerate(value) if isinstance(v, str)
                    ]
                elif isinstance(value, (dict, list)) and key not in OPAQUE:
                    stack.append(value)
        elif isinstance(node, list):
            stack += [each for each in node if isinstance(each, (dict, list))]
    return places


class _Answer(Answer):
    """One answer's ids to tag: those the request proved its own, the object it made (a
    file, a batch, an upload), the files of a batch or an upload the caller owns, and the
    container an Anthropic message's code ran in (``messages``)."""

    __slots__ = ("_messages",)

    def __init__(
        self,
        ids: ResponseIds,
        scope: str,
        owned: list[Owned],
        *,
        makes: Kind | None,
        made_at: str,
        messages: bool = False,
    ) -> None:
        super().__init__(ids, scope, owned, makes=makes, made_at=made_at)
        self._messages = messages

    def whole(self, body: bytes) -> bytes:
        data = answer_json(body)
        if isinstance(data, dict) and "error" not in data:
            self._learn(data)
            if self._messages:
                self._ran(data)
        return self._ids.tag_owned(self._scope, body, self._owned)

    async def events(self, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        async for events in whole_events(stream):
            if self._messages and (b'"container"' in events or b'"file_id"' in events):
                for line in events.splitlines():
                    event = answer_json(line[5:]) if line.startswith(b"data:") else None
                    for part in ("message", "delta", "content_block"):  # where they stand
                        held = event.get(part) if isinstance(event, dict) else None
                        if isinstance(held, dict):
                            self._ran(held)
            yield self._ids.tag_owned(self._scope, events, self._owned)

    def _ran(self, held: dict[str, Any]) -> None:
        """Learn, from a message (or a stream's part of one), the container its code ran in
        (``{"id", "expires_at"}``: the one the request named, or one made for it) and the
        files its code wrote (a code execution result's outputs)."""
        container = held.get(MESSAGES_CONTAINER)
        self._own(container.get("id") if isinstance(container, dict) else None, CONTAINER)
        blocks = held.get("content")
        for block in [held, *(blocks if isinstance(blocks, list) else ())]:
            for fid in _written(block):
                self._own(fid, FILE)

    def _learn(self, data: dict[str, Any]) -> None:
        """Learn the id of the object made, and the files of a batch, an upload or a vector
        store the caller owns."""
        kind = data.get("object", data.get("type"))
        made = self._makes
        rid = data.get("id")
        if made is not None and kind == made.object and isinstance(rid, str) and rid:
            self._owned.append(Owned(rid, self._made_at, made))
        owns = {each.id for each in self._owned if each.kind.object == kind}
        files: list[Any] = []
        if kind == BATCH.object and rid in owns:
            files += [data.get(key) for key in BATCH_FILES]
        upload_file = data.get("file") if kind == UPLOAD.object and rid in owns else None
        if isinstance(upload_file, dict):
            files.append(upload_file.get("id"))
        if any(each.kind is VECTOR_STORE for each in self._owned):  # its files, its owner's
            listed = data.get("data")
            for item in listed if isinstance(listed, list) else [data]:
                if isinstance(item, dict):
                    files.append(item.get("file_id"))
                    files += [item.get("id")] if item.get("object") == STORE_FILE_OBJECT else []
        for fid in files:
            if isinstance(fid, str) and fid:
                self._owned.append(Owned(fid, self._made_at, FILE))


def _written(block: Any) -> list[Any]:
    """The files a code execution result block says its code wrote (its outputs'
    ``file_id``, one or two levels down: ``code_execution_tool_result``,
    ``bash_code_execution_tool_result``)."""
    if not isinstance(block, dict) or not str(block.get("type", "")).endswith("_tool_result"):
        return []
    result = block.get("content")
    outputs = result.get("content") if isinstance(result, dict) else None
    if not isinstance(outputs, list):
        return []
    return [
        each.get("file_id")
        for each in outputs
        if isinstance(each, dict) and str(each.get("type", "")).endswith(WRITTEN)
    ]


def build(policy: Policy, metrics: Metrics) -> list[Stage]:
    """The stage, when the policy binds ids to tenants."""
    secret = policy.tenants.response_id_secret
    if not secret:
        return []
    return [FileIdStage(ResponseIds(secret), refuser(metrics))]
