"""Which requests may be cached, and the keys they are cached under.

A key is a sha256 over the tenant scope, route, backend, the backend's ``model_version``,
the endpoint path, the query string (its parameters in name order), the request's values of
the headers the backend's answers vary on (``control.vary_key``) and the canonical JSON of
every body field that can change the answer.
Canonical means sorted keys, no whitespace, integral floats written as integers
(``temperature: 0.0`` is ``0``).  Left out, because they never change the answer:

* ``stream``, ``stream_options``: how the answer is delivered (a hit replays either way);
* ``user``, ``metadata``, ``safety_identifier``: who asks, for the provider's logs;
* ``store``, ``service_tier``, ``priority``, ``request_id``: storage, billing, scheduling;
* ``prompt_cache_key``, ``prompt_cache_retention``: hints for the provider's prefix cache.

Unknown fields stay in the key: an unknown field is assumed to change the answer.

The *context key* is the same hash with the final user message's text blanked, plus the
guard's signature of that text (its numbers, quoted spans, code blocks and negation count;
``guard.signature``): two chat requests with equal context keys differ at most in that
text, in ways the guard may accept, which is what the near-duplicate tier compares.  The
signature costs no recall (the guard rejects any pair whose signatures differ) and keeps
templated prompts that differ only in an id or a number out of each other's SimHash
buckets, where they would otherwise pile up by the thousand.  The tenant scope is a hash
of the configured scope headers' values; raw header values are never stored.

Near-duplicate matching applies to a final user message of at most ``MAX_NEAR_CHARS``
characters.  A longer one is a document, not a question: its normalisation, SimHash and
embedding would cost the event loop and the model's thread time in proportion to it (a
client's 4 MB message, 3 s of the loop), the models read only its beginning, and two such
prompts alike there may differ after it.  It gets the exact tier only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gateway.cache.guard import signature
from gateway.cache.own_apis import OLLAMA_CHAT, OWN_API_PATH, OWN_GREEDY, REQUEST_ID
from gateway.wire import MESSAGES_PATH, RESPONSES_PATH

IGNORED_FIELDS = frozenset(
    {
        "stream",
        "stream_options",
        "user",
        "metadata",
        "safety_identifier",
        "store",
        "service_tier",
        "priority",
        "request_id",
        "prompt_cache_key",
        "prompt_cache_retention",
    }
)
CHAT_PATH_SUFFIX = "/chat/completions"
MAX_NEAR_CHARS = 8192
"""The longest final user message the near-duplicate tiers compare (characters)."""
# Anthropic's Messages API (MESSAGES_PATH) is cached as chat is (its ``system`` in the
# context, as chat's system message is), each shape (stream or whole) under keys of its own,
# since its events are replayed as they came (``replies.verbatim``).
API_HEADERS = ("anthropic-version", "anthropic-beta")
"""Request headers that change an Anthropic answer: in its key (``api_headers``)."""
CACHED_PATHS = ("/chat/completions", "/completions", "/embeddings", MESSAGES_PATH, RESPONSES_PATH)
"""The endpoints (path ends) whose answers may be cached and shared by single flight (the
Responses API's only when the server stores nothing: ``store: false``)."""
AS_SENT_PATHS = (MESSAGES_PATH, RESPONSES_PATH)
"""The endpoints whose answers are stored, replayed and shared as they came, a whole answer
and a stream apart: their streams are no chat's."""
ECHOED_FIELDS = frozenset({"user", "metadata", "safety_identifier", "service_tier"})
"""Fields the Responses API repeats in its answer: they key it, lest a hit repeat another
request's."""
_RESPONSES_IGNORED = IGNORED_FIELDS - ECHOED_FIELDS
_KEY_VERSION = "gwc1"
_BLANK = "\x00final-user-message\x00"
# One encoder for every key: ``json.dumps`` with options builds a new one per call, which
# costs as much as encoding a small body.
_CANONICAL_JSON = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)
_BLANK_JSON = _CANONICAL_JSON.encode(_BLANK)


