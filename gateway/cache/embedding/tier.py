"""``EmbeddingTier``: cached answers to paraphrases, by cosine similarity, verified.

After the exact and SimHash tiers miss, a lookup embeds the final user message, finds the
most similar messages cached in the same exact context (``RequestKey.context``, which
includes the tenant scope), and returns the first candidate that

1. has cosine similarity >= ``threshold``,
2. still exists in the store (entries expire, are evicted and purged there; the index
   only points at them, and a stale pointer is dropped and is a miss), belongs to the
   asking tenant's scope and the same context, and
3. passes ``verify`` against the message it was stored for: the near-duplicate guard, or
   the guard's checks over reworded question frames (see ``verify``).

The index lives in this process (one ``VectorIndex`` per context) and is bounded by
``max_entries`` across contexts, least recently used first out.  An embedder failure is a
miss, counted.  A context with nothing cached costs no embedding.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from ...errors import GatewayError, StoreError
from ..keys import RequestKey
from ..stores.base import CacheStore
from ..tiers import Hit
from .index import VectorIndex
from .verify import verify

log = logging.getLogger("gateway.cache")

EMBEDDING = "embedding"
DEFAULT_THRESHOLD = 0.90
"""Cosine similarity a candidate needs before verification.  Measured (docs/caching.md,
``gateway cache-eval``): with verification, precision is 100% on the question-pair,
adversarial and PAWS sets at every threshold from 0.80 to 0.95, and recall is the same from
0.80 to 0.90 (verified question-pair duplicates score 0.92 or more, PAWS ones 0.94), so 0.90
loses nothing there while a verified pair the model scores lower (a reworded frame that
changed the question in a way the rules do not see) stays a miss.  Calibrated for the local
MiniLM model: with a backend ``embedder``, check the threshold for that model."""
DEFAULT_MAX_ENTRIES = 100_000
MAX_CANDIDATES = 8
"""At most this many candidates above the threshold are fetched and verified per lookup."""
MEMO_TEXTS = 1024
"""Vectors of recent texts kept, so a miss's ``add`` reuses its ``lookup``'s embedding."""

Embed = Callable[[Sequence[str]], Awaitable[Any]]
"""An embedder: texts -> one vector per text (any array-like of floats, rows in order)."""


class EmbeddingTier:
    """The embedding tier of one route, over the route's store and an embedder."""

    def __init__(
        self,
        store: CacheStore,
        embed: Embed,
        *,
        threshold: float | None = None,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        max_candidates: int = MAX_CANDIDATES,
        name: str = "",
    ) -> None:
        threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be within (0, 1]")
        if max_entries < 1 or max_candidates < 1:
            raise ValueError("max_entries and max_candidates must be >= 1")
        self.store = store
        self.threshold = threshold
        self.max_entries = max_entries
        self.max_candidates = max_candidates
        self.name = name or getattr(embed, "name", type(embed).__name__)
        self._embed = embed
        self._indexes: dict[str, VectorIndex] = {}
        self._lru: OrderedDict[str, str] = OrderedDict()  # entry key -> context
        self._memo: OrderedDict[str, np.ndarray] = OrderedDict()
        self.results: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def contexts(self) -> int:
        return len(self._indexes)

    async def lookup(self, key: RequestKey, text: str) -> Hit | None:
        """A verified cached answer to a paraphrase of ``text`` in ``key``'s context."""
        index = self._indexes.get(key.context) if key.context is not None else None
        if index is None or not len(index):
            self.results["miss"] += 1
            return None
        vector = await self._vector(text)
        if vector is None or vector.shape[0] != index.dims:
            self.results["miss"] += 1
            return None
        for entry_key, similarity in index.search(vector, self.threshold, self.max_candidates):
            try:
                entry = await self.store.get(entry_key)
            except StoreError as exc:  # counted by the store's own tiers; a miss here
                log.debug("embedding tier (%s): store failed: %s", self.name, exc)
                self.results["store_error"] += 1
                break
            if entry is None:
                self.results["stale"] += 1
                self._forget(entry_key)
                continue
            if entry.scope != key.scope or entry.context != key.context or entry.prompt is None:
                self.rejections["scope"] += 1
                continue
            verdict = verify(entry.prompt, text)
            if not verdict.ok:
                self.rejections[verdict.reason] += 1
                continue
            if entry_key in self._lru:
                self._lru.move_to_end(entry_key)
            self.results[EMBEDDING] += 1
            return Hit(entry, EMBEDDING, similarity, entry_key)
        self.results["miss"] += 1
        return None

    async def add(self, key: RequestKey, text: str, entry_key: str) -> None:
        """Index ``text``, the final user message of the entry stored under ``entry_key``."""
        if key.context is None:
            return
        vector = await self._vector(text)
        if vector is None:
            return
        index = self._indexes.get(key.context)
        if index is None or index.dims != vector.shape[0]:
            if index is not None:  # the embedder's dimensions changed: start over
                for old in index.keys():
                    self._lru.pop(old, None)
            index = self._indexes[key.context] = VectorIndex(vector.shape[0])
        previous = self._lru.pop(entry_key, None)
        if previous is not None and previous != key.context:
            self._drop(previous, entry_key)
        index.add(entry_key, vector)
        self._lru[entry_key] = key.context
        while len(self._lru) > self.max_entries:
            old_key, old_context = self._lru.popitem(last=False)
            self._drop(old_context, old_key)
            self.results["evicted"] += 1

    def forget(self, entry_key: str) -> bool:
        """Drop ``entry_key`` from the index (e.g. after a purge); False if not indexed."""
        if entry_key not in self._lru:
            return False
        self._forget(entry_key)
        return True

    def clear(self) -> None:
        """Drop every indexed entry."""
        self._indexes.clear()
        self._lru.clear()

    def nbytes(self) -> int:
        """Bytes held by the vector arrays of every context."""
        return sum(index.nbytes for index in self._indexes.values())

    async def _vector(self, text: str) -> np.ndarray | None:
        vector = self._memo.get(text)
        if vector is not None:
            self._memo.move_to_end(text)
            return vector
        try:
            rows = np.asarray(await self._embed([text]), dtype=np.float32)
        except (GatewayError, OSError, ImportError) as exc:
            # ImportError: the local model's files are missing or not the pinned ones
            self.results["embed_error"] += 1
            level = logging.DEBUG if self.results["embed_error"] > 1 else logging.WARNING
            log.log(level, "embedding tier (%s): the embedder failed: %s", self.name, exc)
            return None
        if rows.ndim != 2 or rows.shape[0] != 1 or not np.isfinite(rows).all():
            self.results["embed_error"] += 1
            log.warning(
                "embedding tier (%s): the embedder answered shape %s", self.name, rows.shape
            )
            return None
        vector = rows[0]
        norm = float(np.linalg.norm(vector))
        if norm == 0.0:
            self.results["embed_error"] += 1
            return None
        vector = vector / norm
        self._memo[text] = vector
        if len(self._memo) > MEMO_TEXTS:
            self._memo.popitem(last=False)
        return vector

    def _forget(self, entry_key: str) -> None:
        context = self._lru.pop(entry_key, None)
        if context is not None:
            self._drop(context, entry_key)

    def _drop(self, context: str, entry_key: str) -> None:
        index = self._indexes.get(context)
        if index is not None and index.remove(entry_key) and not len(index):
            del self._indexes[context]

    def __repr__(self) -> str:
        results = " ".join(f"{k}={v}" for k, v in sorted(self.results.items()))
        rejected = sum(self.rejections.values())
        return (
            f"<EmbeddingTier embedder={self.name} threshold={self.threshold:.2f} "
            f"entries={len(self)}/{self.max_entries} contexts={self.contexts} "
            f"rejected={rejected}{' ' + results if results else ''}>"
        )
