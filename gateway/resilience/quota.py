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
``limit`` is the bucket's size (``burst`` requests, ``tokens_per_min`` tokens, a day's),
its ``remaining`` what it holds after this call, and its ``reset`` the time until it is
full again, in OpenAI's format (``"250ms"``, ``"1s"``, ``"6m0s"``: whole units, which every
client's parser reads).  Under several limits (a route's and the tenant's own, a day's
bucket beside a minute's) each kind tells the one with the least remaining.  On Anthropic's
Messages API the same figures are told as Anthropic tells them:
``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}``, the reset an RFC 3339
time, and with them ``input-tokens`` and ``output-tokens`` under ``input_tokens_per_min``
and ``output_tokens_per_min`` (which OpenAI's headers have no names for).  A spend budget
(``cost_per_day``, ``cost_per_month``) is told as ``x-ratelimit-{limit,remaining,reset}-cost``
(``anthropic-ratelimit-cost-*``), its amounts in the ``price`` currency to six decimals.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.errors import RateLimited

HEADER_PREFIX = "x-ratelimit-"
ANTHROPIC_PREFIX = "anthropic-ratelimit-"
UNITS = ("requests", "tokens", "input_tokens", "output_tokens", "cost")
"""What a bucket counts (a ``Standing``'s fields); Anthropic's headers name each, OpenAI's
none of the prompt's and the answer's tokens apart (the gateway's own ``cost`` in both)."""
OPENAI_UNITS = ("requests", "tokens", "cost")


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
    input_tokens: Quota | None = None
    output_tokens: Quota | None = None
    cost: Quota | None = None

    def headers(self, *, anthropic: bool = False, wall: float = 0.0) -> list[tuple[str, str]]:
        """The rate headers of the quotas there are: OpenAI's, or Anthropic's (their resets
        a time, from ``wall``, the epoch seconds now)."""
        out: list[tuple[str, str]] = []
        for unit in UNITS if anthropic else OPENAI_UNITS:
            quota: Quota | None = getattr(self, unit)
            if quota is None:
                continue
            kind = unit.replace("_", "-")
            if unit == "cost":  # an amount of money, not a count
                limit, left = money(quota.limit), money(max(0.0, quota.remaining))
            else:
                limit, left = str(math.floor(quota.limit)), str(max(0, math.floor(quota.remaining)))
            if anthropic:
                name = f"{ANTHROPIC_PREFIX}{kind}-"
                reset = datetime.fromtimestamp(math.ceil(wall + quota.reset_s), UTC)
                out += [
                    (name + "limit", limit),
                    (name + "remaining", left),
                    (name + "reset", reset.strftime("%Y-%m-%dT%H:%M:%SZ")),
                ]
            else:
                out += [
                    (f"{HEADER_PREFIX}limit-{kind}", limit),
                    (f"{HEADER_PREFIX}remaining-{kind}", left),
                    (f"{HEADER_PREFIX}reset-{kind}", duration(quota.reset_s)),
                ]
        return out


class OverRate(RateLimited):
    """A limit refused the call: the caller's standing in it rides along, told in the
    429's headers (OpenAI's until the stage knows the call's API)."""

    def __init__(self, message: str, retry_after_s: float, standing: Standing) -> None:
        super().__init__(message, retry_after_s)
        self.standing = standing
        self.extra_headers = tuple(standing.headers())


class OverBudget(OverRate):
    """A spend budget refused the call (``cost_per_day``, ``cost_per_month``): OpenAI's
    ``insufficient_quota`` (its type and code), a 429 too."""

    type = "insufficient_quota"
    code = "insufficient_quota"


def money(amount: float) -> str:
    """An amount to six decimals, trailing zeros dropped (``"5"``, ``"4.372311"``)."""
    text = f"{amount:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("", "-0") else text


def tightest(standings: Iterable[Standing]) -> Standing:
    """Per kind, the quota with the least remaining (then the longest reset)."""
    listed = list(standings)
    least = {u: _least([q for s in listed if (q := getattr(s, u)) is not None]) for u in UNITS}
    return Standing(**least)


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
    """``headers`` without any rate header, OpenAI's or Anthropic's (a backend's, told in
    its place)."""
    prefixes = (HEADER_PREFIX, ANTHROPIC_PREFIX)
    return tuple((k, v) for k, v in headers if not k.lower().startswith(prefixes))