@dataclass(frozen=True, slots=True)
class Cacheability:
    """Whether a request may be served from and stored to the cache, and why not."""

    ok: bool
    reason: str = ""


@dataclass(frozen=True, slots=True)
class RequestKey:
    """Everything a store lookup needs about one cacheable request.

    ``context`` and ``prompt`` are set only when the near-duplicate tier applies: a chat
    (or Anthropic Messages) request whose last message is a user message with plain text
    content.  ``blanked``, set
    whenever it could apply, is the canonical JSON the context key hashes, kept so that
    ``with_context`` need not serialise the body again.
    """

    scope: str
    exact: str
    context: str | None = None
    prompt: str | None = None
    blanked: str | None = field(default=None, repr=False, compare=False)


def cacheability(
    body: Mapping[str, Any], path: str, *, allow_sampled: bool = False
) -> Cacheability:
    """Whether the answer to ``body`` is deterministic enough to reuse.

    Chat and text completions need an explicit ``temperature`` of 0 (a missing one means the
    API default of 1) unless ``allow_sampled``; ``n`` and ``best_of`` must be absent or 1.
    A message referring to a remote image (``http(s)://`` URL) is not cacheable: the image
    behind the URL may change.  Embeddings requests are always deterministic.  Anthropic's
    Messages API is judged as chat (its ``temperature`` defaults to 1 too), and so is the
    Responses API's when the server stores nothing (``_stateful_response``): a stored
    response is the server's under its id, and a continuation reads stored state.  A chat
    completion the server is asked to store (``store: true``, OpenAI's stored completions)
    is not reused either: a hit would leave it unstored.  The servers' own deterministic
    calls (``OWN_API_PATH``, ``OWN_GREEDY``) are: they come here as ``own_apis.keyed``
    keys them, only when their answer is their body's.  Other endpoints' answers are not cached
    (``CACHED_PATHS``).
    """
    if not isinstance(body, Mapping):
        return Cacheability(False, "body is not a JSON object")
    if path in OWN_GREEDY or OWN_API_PATH.fullmatch(path):  # keyed only when they are
        return Cacheability(True)
    if not path.endswith(CACHED_PATHS):
        return Cacheability(False, "answers of this endpoint are not cached")
    if path.endswith("/embeddings"):
        return Cacheability(True)
    if path.endswith(RESPONSES_PATH) and (refused := _stateful_response(body)) is not None:
        return Cacheability(False, refused)
    if body.get("store") is True and path.endswith("/chat/completions"):  # OpenAI's store
        return Cacheability(False, "the server stores the completion (store is true)")
    if not allow_sampled:
        temperature = body.get("temperature")
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            return Cacheability(False, "temperature is not set to 0")
        if temperature != 0:
            return Cacheability(False, "temperature is not 0")
    for name in ("n", "best_of"):
        value = body.get(name, 1)
        if value is not None and value != 1:
            return Cacheability(False, f"{name} is not 1")
    if _has_remote_media(body.get("messages")):
        return Cacheability(False, "a message refers to a remote URL")
    return Cacheability(True)


def request_key(
    body: Mapping[str, Any],
    *,
    scope: str,
    route: str,
    backend: str,
    model_version: str,
    path: str,
    query: str = "",
    vary: str = "",
    near: bool = True,
) -> RequestKey:
    """The exact key of ``body``, and its context key and prompt when near-dup applies
    (and ``near`` asks for them; ``with_context`` adds them later, for a caller that tries
    the exact tier first and pays for the rest only on a miss)."""
    ignored = _ignored(path)
    canon = _canon({k: v for k, v in body.items() if k not in ignored})
    prefix = _prefix(scope, route, backend, model_version, path, query, vary) + _shape(body, path)
    prompt = _near_prompt(body, path)
    if prompt is None:
        return RequestKey(scope, _digest("exact", *prefix, _dumps_canon(canon)))
    # Both keys from one serialisation: the context's form, and the body's from it.
    blanked = _dumps_blanked(canon)
    exact = _digest("exact", *prefix, _unblank(blanked, canon))
    if not near:
        return RequestKey(scope, exact, blanked=blanked)
    return RequestKey(scope, exact, _context(prefix, blanked, prompt), prompt, blanked)


