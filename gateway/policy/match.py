"""What a route matches (``routes[].match``): the path, the body's ``model``, the caller's
named tenant and request headers; and the shell-style globs they are written in."""

from __future__ import annotations

import fnmatch
import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.policy.metadata import doc

HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
"""An HTTP field name (RFC 9110's token)."""


@dataclass(frozen=True, slots=True)
class Match:
    """What a route matches: the path, the body's `model`, the tenant, request headers."""

    path: str = field(
        default="*",
        metadata=doc(
            "Shell-style glob on the path (`*` crosses `/`: `/v1/*` matches "
            "`/v1/chat/completions`)."
        ),
    )
    model: str | None = field(
        default=None,
        metadata=doc(
            "Glob on the body's `model` (the JSON endpoints the gateway reads: OpenAI's chat, "
            "completions, embeddings and Responses, Anthropic's messages)."
        ),
    )
    tenants: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Named tenants (`tenants.keys[].name`) the route is for: a request offering "
            "another's key, or none, goes on to the next route. None given: every caller."
        ),
    )
    headers: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=doc(
            "Request headers the route needs, each name (any case) to a glob on its value "
            "(`X-Variant: canary*`); a missing header does not match. What a client sends: "
            "to keep a route to some callers, name them in `tenants`.",
            mapping=True,
        ),
    )


def check_match(match: Match, tenants: set[str]) -> list[tuple[str, str]]:
    """A route's ``match``: globs that compile, tenants that are named, header names."""
    found: list[tuple[str, str]] = []
    globs = [("path", match.path), ("model", match.model)]
    globs += [(f"headers.{name}", value) for name, value in match.headers]
    for key, pattern in globs:
        if pattern is not None:
            try:
                glob_regex(pattern)
            except Exception as exc:  # re.error from a pathological glob
                found.append((f"match.{key}", f"invalid glob: {exc}"))
    for i, name in enumerate(match.tenants):
        if name not in tenants:
            found.append((f"match.tenants[{i}]", f"no tenant is named {name!r} in tenants.keys"))
    for name, _ in match.headers:
        if not HEADER_NAME.fullmatch(name):
            found.append((f"match.headers.{name}", "not a header name"))
    return found


def takes(match: Match, tenant: str, headers: Sequence[tuple[str, str]]) -> bool:
    """Whether ``match``'s tenants and headers take a caller (its path and model aside):
    ``tenant``, its named tenant ("" for none), and ``headers``, its request headers."""
    if match.tenants and tenant not in match.tenants:
        return False
    for name, pattern in match.headers:
        name = name.lower()
        value = next((v for k, v in headers if k.lower() == name), None)
        if value is None or glob_regex(pattern).match(value) is None:
            return False
    return True


@functools.lru_cache(maxsize=1024)  # a policy's patterns: compiled once, whatever reloads
def glob_regex(pattern: str) -> re.Pattern[str]:
    """A compiled shell-style glob where `*` also crosses `/` (as ``fnmatch``)."""
    return re.compile(fnmatch.translate(pattern))
