"""Paths of the APIs the gateway reads, spelled in another case, refused at the edge.

The gateway reads OpenAI's paths as OpenAI spells them: ``/v1/files/<id>`` is checked
against the caller's tenant, ``/v1/chat/completions`` is parsed, cached and limited by its
route.  Paths are case-sensitive (RFC 3986 6.2.2.1), and so are OpenAI's, vLLM's and
llama.cpp's servers; but Express, ASP.NET Core and Fiber route without regard to case, so
behind one of them ``/V1/Files/<id>`` reaches what ``/v1/files/<id>`` names, past every
check that path gets (another tenant's file, response or conversation; a route's cache and
limits).  So a path whose version and API segments (``/v1/<api>``, ``/v2/<api>``, and
chat's ``/v1/chat/completions``) spell a known one in another case is a 404
``unknown_url`` naming the spelling the gateway reads, before any route is chosen: the
answer OpenAI gives for a path it does not have.  A path outside these APIs passes as it
is, whatever its case.
"""

from __future__ import annotations

import re

from gateway.errors import RequestError, shown

APIS = {
    "v1": frozenset(
        {
            "assistants",
            "audio",
            "batches",
            "chat",
            "completions",
            "containers",
            "conversations",
            "embeddings",
            "evals",
            "files",
            "fine_tuning",
            "images",
            "messages",
            "models",
            "moderations",
            "realtime",
            "responses",
            "threads",
            "uploads",
            "vector_stores",
        }
    ),
    "v2": frozenset({"health", "models"}),  # KServe V2, Triton
}
"""The APIs under each version whose paths the gateway reads: OpenAI's, Anthropic's
``messages``, KServe V2's."""


class UnknownUrl(RequestError):
    """A known API's path spelled in another case."""

    status = 404
    code = "unknown_url"


def case_variant(path: str) -> str | None:
    """The spelling the gateway reads of ``path`` when ``path`` spells a known API's path in
    another case; None for every other path."""
    if path.islower():  # no capital anywhere: nothing to spell (most paths)
        return None
    end = path.find("/", 4)
    head = path if end < 0 else path[:end]  # the version and API, as /v1/files
    if head.islower() and head != "/v1/chat":  # capitals further on only: an id, a model
        return None
    found = _HEAD.match(path)
    if found is None:
        return None
    version, api = found.group(1).lower(), found.group(2).lower()
    if api not in APIS[version]:
        return None
    known = f"/{version}/{api}"
    if api == "chat" and found.group(3) is not None:
        known += "/completions"
    return None if path.startswith(known) else known + path[len(known) :]


def trimmed(path: str) -> str:
    """``path`` without the slash that ends it when it lies within a known API
    (``/v1/chat/completions/`` is ``/v1/chat/completions``); every other path as it is."""
    if len(path) < 5 or not path.endswith("/"):
        return path  # most paths: one comparison
    found = _HEAD.match(path)
    if found is None or found.group(2).lower() not in APIS[found.group(1).lower()]:
        return path
    return path[:-1]


_HEAD = re.compile(r"/(v[12])/([a-z_]+)(?:/(completions))?(?=/|$)", re.IGNORECASE)
"""A path's version and API segments, and chat's third."""


def refusal(method: str, path: str, known: str) -> UnknownUrl:
    return UnknownUrl(
        f"Invalid URL ({method} {shown(path)}): paths are case-sensitive, and this API's is "
        f"spelled {shown(known)}"
    )