def with_context(
    key: RequestKey,
    body: Mapping[str, Any],
    *,
    route: str,
    backend: str,
    model_version: str,
    path: str,
    query: str = "",
    vary: str = "",
) -> RequestKey:
    """``key`` (from ``request_key(..., near=False)`` for the same arguments) with its
    context key and prompt added when near-dup applies."""
    prompt = _near_prompt(body, path)
    if prompt is None:
        return key
    blanked = key.blanked
    if blanked is None:  # a key built by hand
        blanked = _dumps_blanked(_canon({k: v for k, v in body.items() if k not in IGNORED_FIELDS}))
    prefix = _prefix(key.scope, route, backend, model_version, path, query, vary)
    context = _context(prefix + _shape(body, path), blanked, prompt)
    return RequestKey(key.scope, key.exact, context, prompt, blanked)


def api_headers(path: str, headers: Iterable[tuple[str, str]]) -> str:
    """What the key of a request to ``path`` takes from its headers beside the backend's
    ``Vary``: Anthropic's API version and beta features, which change its answers."""
    if not path.endswith(MESSAGES_PATH):
        return ""
    wanted = [(k.lower(), v) for k, v in headers if k.lower() in API_HEADERS]
    return "".join(f"\n{k}={v}" for k, v in sorted(wanted))


def _prefix(
    scope: str, route: str, backend: str, model_version: str, path: str, query: str, vary: str
) -> tuple[str, ...]:
    """What every key of a request is made under; the query and the varied headers only
    when there are any, so that keys without them are those made before they counted."""
    prefix: tuple[str, ...] = (scope, route, backend, model_version, path)
    if query:
        prefix += ("?" + normalise_query(query),)
    if vary:
        prefix += ("vary:" + vary,)
    return prefix


_OWN_IGNORED = frozenset({REQUEST_ID})
"""A server's own call's key holds its body's digest, and not the id kept beside it."""


def _ignored(path: str) -> frozenset[str]:
    """The body fields left out of ``path``'s keys: none of a server's own API's."""
    if path.endswith(RESPONSES_PATH):
        return _RESPONSES_IGNORED
    return IGNORED_FIELDS if path.endswith(CACHED_PATHS) else _OWN_IGNORED


def _shape(body: Mapping[str, Any], path: str) -> tuple[str, ...]:
    """What a key adds for the shape asked: Anthropic's and the Responses API's streams are
    stored as sent, so a stream and a whole answer never share an entry (exact or near)."""
    if path.endswith(AS_SENT_PATHS):
        return ("stream" if body.get("stream") is True else "whole",)
    return ()


def normalise_query(query: str) -> str:
    """A query string with its parameters in name order (the values of one name keep
    their order: it may matter)."""
    if "&" not in query:
        return query
    return "&".join(sorted(query.split("&"), key=lambda part: part.partition("=")[0]))


def _near_prompt(body: Mapping[str, Any], path: str) -> str | None:
    if not path.endswith((CHAT_PATH_SUFFIX, MESSAGES_PATH)) and path != OLLAMA_CHAT:
        return None
    text = final_user_text(body)
    return text if text is not None and len(text) <= MAX_NEAR_CHARS else None


def _context(prefix: tuple[str, ...], blanked: str, prompt: str) -> str:
    return _digest("context", *prefix, blanked, signature(prompt))


def _dumps_blanked(canon: dict[str, Any]) -> str:
    """The canonical JSON of a near-dup request with its final message's content blanked:
    what its context key hashes."""
    messages = list(canon["messages"])
    messages[-1] = dict(messages[-1], content=_BLANK)
    return _dumps_canon({**canon, "messages": messages})


