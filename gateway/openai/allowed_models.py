"""The models a named tenant may use (``tenants.keys[].models``), enforced at the edge.

A tenant held to some models may name only those, wherever the gateway can read the name:

- the ``model`` of an OpenAI JSON body (the edge parses those anyway): another model is a
  404 ``model_not_found`` with OpenAI's own words, none at all a 400 (the backend's
  default model is not this tenant's choice);
- the model in a KServe V2 / Triton path (``/v2/models/<m>/...``) or a TF Serving or OpenAI
  one (``/v1/models/<m>``, ``:predict``, ``/versions/<v>``), percent-decoded as the backend
  reads it;
- ``GET /v1/models``: served, and the backend's list is cut to the models the tenant may
  name (asked for without compression, so it can be read; one that cannot be read is a
  502, never the whole list);
- Ollama's own API (``OLLAMA_MODEL_PATHS``): the body's ``model`` (``/api/show``'s older
  ``name`` too), read as Ollama's Go server reads it: a key matches case-insensitively
  there, so a body naming its model under two spellings (``model`` and ``MODEL``) is a
  400, never read one way here and the other there; a name without a tag is its
  ``:latest``.  Its lists (``/api/tags``, ``/api/ps``) are cut as OpenAI's is.

Any other path names no model the gateway can read, so such a tenant is refused there (a
403): a key held to some models must not reach the others through a native API
(``/generate``, ``/completion``).  Checked before routing, so a refused request learns
nothing of the routes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import unquote

from gateway.errors import BadRequest, RequestError, UpstreamError, shown
from gateway.openai.body import native_object
from gateway.pipeline import Headers, Reply, first_header
from gateway.policy.match import glob_regex
from gateway.policy.route import MODEL_LIST_PATH
from gateway.policy.routing import OPENAI_JSON_PATHS

LISTING = MODEL_LIST_PATH
MODEL_IN_PATH = re.compile(r"/v2/models/([^/]+)(?:/.*)?|/v1/models/([^/]+)(?:/.*)?")
"""A KServe V2 path (``/v2/models/<m>...``), or a TF Serving / OpenAI one (``/v1/models/<m>``,
``<m>:predict``, ``<m>/versions/<v>:predict``, ``<m>/metadata``)."""
OWN_RESPONSE = re.compile(r"/v1/responses/resp_[^/]+(?:/cancel|/input_items)?")
"""A stored response's paths (the Responses API); not ``/v1/responses/input_tokens``, which
names a model in its body."""
OWN_CONVERSATION = re.compile(r"/v1/conversations(?:/conv_[^/]+(?:/items(?:/[^/]+)?)?)?")
"""The Conversations API's paths: making one, and one's own paths and items (no model)."""
OWN_OBJECTS = re.compile(r"/v1/(?:files|uploads|vector_stores|containers)(?:/.*)?")
"""Files, uploads, vector stores and code containers, and everything below them: bound to
their tenant like responses (``file_ids``), and none runs a model the client names.  Not
``/v1/batches``: a batch runs the models its input file names, which the gateway cannot
read."""
OLLAMA_MODEL_PATHS = frozenset({"/api/generate", "/api/chat", "/api/embed", "/api/embeddings"})
"""Ollama's own calls naming their model in the body (``/api/show`` too, ``OLLAMA_SHOW``)."""
OLLAMA_SHOW = "/api/show"
OLLAMA_LISTINGS = frozenset({"/api/tags", "/api/ps"})
"""Ollama's model lists (``models[].name``): cut to the tenant's models."""
MODEL_FREE_READS = frozenset({"/api/version"})
"""Reads that name and run no model (Ollama's clients ask its version first)."""
LATEST = ":latest"
TF_SERVING_VERB = re.compile(r":(predict|classify|regress)\Z")
"""What TF Serving's ``<m>:predict`` adds to a model's name (an OpenAI id may hold ``:``)."""
_STALE_AFTER_CUT = frozenset({"etag", "content-md5", "digest", "last-modified"})


class ModelNotAllowed(RequestError):
    """The tenant's key may not use the model the request names: OpenAI's answer for a
    model a key cannot see."""

    status = 404
    code = "model_not_found"


class ModelRequired(RequestError):
    """A tenant held to some models sent an OpenAI body without ``model``."""

    code = "model_required"


class PathNotAllowed(RequestError):
    """A tenant held to some models asked a path whose model the gateway cannot read."""

    status = 403
    code = "model_access_denied"


class UnreadableListing(UpstreamError):
    """A backend's model list is not the JSON list it should be: it cannot be cut or merged."""

    code = "unreadable_model_list"


