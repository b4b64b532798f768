"""Header hygiene shared by both directions of the proxy: hop-by-hop stripping."""

from __future__ import annotations

from collections.abc import Iterable

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
# Headers the gateway sets itself on the upstream request.
REQUEST_OWNED = frozenset(
    {
        "host",
        "content-length",
        "expect",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-request-id",
    }
)
RESPONSE_OWNED = frozenset(
    {"content-length", "x-request-id", "x-gateway-backend", "date", "server"}
)


def strip(pairs: Iterable[tuple[str, str]], owned: frozenset[str]) -> list[tuple[str, str]]:
    """Drop hop-by-hop headers, those listed in Connection, and those in ``owned``."""
    pairs = list(pairs)
    drop = set(HOP_BY_HOP) | owned
    for key, value in pairs:
        if key.lower() == "connection":
            drop.update(token.strip().lower() for token in value.split(","))
    return [(k, v) for k, v in pairs if k.lower() not in drop]