def _unblank(blanked: str, canon: dict[str, Any]) -> str:
    """``_dumps_canon(canon)``, from ``blanked`` (``_dumps_blanked(canon)``) without
    serialising the whole body a second time.

    JSON is written value by value, so a value's text inside the whole is its own
    ``_dumps_canon``: putting the final content's JSON back in place of the blank's gives
    the body's.  Only where the blank's text occurs once is it known to be that place; a
    body that holds the blank's text itself (never a real one) is serialised again.
    """
    if blanked.count(_BLANK_JSON) != 1:
        return _dumps_canon(canon)
    return blanked.replace(_BLANK_JSON, _dumps_canon(canon["messages"][-1]["content"]))


def item_key(
    params: str,
    item: Any,
    *,
    scope: str,
    route: str,
    backend: str,
    model_version: str,
    path: str,
    query: str = "",
    vary: str = "",
) -> str:
    """The key of one input of a batched request (``/v1/embeddings``): ``params`` is the
    canonical JSON of the body without its ``input``."""
    prefix = _prefix(scope, route, backend, model_version, path, query, vary)
    return _digest("item", *prefix, params, _dumps(item))


def canonical_json(body: Mapping[str, Any], *, drop: Iterable[str] = ()) -> str:
    """The body's answer-changing fields as canonical JSON."""
    ignored = IGNORED_FIELDS.union(drop)
    return _dumps({k: v for k, v in body.items() if k not in ignored})


def final_user_text(body: Mapping[str, Any]) -> str | None:
    """The text of the last message when it is a user message with text content only."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if not isinstance(last, dict) or last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if (
        isinstance(content, list)
        and len(content) == 1
        and isinstance(content[0], dict)
        and content[0].get("type") == "text"
        and isinstance(content[0].get("text"), str)
    ):
        return str(content[0]["text"])
    return None


def _digest(kind: str, *parts: str) -> str:
    h = hashlib.sha256(_KEY_VERSION.encode())
    for part in (kind, *parts):
        data = part.encode()
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()[:40]


def _dumps(value: Any) -> str:
    return _dumps_canon(_canon(value))


def _dumps_canon(value: Any) -> str:
    return _CANONICAL_JSON.encode(value)


def _canon(value: Any) -> Any:
    """``value`` with every integral float an int (``1.0`` keys as ``1``).  The leaves most
    calls see (strings, ints) return on their exact type first: a long conversation is
    hundreds of calls."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return value
    if isinstance(value, dict):
        return {k: _canon(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canon(v) for v in value]
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    return value


def _stateful_response(body: Mapping[str, Any]) -> str | None:
    """Why a Responses API request's answer may not be reused, if it may not: the server
    stores it, it reads stored state (a response, a conversation, a prompt template whose
    latest version may change), it runs in the background, a hosted tool's results
    change (web search, files, code), or it reads a remote file."""
    if body.get("store") is not False:
        return "the server stores the response (store is not false)"
    for name in ("previous_response_id", "conversation", "prompt"):  # prompt: a stored template
        if body.get(name) is not None:
            return f"{name} reads what the server stored"
    if body.get("background"):
        return "a background response"
    tools = body.get("tools")
    if isinstance(tools, list) and any(
        not isinstance(tool, dict) or tool.get("type") not in ("function", "custom")
        for tool in tools
    ):
        return "a hosted tool's results change"
    given = body.get("input")
    if _has_remote_media(given):
        return "an input refers to a remote URL"
    return None


def _has_remote_media(messages: Any) -> bool:
    """A content part naming something remote by URL: chat's ``{"image_url": {"url"}}``,
    or the Responses API's ``image_url`` and ``file_url`` strings."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if not isinstance(part, dict):
                continue
            for key, value in part.items():
                url = value.get("url") if isinstance(value, dict) else None
                if url is None and key.endswith("_url"):
                    url = value
                if isinstance(url, str) and url.startswith(("http://", "https://")):
                    return True
    return False