class AllowedModels:
    """One tenant's model globs (shell-style, case-sensitive, ``*`` crossing ``/``).

    With ``own_responses`` (``tenants.response_id_secret`` set), the tenant may also read,
    cancel and delete its stored responses (``OWN_RESPONSE``): their ids are bound to its
    credentials (``response_ids``), and each was made under the model check; and it may
    keep conversations (``OWN_CONVERSATION``), files, uploads, vector stores and code
    containers (``OWN_OBJECTS``), bound to it alike, which run no model it names."""

    __slots__ = ("_matchers", "globs", "own_responses")

    def __init__(self, globs: Iterable[str], *, own_responses: bool = False) -> None:
        self.globs = tuple(globs)
        self._matchers = tuple(glob_regex(glob).match for glob in self.globs)
        self.own_responses = own_responses

    def allows(self, model: str) -> bool:
        return any(match(model) is not None for match in self._matchers)

    def allows_ollama(self, name: str) -> bool:
        """Whether ``name`` is one of the tenant's models as Ollama names them: a name
        without a tag is its ``:latest``."""
        if self.allows(name):
            return True
        if name.endswith(LATEST):
            return self.allows(name.removesuffix(LATEST))
        return ":" not in name.rpartition("/")[2] and self.allows(name + LATEST)

    def check(
        self,
        method: str,
        path: str,
        body: Mapping[str, Any] | None,
        native: Mapping[str, Any] | None = None,
    ) -> None:
        """Raise the refusal of a request this tenant may not make (``native``: the body of
        a server's own API that names its model there, ``native_body``)."""
        if native_names(method, path):
            named = ollama_model(path, native or {})
            if not self.allows_ollama(named):
                self._named(named)
            return
        if (path in OLLAMA_LISTINGS or path in MODEL_FREE_READS) and method in ("GET", "HEAD"):
            return
        if path in OPENAI_JSON_PATHS and body is not None:
            model = body.get("model")
            if not isinstance(model, str) or not model:
                raise ModelRequired(
                    "you must provide a model parameter: this key may use only some models"
                )
            self._named(model)
            return
        if path == LISTING:
            if method in ("GET", "HEAD"):
                return
            raise PathNotAllowed(f"this key may only read {LISTING} (GET)")
        if self.own_responses and (
            OWN_RESPONSE.fullmatch(path) is not None
            or OWN_CONVERSATION.fullmatch(path) is not None
            or OWN_OBJECTS.fullmatch(path) is not None
        ):
            return
        found = MODEL_IN_PATH.fullmatch(path)
        if found is None:
            raise PathNotAllowed(
                f"this key may use only some models, and a request to {path} names none "
                "the gateway can read"
            )
        v2, v1 = found.groups()
        model = unquote(v2) if v2 is not None else TF_SERVING_VERB.sub("", unquote(v1))
        self._named(model)

    def _named(self, model: str) -> None:
        if not self.allows(model):
            raise ModelNotAllowed(
                f"The model `{shown(model)}` does not exist or you do not have access to it."
            )

    def upstream_headers(self, method: str, path: str, headers: Headers) -> Headers:
        """A listing is asked for uncompressed, so that it can be cut."""
        if (path != LISTING and path not in OLLAMA_LISTINGS) or method != "GET":
            return headers
        return uncompressed(headers)

    def cut_listing(self, method: str, path: str, reply: Reply) -> Reply:
        """The backend's model list cut to this tenant's models (other answers as they are)."""
        if method != "GET" or reply.status != 200:
            return reply
        allows: Callable[[str], bool]
        if path == LISTING:
            field, key, allows = "data", "id", self.allows
        elif path in OLLAMA_LISTINGS:
            field, key, allows = "models", "name", self.allows_ollama
        else:
            return reply
        listing = read_listing(reply, field, key)
        if listing is None:
            raise _unreadable(reply)
        listing[field] = [entry for entry in listing[field] if allows(entry[key])]
        headers = tuple((k, v) for k, v in reply.headers if k.lower() not in _STALE_AFTER_CUT)
        return reply._replace(headers=headers, body=json.dumps(listing).encode())

    def __repr__(self) -> str:
        return f"<AllowedModels {list(self.globs)}>"


def native_names(method: str, path: str) -> bool:
    """Whether a call names its model in the body of a server's own API (Ollama's)."""
    return method == "POST" and (path in OLLAMA_MODEL_PATHS or path == OLLAMA_SHOW)


async def native_body(raw: bytes, encoding: str | None, limit: int) -> dict[str, Any]:
    """The JSON object of a call that names its model in a server's own API's body."""
    return await native_object(raw, encoding, limit, "this key may use only some models")


def ollama_model(path: str, data: Mapping[str, Any]) -> str:
    """The model an Ollama call names, as its server reads it."""
    names = ("model", "name") if path == OLLAMA_SHOW else ("model",)
    for name in names:
        # Go's encoding/json matches a key case-insensitively (one spelling: ``native_body``)
        key = next((k for k in data if k.lower() == name), None)
        value = data.get(key) if key is not None else None
        if value is not None and not isinstance(value, str):
            raise BadRequest(f"{key!r} must be a string")
        if value:
            return value
    raise ModelRequired("you must provide a model parameter: this key may use only some models")


def uncompressed(headers: Headers) -> Headers:
    """``headers`` asking for an answer without compression."""
    kept = tuple((k, v) for k, v in headers if k.lower() != "accept-encoding")
    return (*kept, ("Accept-Encoding", "identity"))


def read_listing(reply: Reply, field: str = "data", key: str = "id") -> dict[str, Any] | None:
    """A whole, uncompressed model list as OpenAI shapes it (Ollama's: ``models``, by
    ``name``), its ``field`` kept to the entries that have a ``key``; None when it is not
    one."""
    if reply.body is None or first_header(reply.headers, "content-encoding") not in (
        None,
        "identity",
    ):
        return None
    try:
        listing = json.loads(reply.body)
    except (ValueError, RecursionError):  # not JSON; nested past the parser's depth
        return None
    entries = listing.get(field) if isinstance(listing, dict) else None
    if not isinstance(entries, list):
        return None
    listing[field] = [
        entry for entry in entries if isinstance(entry, dict) and isinstance(entry.get(key), str)
    ]
    return listing


def _unreadable(reply: Reply) -> UnreadableListing:
    return UnreadableListing(
        "the backend's model list could not be read, so it could not be cut to this key's models",
        reply.backend,
    )
