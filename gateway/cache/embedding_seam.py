"""The seam between the cache stage and the optional embedding tier.

A route with ``semantic.method: embedding`` asks, after the exact and SimHash tiers have
missed, an embedding tier for a cached answer to a paraphrase.  The tier lives in
``gateway.cache.embedding`` (shipped with the embedding extra), which must export::

    def from_semantic(semantic: Semantic, context: EmbeddingContext) -> EmbeddingTier

returning an object with ``async lookup(key, text) -> Hit | None`` and ``async add(key,
text, entry_key) -> None``, and may export ``available(embedder) -> (ok, reason)`` to say
whether it can run here (e.g. its local model's extra is installed).  Without the module,
or when it cannot run or build a tier, the route keeps its exact and SimHash tiers;
``unavailable()`` says why, for ``gateway check`` and the startup log, and never raises.

Whatever the tier answers, the stage accepts a hit only for an entry of the asking tenant's
scope and the same exact context (``RequestKey.context``): isolation does not depend on the
tier being right.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.cache.keys import RequestKey
from gateway.cache.tiers import Hit
from gateway.clock import Clock
from gateway.policy.model import Policy, Semantic
from gateway.transport.upstream import Transport

log = logging.getLogger("gateway.cache")

MODULE = "gateway.cache.embedding"
FACTORY = "from_semantic"
EMBEDDING = "embedding"


class EmbeddingTier(Protocol):
    """Finds cached answers to paraphrases of a route's final user messages."""

    async def lookup(self, key: RequestKey, text: str) -> Hit | None: ...

    async def add(self, key: RequestKey, text: str, entry_key: str) -> None: ...


@dataclass(frozen=True, slots=True)
class EmbeddingContext:
    """What a tier may need besides its settings: the store holding the entries it points
    at, the upstream transport and policy (for an ``embedder`` backend), and the clock."""

    route: str
    store: Any
    policy: Policy
    transport: Transport
    clock: Clock


def unavailable(embedder: str | None = None) -> str | None:
    """Why the embedding tier (with ``embedder``, a backend name, or the local model) cannot
    be used here, or None when it can."""
    prefix = "the embedding tier is unavailable"
    try:
        module = importlib.import_module(MODULE)
    except ImportError as exc:
        return f"{prefix}: {MODULE} cannot be imported ({exc}); install the embedding extra"
    if not callable(getattr(module, FACTORY, None)):
        return f"{prefix}: {MODULE} has no {FACTORY}()"
    check = getattr(module, "available", None)
    if callable(check):
        try:
            ok, reason = check(embedder)
        except Exception as exc:  # a broken installation must not break `gateway check`
            return f"{prefix}: {MODULE}.available() failed ({type(exc).__name__}: {exc})"
        if not ok:
            return f"{prefix}: {reason}"
    return None


def build_tier(semantic: Semantic, context: EmbeddingContext) -> EmbeddingTier | None:
    """The route's embedding tier, or None (logged) when it cannot be had."""
    reason = unavailable(semantic.embedder)
    if reason is not None:
        log.warning("route %s: %s; serving exact and SimHash hits only", context.route, reason)
        return None
    factory = getattr(importlib.import_module(MODULE), FACTORY)
    try:
        tier: EmbeddingTier = factory(semantic, context)
    except ImportError as exc:
        log.warning(
            "route %s: the embedding tier is unavailable: %s; serving exact and SimHash hits only",
            context.route,
            exc,
        )
        return None
    except Exception:
        log.exception(
            "route %s: the embedding tier failed to start; serving exact and SimHash hits only",
            context.route,
        )
        return None
    return tier
