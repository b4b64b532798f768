"""Header hygiene shared by both directions of the proxy: hop-by-hop stripping, the headers
the gateway owns, and reading a body's media type (one place, one case rule)."""

from __future__ import annotations

from collections.abc import Iterable

from gateway.openai.sse import SSE_TYPE, is_event_stream, media_type
from gateway.wire import connection_options

__all__ = ["SSE_TYPE", "is_event_stream", "media_type"]  # read in openai.sse, one rule

# RFC 9110 7.6.1 plus the de-facto ones proxies strip (nginx, Envoy).
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "http2-settings",
    }
)
# Who sent a request: set by the gateway (``forwarding.py``), never passed on as the client
# wrote them unless the peer is a trusted proxy.
FORWARDING = frozenset(
    {"forwarded", "x-forwarded-for", "x-forwarded-host", "x-forwarded-proto", "x-real-ip"}
)
# A method other than the request line's, which some frameworks take for the request's
# (Rack's and Laravel's by default, Express's and ASP.NET Core's middleware): the gateway
# decides on the method it read (a listing refused, a control endpoint written to), so that
# is the method the backend gets.
METHOD_OVERRIDES = frozenset({"x-http-method-override", "x-http-method", "x-method-override"})
# Headers the gateway sets itself on the upstream request, or that are its to decide.
REQUEST_OWNED = (
    frozenset({"host", "content-length", "expect", "x-request-id", "x-gateway-mirror"})
    | FORWARDING
    | METHOD_OVERRIDES
)
RESPONSE_OWNED = frozenset(
    {"content-length", "x-request-id", "x-gateway-backend", "date", "server"}
)


def strip(pairs: Iterable[tuple[str, str]], owned: frozenset[str]) -> list[tuple[str, str]]:
    """Drop hop-by-hop headers, those listed in Connection, and those in ``owned``."""
    pairs = list(pairs)
    drop = _DROPS.get(owned)
    if drop is None:
        drop = _DROPS[owned] = HOP_BY_HOP | owned
    for key, value in pairs:
        if key.lower() == "connection":
            drop = drop | connection_options(value)
    return [(k, v) for k, v in pairs if k.lower() not in drop]


_DROPS: dict[frozenset[str], frozenset[str]] = {}


STREAMING_TYPES = (
    SSE_TYPE,
    "application/x-ndjson",
    "application/ndjson",
    "application/jsonl",
    "application/json-seq",
    "application/stream+json",
)
"""Content types read piece by piece (SSE, Ollama's NDJSON...): relayed as they arrive."""


def is_streamed(headers: Iterable[tuple[str, str]]) -> bool:
    """True for a body sent as a stream of pieces (``STREAMING_TYPES``)."""
    return media_type(headers) in STREAMING_TYPES


def content_encoded(headers: Iterable[tuple[str, str]]) -> bool:
    """True when a body is compressed (``Content-Encoding`` other than ``identity``)."""
    for key, value in headers:
        if key.lower() == "content-encoding" and value.strip().lower() not in ("", "identity"):
            return True
    return False
