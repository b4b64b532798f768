"""The embedding tier (opt-in): cached answers to paraphrases, after exact and SimHash.

tier.py     EmbeddingTier: lookup / add over the route's store, bounded, stale-safe
index.py    VectorIndex: one context's vectors, binary prefilter then exact cosine
verify.py   the guard, or its checks over reworded question frames
local.py    the local model (the ``embedding`` extra): MiniLM int8 ONNX on onnxruntime
backend.py  a policy backend's /v1/embeddings instead of the local model

This package imports without the extra (numpy only); ``available()`` says whether the
local model can run, and ``from_semantic`` builds a route's tier from its policy, the seam
``gateway.stages.cache_embedding`` calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import local
from .backend import BackendEmbedder
from .local import LocalEmbedder, LocalModel
from .tier import DEFAULT_MAX_ENTRIES, DEFAULT_THRESHOLD, EMBEDDING, Embed, EmbeddingTier
from .verify import verify

if TYPE_CHECKING:
    from ...policy.model import Semantic

__all__ = [
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_THRESHOLD",
    "EMBEDDING",
    "BackendEmbedder",
    "Embed",
    "EmbeddingTier",
    "LocalEmbedder",
    "LocalModel",
    "available",
    "from_semantic",
    "verify",
]


def available(embedder: str | None = None) -> tuple[bool, str]:
    """Whether a route's embedding tier can run here, and why not (or what it uses).

    With ``embedder`` (a backend name) the tier needs no extra; without it, the local
    model's packages and files must be installed.
    """
    if embedder:
        return True, f"embeddings from backend {embedder!r} (/v1/embeddings)"
    return local.available()


def from_semantic(semantic: Semantic, context: Any) -> EmbeddingTier:
    """The tier for a route's ``cache.semantic`` settings.

    ``context`` is the stage's ``EmbeddingContext`` (store, policy, transport).  Raises
    ``ImportError`` naming the install command when the local model is needed but the
    extra is missing, ``KeyError`` for an unknown ``embedder`` backend.
    """
    if semantic.embedder:
        backend = context.policy.backend(semantic.embedder)
        embed: Embed = BackendEmbedder(context.transport, backend, model=semantic.embedder_model)
    else:
        ok, reason = local.available()
        if not ok:
            raise ImportError(reason)
        embedder = local.shared()
        embedder.start_loading()  # off the event loop; the first lookup waits for it
        embed = embedder
    return EmbeddingTier(context.store, embed, threshold=semantic.threshold)
