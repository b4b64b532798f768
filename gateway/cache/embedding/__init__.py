"""The embedding tier (opt-in): cached answers to paraphrases, after exact and SimHash.

tier.py     EmbeddingTier: lookup / add over the route's store, bounded, stale-safe
index.py    VectorIndex: one context's vectors, binary prefilter then exact cosine
verify.py   the rules: the guard, or its checks over reworded question frames
learned.py  the learned verifier (the default): hard differences, then a calibrated score
cross.py    the cross-encoder the learned verifier reads a candidate pair with
resident.py a model loaded once per process and run on its own thread
local.py    the local model (the ``embedding`` extra): MiniLM int8 ONNX on onnxruntime
backend.py  a policy backend's /v1/embeddings instead of the local model
shared.py   SharedIndex: with the Redis store, every replica's index entries in one stream
judge.py    BackendJudge (opt-in): the route's backend confirms grey-zone misses as aliases

This package imports without the extra (numpy only); ``available()`` says whether the
local model can run, and ``from_semantic`` builds a route's tier from its policy and an
``EmbeddingContext`` (what ``gateway.cache.embedding_seam`` calls); over a ``RedisStore``
the tier's index is shared by every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.cache.embedding.verify import verify  # the name of its module too: not lazy
from gateway.lazy import exports

if TYPE_CHECKING:
    from gateway.cache.embedding.backend import BackendEmbedder
    from gateway.cache.embedding.judge import BackendJudge
    from gateway.cache.embedding.local import MODEL_NAME, LocalEmbedder, LocalModel
    from gateway.cache.embedding.shared import SharedIndex
    from gateway.cache.embedding.tier import (
        DEFAULT_MAX_ENTRIES,
        DEFAULT_THRESHOLD,
        EMBEDDING,
        RULES_THRESHOLD,
        Embed,
        EmbeddingTier,
        rules,
    )
    from gateway.cache.stores.memory import MemoryStore
    from gateway.cache.stores.redis import RedisStore
    from gateway.clock import Clock
    from gateway.policy.model import Policy, Semantic
    from gateway.transport.upstream import Transport

_HOMES = {  # each name loads its module on first use (gateway/lazy.py)
    "BackendEmbedder": "backend",
    "BackendJudge": "judge",
    "LocalEmbedder": "local",
    "LocalModel": "local",
    "MODEL_NAME": "local",
    "SharedIndex": "shared",
    "DEFAULT_MAX_ENTRIES": "tier",
    "DEFAULT_THRESHOLD": "tier",
    "EMBEDDING": "tier",
    "RULES_THRESHOLD": "tier",
    "Embed": "tier",
    "EmbeddingTier": "tier",
    "rules": "tier",
}


__getattr__ = exports(__name__, _HOMES)


__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_THRESHOLD",
    "EMBEDDING",
    "MODEL_NAME",
    "RULES_THRESHOLD",
    "BackendEmbedder",
    "BackendJudge",
    "Embed",
    "EmbeddingContext",
    "EmbeddingTier",
    "LocalEmbedder",
    "LocalModel",
    "SharedIndex",
    "available",
    "from_semantic",
    "rules",
    "verify",
]


@dataclass(frozen=True, slots=True)
class EmbeddingContext:
    """What a route's tier may need besides its settings: the store holding the entries it
    points at, the upstream transport and policy (for an ``embedder`` backend), the clock."""

    route: str
    store: MemoryStore | RedisStore
    policy: Policy
    transport: Transport
    clock: Clock


def available(embedder: str | None = None, *, learned: bool = False) -> tuple[bool, str]:
    """Whether a route's embedding tier can run here, and why not (or what it uses).

    With ``embedder`` (a backend name) the tier needs no extra unless it runs the learned
    verifier (``learned``), whose cross-encoder runs on the local model's runtime and
    tokenizer; without ``embedder``, the local model's packages and files must be installed.
    """
    from gateway.cache.embedding import local

    if embedder:
        if learned:
            ok, reason = local.available()
            if not ok:
                return False, (
                    "the learned verifier reads each candidate with a cross-encoder, which "
                    f"needs the local model's runtime: {reason}; or set "
                    "cache.semantic.verifier: rules"
                )
        return True, f"embeddings from backend {embedder!r} (/v1/embeddings)"
    return local.available()


def from_semantic(semantic: Semantic, context: EmbeddingContext) -> EmbeddingTier:
    """The tier for a route's ``cache.semantic`` settings, its index shared by every
    replica when the store is Redis.  Replicas share vectors only with the same embedder
    identity: the local model's name, or the backend's name, ``model_version`` and
    ``embedder_model``.

    With ``judge.enabled`` (and the learned verifier) the tier's judge asks the route's own
    backend.

    Raises
    ``ImportError`` naming the install command when the local model is needed but the
    extra is missing, ``KeyError`` for an unknown ``embedder`` backend.
    """
    from gateway.cache.embedding import learned, local
    from gateway.cache.embedding.backend import BackendEmbedder
    from gateway.cache.embedding.judge import BackendJudge
    from gateway.cache.embedding.local import MODEL_NAME
    from gateway.cache.embedding.tier import EmbeddingTier, rules
    from gateway.cache.stores.redis import RedisStore

    if semantic.embedder:
        backend = context.policy.backend(semantic.embedder)
        embed: Embed = BackendEmbedder(context.transport, backend, model=semantic.embedder_model)
        identity = f"backend:{backend.name}@{backend.model_version}:{semantic.embedder_model or ''}"
    else:
        ok, reason = local.available()
        if not ok:
            raise ImportError(reason)
        embedder = local.shared()
        embedder.start_loading()  # off the event loop; the first lookup waits for it
        embed = embedder
        identity = f"local:{MODEL_NAME}"
    verifier = learned.verifier_for(semantic) if learned.uses_learned(semantic) else rules
    if isinstance(verifier, learned.LearnedVerifier):
        verifier.reader.start_loading()  # the cross-encoder, off the event loop
    judge = None
    if semantic.judge.enabled and verifier is not rules:
        route = next(r for r in context.policy.routes if r.name == context.route)
        judge = BackendJudge(
            semantic.judge,
            context.transport,
            context.policy.backend(route.backend),
            clock=context.clock,
            route=context.route,
        )
    tier = EmbeddingTier(
        context.store, embed, threshold=semantic.threshold, verifier=verifier, judge=judge
    )
    if isinstance(context.store, RedisStore):
        tier.share(context.store, context.route, identity, context.clock)
    return tier
