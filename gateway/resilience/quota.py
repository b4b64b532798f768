"""Where a caller stands in its rate limits, told as OpenAI tells it: the
``x-ratelimit-*`` headers.

OpenAI answers every call with its key's standing (``x-ratelimit-limit-requests``,
``-remaining-requests``, ``-reset-requests`` and the same for tokens), and clients read
them to pace themselves before a 429 does it for them (Spring AI's ``RateLimit`` metadata,
LiteLLM's router).  Behind the gateway a backend's own headers describe the gateway's key
upstream, shared by every tenant, so they say nothing true about the caller and something
about the others.  So when a gateway limit applies to a call, its answer (a 429 included)
carries the caller's standing in that limit instead, and any ``x-ratelimit-*`` header of
the backend's is dropped; without one, the backend's pass as they are.

A limit is a token bucket (``rate_limit.py``, or GCRA in Redis, the same bucket): its
``limit`` is the bucket's size (``burst`` requests, ``tokens_per_min`` tokens), its
``remaining`` what it holds after this call, and its ``reset`` the time until it is full
again, in OpenAI's format (``"250ms"``, ``"1s"``, ``"6m0s"``: whole units, which every
client's parser reads).  Under several limits (a route's and the tenant's own) each kind
tells the one with the least remaining.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

HEADER_PREFIX = "x-ratelimit-"
KINDS = ("requests", "tokens")


@dataclass(frozen=True, slots=True)
class Quota:
    """One bucket's standing: its size, what it holds (below zero in debt), and the
    seconds until it is full."""

    limit: float
    remaining: float
    reset_s: float

    @classmethod
    def of(cls, capacity: float, level: float, rate_per_s: float) -> Quota:
        """The standing of a bucket of ``capacity`` holding ``level``, refilled at
        ``rate_per_s``."""
        return cls(capacity, level, max(0.0, capacity - level) / rate_per_s)


@dataclass(frozen=True, slots=True)
class Standing:
    """A caller's quotas under one limit, or the tightest over several (None: no such
    bucket)."""

    requests: Quota | None = None
    tokens: Quota | None = None

    def headers(self) -> list[tuple[str, str]]:
        """The ``x-ratelimit-*`` headers of the quotas there are."""
        out: list[tuple[str, str]] = []
        for kind, quota in zip(KINDS, (self.requests, self.tokens), strict=True):
            if quota is None:
                continue
            out += [
                (f"{HEADER_PREFIX}limit-{kind}", str(math.floor(quota.limit))),
                (f"{HEADER_PREFIX}remaining-{kind}", str(max(0, math.floor(quota.remaining)))),
                (f"{HEADER_PREFIX}reset-{kind}", duration(quota.reset_s)),
            ]
        return out


def tightest(standings: Iterable[Standing]) -> Standing:
    """Per kind, the quota with the least remaining (then the longest reset)."""
    listed = list(standings)
    requests = [s.requests for s in listed if s.requests is not None]
    tokens = [s.tokens for s in listed if s.tokens is not None]
    return Standing(_least(requests), _least(tokens))


def _least(quotas: list[Quota]) -> Quota | None:
    return min(quotas, key=lambda q: (q.remaining, -q.reset_s)) if quotas else None


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI writes a reset: ``"0s"``, ``"250ms"`` under a second, else
    whole seconds rounded up, with minutes and hours as Go writes them (``"6m0s"``)."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def without_rate_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """``headers`` without any ``x-ratelimit-*`` header (a backend's, told in its place)."""
    return tuple((k, v) for k, v in headers if not k.lower().startswith(HEADER_PREFIX))
