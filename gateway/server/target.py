"""The request target, normalised once at the edge: the gateway routes on exactly the path it
forwards, so no spelling of a path reaches a backend route that routing did not allow.

Of the four forms of RFC 9112 3.2, origin-form (``/path?query``) is served; absolute-form
(``http://host/path``) becomes origin-form, its host ignored (the Host a backend sees comes
from the backend's URL, never from the client); asterisk-form (``OPTIONS *``) and
authority-form (``CONNECT host:port``) are refused.

The path is normalised in five steps:

1. each percent-encoding must be ``%`` and two hex digits; an encoded unreserved character
   (RFC 3986 2.3: letters, digits, ``-._~``) is decoded (RFC 3986 6.2.2.2: the same
   resource), every other one stays encoded, its hex upper-cased;
2. what a backend could decode into a separator or a parent step is refused with 400: an
   encoded ``/`` or ``\\`` (``%2F``, ``%5C``), a raw ``\\``, a segment that is a dot segment
   once decoded (``%2e``, ``.%2E`` ...), a fragment;
3. runs of ``/`` collapse into one (nginx's ``merge_slashes``);
4. dot segments are removed (RFC 3986 5.2.4): ``/v1/../internal`` is ``/internal``, and
   ``..`` never climbs above the root;
5. within a known API's path (``path_case.APIS``: OpenAI's, Anthropic's, KServe V2's), a
   slash that ends it is removed: ``/v1/chat/completions/`` is ``/v1/chat/completions``.
   No such path means something else with the slash; Express and Fiber (LocalAI) serve
   both spellings alike, so the slashed one would pass another route than the chat
   route's (its cache and limits) and ``/v1/models/`` would list the models a tenant held
   to some may not see, while Starlette and Gin (vLLM, MLServer, Ollama) answer it with a
   redirect and llama.cpp with a 404.

The query is forwarded as sent (llhttp has already refused control characters, spaces and
non-ASCII bytes in the target).
"""

from __future__ import annotations

import re

from gateway.errors import MalformedRequest
from gateway.server.path_case import trimmed

_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})|%[0-9A-Fa-f]{2}")
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_ENCODED_DOT_SEGMENTS = frozenset({"%2e", ".%2e", "%2e.", "%2e%2e"})
_SCHEMES = ("http://", "https://")


def normalise(target: str) -> tuple[str, str]:
    """``(path, query)`` of a request target, normalised; ``MalformedRequest`` (400) if it
    cannot be served."""
    if not target.startswith("/"):
        target = _origin_form(target)
    path, _, query = target.partition("?")
    if "#" in target:
        raise MalformedRequest("a request target must not carry a fragment (#)")
    if "%" not in path and "\\" not in path and "//" not in path and "/." not in path:
        return trimmed(path), query  # already normal: the common case costs four scans
    if "\\" in path:
        raise MalformedRequest("a backslash in the request path is refused")
    if "%" in path:
        path = _percent(path)
    if "//" in path:
        path = re.sub("/{2,}", "/", path)
    if "/." in path:
        path = remove_dot_segments(path)
    return trimmed(path), query


def _origin_form(target: str) -> str:
    if target == "*":
        raise MalformedRequest("asterisk-form (`OPTIONS *`) is not served; ask for a path")
    lower = target[:8].lower()
    for scheme in _SCHEMES:
        if lower.startswith(scheme):
            rest = target[len(scheme) :]
            cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=-1)
            if cut < 0:
                return "/"
            tail = rest[cut:]
            return tail if tail.startswith("/") else "/" + tail
    raise MalformedRequest("the request target must be a path (`/...`) or an http(s) URL")


def _percent(path: str) -> str:
    for segment in path.split("/"):
        if segment.lower() in _ENCODED_DOT_SEGMENTS:
            raise MalformedRequest("an encoded dot segment in the request path is refused")

    def one(match: re.Match[str]) -> str:
        text = match.group(0)
        if len(text) == 1:
            raise MalformedRequest("a `%` in the request path is not followed by two hex digits")
        char = chr(int(text[1:], 16))
        if char in _UNRESERVED:
            return char
        if char in "/\\":
            raise MalformedRequest(
                "an encoded `/` or `\\` (%2F, %5C) in the request path is refused"
            )
        return text.upper()

    return _PERCENT.sub(one, path)


def remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4 on an absolute path: ``.`` and ``..`` segments resolved."""
    out: list[str] = []
    segments = path.split("/")
    for i, segment in enumerate(segments[1:], 1):
        last = i == len(segments) - 1
        if segment == ".":
            if last:
                out.append("")
        elif segment == "..":
            if out:
                out.pop()
            if last:
                out.append("")
        else:
            out.append(segment)
    return "/" + "/".join(out)
