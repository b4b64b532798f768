"""What the cache stage needs of the embedding tier, and how it gets one.

A route with ``semantic.method: embedding`` asks, after the exact and SimHash tiers have
missed, an embedding tier for a cached answer to a paraphrase, and tells it every answer it
stores.  The tier is ``gateway.cache.embedding.from_semantic`` unless the gateway was given
another factory (``Gateway(embedding_tiers=...)``: a test's tier, or a user's own); any
object with the two methods of ``EmbeddingLookup`` will do.  When the tier cannot run here
(the local model's extra is not installed) or fails to start, the route keeps its exact and
SimHash tiers; ``unavailable()`` says why, for ``gateway check`` and the startup log, and
never raises.

Whatever the tier answers, the stage accepts a hit only for an entry of the asking tenant's
scope and the same exact context (``RequestKey.context``): isolation does not depend on the
tier being right.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from gateway.cache import embedding
from gateway.cache.embedding import EmbeddingContext
from gateway.cache.embedding.judge import VERDICTS
from gateway.cache.keys import RequestKey
from gateway.cache.tiers import Hit
from gateway.metrics import EmbeddingFigures
from gateway.policy.model import Policy, Semantic
from gateway.state import Kind

__all__ = [
    "EMBEDDING",
    "OPERATING_POINTS",
    "EmbeddingContext",
    "EmbeddingLookup",
    "OperatingPoints",
    "TierFactory",
    "build_tier",
    "figures_of",
]

log = logging.getLogger("gateway.cache")

EMBEDDING = "embedding"


class EmbeddingLookup(Protocol):
    """Finds cached answers to paraphrases of a route's final user messages."""

    async def lookup(self, key: RequestKey, text: str) -> Hit | None: ...

    async def add(self, key: RequestKey, text: str, entry_key: str) -> None: ...


TierFactory = Callable[[Semantic, EmbeddingContext], EmbeddingLookup]
"""Builds a route's tier from its ``cache.semantic`` settings; raises ``ImportError`` when
what it needs is not installed."""


def unavailable(semantic: Semantic) -> str | None:
    """Why the shipped embedding tier for a route's ``cache.semantic`` (with its
    ``embedder``, a backend name, or the local model; and its verifier) cannot be used here,
    or None when it can."""
    from gateway.cache.embedding.learned import uses_learned

    prefix = "the embedding tier is unavailable"
    try:
        ok, reason = embedding.available(semantic.embedder, learned=uses_learned(semantic))
    except Exception as exc:  # a broken installation must not break `gateway check`
        return f"{prefix}: checking it failed ({type(exc).__name__}: {exc})"
    return None if ok else f"{prefix}: {reason}"


def build_tier(
    semantic: Semantic, context: EmbeddingContext, factory: TierFactory | None = None
) -> EmbeddingLookup | None:
    """The route's embedding tier, or None (logged) when it cannot be had."""
    fallback = "serving exact and SimHash hits only"
    if factory is None:
        reason = unavailable(semantic)
        if reason is not None:
            log.warning("route %s: %s; %s", context.route, reason, fallback)
            return None
        factory = embedding.from_semantic
    try:
        return factory(semantic, context)
    except ImportError as exc:
        log.warning(
            "route %s: the embedding tier is unavailable: %s; %s", context.route, exc, fallback
        )
    except Exception:
        log.exception("route %s: the embedding tier failed to start; %s", context.route, fallback)
    return None


class OperatingPoints:
    """Each embedding route's operating point as in force, for ``GET /policy``
    (``snapshot.OperatingPoints``: the admin finds it under ``CACHE_OPERATING_POINTS``)."""

    def in_force(self, policy: Policy) -> dict[str, object]:
        from gateway.cache.embedding.learned import in_force  # its shipped model: on use

        return {
            route.name: in_force(route.cache.semantic)
            for route in policy.routes
            if route.cache is not None and route.cache.semantic.method == EMBEDDING
        }


OPERATING_POINTS: Kind[OperatingPoints] = Kind("cache-operating-points")


def figures_of(tiers: Iterable[tuple[str, EmbeddingLookup | None]]) -> list[EmbeddingFigures]:
    """The figures of each route's shipped embedding tier (``(route, tier)``), for the
    metrics; a test's or a user's own tier has none."""
    return [
        EmbeddingFigures(
            name,
            len(tier),
            tier.shared.counts if tier.shared is not None else None,
            {v: tier.judge.counts[v] for v in VERDICTS} if tier.judge is not None else None,
            len(tier.judge) if tier.judge is not None else 0,
            dict(tier.rejections),
        )
        for name, tier in tiers
        if tier is not None and isinstance(tier, embedding.EmbeddingTier)
    ]
