"""A per-tenant rate limit (a route's ``rate_limit``, a named tenant's own): its buckets of
requests, model tokens and their cost, each per second, minute, day or month."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.policy.metadata import doc

DEFAULT_RATE_LIMIT_REPLICAS = 1

RATES = (
    "requests_per_s",
    "tokens_per_min",
    "requests_per_day",
    "tokens_per_day",
    "input_tokens_per_min",
    "output_tokens_per_min",
    "cost_per_day",
    "cost_per_month",
)
"""A ``RateLimit``'s rates, each a bucket of its own."""
MONTH_DAYS = 30
"""A ``cost_per_month``'s month."""


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A per-tenant rate limit (429 past it)."""

    requests_per_s: float | None = field(default=None, metadata=doc("Requests per second."))
    tokens_per_min: float | None = field(default=None, metadata=doc("Tokens per minute."))
    burst: float | None = field(
        default=None, metadata=doc("The requests bucket's size (default: 1 s of rate).")
    )
    requests_per_day: float | None = field(
        default=None,
        metadata=doc(
            "Requests per day (OpenAI's RPD): a bucket holding a day's requests, refilled "
            "continuously (one back every 86400 / N s), beside `requests_per_s`."
        ),
    )
    tokens_per_day: float | None = field(
        default=None,
        metadata=doc(
            "Model tokens per day (OpenAI's TPD): a bucket holding a day's tokens, refilled "
            "continuously, settled on each answer's `usage` as `tokens_per_min` is. With "
            "`store: memory` a restart refills it: use `store: redis` for a day that must "
            "hold across restarts."
        ),
    )
    input_tokens_per_min: float | None = field(
        default=None,
        metadata=doc(
            "Prompt tokens per minute (Anthropic's ITPM), beside `tokens_per_min`: estimated "
            "from the body's size, settled on the answer's `usage`."
        ),
    )
    output_tokens_per_min: float | None = field(
        default=None,
        metadata=doc(
            "Generated tokens per minute (Anthropic's OTPM): what a GPU spends most of its "
            "time on, decoding. A call pays its `max_tokens` (or `max_completion_tokens`, "
            "`max_output_tokens`) up front, one without one, and the answer's "
            "`completion_tokens` settle it: a tenant past the minute's output waits."
        ),
    )
    cost_per_day: float | None = field(
        default=None,
        metadata=doc(
            "Spend per day, in the currency of the backends' `price` (LiteLLM's budget, "
            "OpenAI's quota): a bucket holding a day's spend, refilled continuously. A call "
            "pays its estimate at its backend's price up front (its prompt's size and its "
            "`max_tokens`), and the answer's `usage`, at the price of the backend that "
            "answered, settles it. Past it: 429 `insufficient_quota`. Only answers a backend "
            "computed are charged, never a cached or shared one. Use `store: redis` for a "
            "budget that must hold across restarts and replicas."
        ),
    )
    cost_per_month: float | None = field(
        default=None,
        metadata=doc(
            "Spend per 30 days, as `cost_per_day`: a bucket holding a month's budget, "
            "refilled continuously (a thirtieth of it a day)."
        ),
    )
    store: Literal["memory", "redis"] = field(
        default="memory",
        metadata=doc(
            "`memory`: each process counts on its own. `redis`: every process and replica "
            "shares one count per tenant in the gateway's Redis, `redis:` (GCRA, one script "
            "call a request); while Redis is down, each process enforces its local share."
        ),
    )
    replicas: int = field(
        default=DEFAULT_RATE_LIMIT_REPLICAS,
        metadata=doc(
            "`redis`: the gateway processes expected to share the limit; while Redis is "
            "down each enforces the limit (and burst) divided by this."
        ),
    )


def warn_cost(limit: RateLimit | None, priced: bool, defaulted: bool) -> list[tuple[str, str]]:
    """A spend budget on a route none of whose backends (its own, its fallbacks) has a
    ``price``: nothing would ever be charged against it; on a route that gives no default
    bound (``defaulted``: ``generation.default_max_tokens`` or ``max_tokens``), calls naming
    none are held at one generated token until their answers settle."""
    keys = [k for k in ("cost_per_day", "cost_per_month") if limit and getattr(limit, k)]
    if not priced:
        return [(f"rate_limit.{k}", "no backend of this route has a `price`: nothing is charged")
                for k in keys]  # fmt: skip
    if defaulted:
        return []
    return [
        (
            f"rate_limit.{k}",
            "a call naming no `max_tokens` is held at one generated token until its answer "
            "settles, so calls in flight may take a tenant past its budget: give the route "
            "`generation.default_max_tokens`",
        )
        for k in keys
    ]
