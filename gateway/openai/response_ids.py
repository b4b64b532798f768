"""The Responses API's ids bound to the tenant that created them
(``tenants.response_id_secret``).

A server that stores responses (vLLM with its store on) serves ``GET /v1/responses/<id>``,
``DELETE``, ``/cancel``, ``/input_items`` and a continuation (``previous_response_id``) to
whoever names the id: it knows no tenants.  With the secret set, the gateway shows each
client only ids bound to its own credentials: every ``resp_...`` id an answer of these paths
carries (``"id"``, ``"previous_response_id"``, ``"response_id"``, whole bodies and every
event of a stream) becomes ``<id>~<tag>``, the tag an HMAC-SHA256 over the tenant scope
(``Call.scope``, the same one the cache keys on) and the id, under the secret.  A request
naming an id, in its path or in ``previous_response_id``, has the tag checked and taken off
before it goes upstream; an id without a tag, or with another tenant's, is a 404 (in the
path) or a 400 (in the body), answered before any backend is asked.  No state is kept: every
replica that shares the secret (a Secret, through ``${ENV}``) accepts the others' ids, and a
restart keeps them valid.  Answers of these paths are asked for uncompressed, so they can be
read.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import re
from collections.abc import AsyncIterator, Callable
from urllib.parse import unquote

from gateway.errors import RequestError
from gateway.metrics import Metrics
from gateway.openai.allowed_models import uncompressed
from gateway.openai.body import dumps_yielding
from gateway.openai.sse import whole_events
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy

RESPONSES_PATH = "/v1/responses"
MIN_SECRET_CHARS = 16
TAG_CHARS = 24
SEPARATOR = "~"
_BY_ID = re.compile(r"/v1/responses/([^/]+)(/.*)?")
"""A stored response's path, when its name is an id (``resp_...``: not
``/v1/responses/input_tokens``, which passes as it came)."""
_ID_VALUE = re.compile(rb'"(resp_[A-Za-z0-9_-]{1,256})"')
"""A string that is a response id; an id already tagged does not match (``~`` ends it).
(It opens with its literal, so it is searched at C speed; a look-behind would not be.)"""
_KEY_BEFORE = re.compile(rb'(?<!\\)"(?:id|previous_response_id|response_id)"\s*:\s*\Z')
"""What precedes an id that is one of these keys' value at JSON level (inside a string its
quotes would be escaped)."""
_KEY_REACH = 64


class ResponseNotFound(RequestError):
    """A response id in the path that is not this tenant's: OpenAI's answer for an id it
    does not have."""

    status = 404
    code = "response_not_found"


class PreviousResponseNotFound(RequestError):
    """A ``previous_response_id`` that is not this tenant's."""

    code = "previous_response_not_found"


class ResponseIds:
    """Tags ids for a scope, and checks them; see the module docstring."""

    __slots__ = ("_keyed",)

    def __init__(self, secret: str) -> None:
        self._keyed = hmac.new(secret.encode(), digestmod=hashlib.sha256)

    def tag(self, scope: str, rid: str) -> str:
        mac = self._keyed.copy()
        mac.update(f"{scope}\0{rid}".encode())
        return f"{rid}{SEPARATOR}{mac.hexdigest()[:TAG_CHARS]}"

    def untag(self, scope: str, tagged: str) -> str | None:
        """The id ``tagged`` carries, if its tag is ``scope``'s; else None."""
        rid, separator, _ = tagged.rpartition(SEPARATOR)
        if not separator or not rid.startswith("resp_"):
            return None
        return rid if hmac.compare_digest(self.tag(scope, rid), tagged) else None

    def tag_all(self, scope: str, data: bytes) -> bytes:
        """``data`` with every response id the backend wrote tagged for ``scope``."""
        if b'"resp_' not in data:
            return data

        def tagged(found: re.Match[bytes]) -> bytes:
            start = found.start()
            if _KEY_BEFORE.search(data, max(0, start - _KEY_REACH), start) is None:
                return found.group(0)
            return b'"' + self.tag(scope, found.group(1).decode("ascii")).encode("ascii") + b'"'

        return _ID_VALUE.sub(tagged, data)


class ResponseIdStage:
    """The stage: untags what a request names, tags what its answer carries."""

    def __init__(self, ids: ResponseIds, refused: Callable[[str, str], None]) -> None:
        self._ids = ids
        self._refused = refused

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        if call.path == RESPONSES_PATH:
            call = await self._untag_body(call)
        elif (found := _BY_ID.fullmatch(call.path)) is not None and found.group(1).startswith(
            "resp_"
        ):
            call = self._untag_path(call, found)
        else:
            return await call_next(call)
        reply = await call_next(dataclasses.replace(call, headers=uncompressed(call.headers)))
        scope = call.scope
        if reply.body is not None:
            return reply.replace(body=self._ids.tag_all(scope, reply.body))
        assert reply.stream is not None
        tag = functools.partial(self._ids.tag_all, scope)
        return reply.replace(stream=_tagged(reply.stream, tag), content_length=None)

    async def _untag_body(self, call: Call) -> Call:
        named = call.json.get("previous_response_id") if call.json is not None else None
        if not isinstance(named, str):
            return call  # none, or not a string: the backend's to refuse
        rid = self._ids.untag(call.scope, named)
        if rid is None:
            self._refused(call.tenant, "previous_response_id")
            raise PreviousResponseNotFound(
                f"Previous response with id '{_shown(named)}' not found."
            )
        assert call.json is not None
        data = {**call.json, "previous_response_id": rid}
        return dataclasses.replace(call, json=data, body=await dumps_yielding(data, len(call.body)))

    def _untag_path(self, call: Call, found: re.Match[str]) -> Call:
        named = unquote(found.group(1))
        rid = self._ids.untag(call.scope, named)
        if rid is None:
            self._refused(call.tenant, "path")
            raise ResponseNotFound(f"Response with id '{_shown(named)}' not found.")
        path = f"{RESPONSES_PATH}/{rid}{found.group(2) or ''}"
        target = f"{path}?{call.query}" if call.query else path
        return dataclasses.replace(call, path=path, raw_target=target)

    def __repr__(self) -> str:
        return "<ResponseIdStage>"


async def _tagged(
    stream: AsyncIterator[bytes], tag: Callable[[bytes], bytes]
) -> AsyncIterator[bytes]:
    async for events in whole_events(stream):
        yield tag(events)


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
