"""``EmbeddingTier``: cached answers to paraphrases, by cosine similarity, verified.

After the exact and SimHash tiers miss, a lookup embeds the final user message, finds the
most similar messages cached in the same exact context (``RequestKey.context``, which
includes the tenant scope), and returns the first candidate that

1. has cosine similarity >= ``threshold``,
2. still exists in the store (entries expire, are evicted and purged there; the index
   only points at them, and a stale pointer is dropped and is a miss), belongs to the
   asking tenant's scope and the same context, and
3. passes the route's verifier against the message it was stored for: by default the
   learned verifier (``learned.py``: no hard difference, and a score at the operating
   point of the route's error budget), or the rules (``verify``: the near-duplicate
   guard, or its checks over reworded question frames).

With a judge (``judge.py``, opt-in), a lookup first asks whether the message is an alias
the judge confirmed for this context (no embedding needed), and a miss whose best refused
candidate scored in the grey zone (no hard difference, a score >= the judge's floor) hands
that pair to the judge, off the request path (``mode: background``), or asks it then and
there and, on a yes, answers from that candidate (``mode: inline``).

The index is held in this process (one ``VectorIndex`` per context), bounded by
``max_entries`` across contexts, least recently used first out.  Over the Redis store it is
shared (``share``, ``shared.py``): what any replica indexes reaches every replica's index
through a Redis stream, read before each lookup, so a replica finds paraphrases of answers
the others stored.  An embedder failure is a miss, counted.  A context with nothing cached
(here or, after the read, by another replica) costs no embedding.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from gateway.cache.embedding.index import VectorIndex
from gateway.cache.embedding.judge import BackendJudge, Pair
from gateway.cache.embedding.learned import MAX_CROSS, SCORE, LearnedVerifier
from gateway.cache.embedding.shared import SharedIndex
from gateway.cache.embedding.verify import verify
from gateway.cache.entry import CachedResponse
from gateway.cache.guard import Verdict
from gateway.cache.keys import RequestKey
from gateway.cache.stores.base import CacheStore
from gateway.cache.stores.redis import RedisStore
from gateway.cache.tiers import Hit, prompt_form
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import GatewayError, StoreError

log = logging.getLogger("gateway.cache")

EMBEDDING = "embedding"
JUDGED = "judged"
"""The match of a hit through an alias the judge confirmed."""
DEFAULT_THRESHOLD = 0.80
"""Cosine similarity a candidate needs before the learned verifier scores it: below it,
the development pairs the verifier would accept are too few to matter (docs/caching.md),
and fewer candidates are scored per lookup.  For the local MiniLM model."""
RULES_THRESHOLD = 0.90
"""The same floor for the rule-based verifier (``verifier: rules``): with the rules,
recall on the development sets is the same from 0.80 to 0.90, and a pair the model scores
lower that the rules pass (a reworded frame that changed the question in a way the rules
do not see) stays a miss."""
DEFAULT_MAX_ENTRIES = 100_000
MAX_CANDIDATES = 8
"""At most this many candidates above the threshold are fetched and verified per lookup."""
MEMO_TEXTS = 1024
"""Vectors of recent texts kept, so a miss's ``add`` reuses its ``lookup``'s embedding."""
MESSAGE_TOO_LONG = "message_too_long"
"""The refusal of a lookup whose message no pair could be read whole with (the learned
verifier's ``unreadable``): counted once a lookup, beside the candidates' reasons."""

Embed = Callable[[Sequence[str]], Awaitable[Any]]
"""An embedder: texts -> one vector per text (any array-like of floats, rows in order)."""
Verifier = Callable[[str, str, float], Verdict]
"""Whether a cached message may answer the asked one: (cached, asked, cosine) -> verdict."""


def rules(first: str, second: str, cosine: float) -> Verdict:
    """The rule-based verifier (``verify``) as a ``Verifier``; the cosine is not used."""
    return verify(first, second)


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
        verifier: Verifier = rules,
        judge: BackendJudge | None = None,
    ) -> None:
        if threshold is None:
            threshold = RULES_THRESHOLD if verifier is rules else DEFAULT_THRESHOLD
        threshold = float(threshold)
        if not 0.0 < threshold <= 1.0:
            raise ValueError("threshold must be within (0, 1]")
        if max_entries < 1 or max_candidates < 1:
            raise ValueError("max_entries and max_candidates must be >= 1")
        self.store = store
        self.verifier = verifier
        self.judge = judge if isinstance(verifier, LearnedVerifier) else None
        self.threshold = threshold
        self.max_entries = max_entries
        self.max_candidates = max_candidates
        self.name = name or getattr(embed, "name", type(embed).__name__)
        self.dims: int | None = None
        self.shared: SharedIndex | None = None
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

    def share(
        self, store: RedisStore, route: str, embedder: str, clock: Clock = SYSTEM_CLOCK
    ) -> SharedIndex:
        """Share this index with every tier of ``route`` over ``store`` whose embedder is
        ``embedder`` (an identity: the model, and what else changes its vectors)."""
        self.shared = SharedIndex(
            store, route, embedder, self.add_vector, max_entries=self.max_entries, clock=clock
        )
        return self.shared

    async def lookup(self, key: RequestKey, text: str, *, model: str | None = None) -> Hit | None:
        """A verified cached answer to a paraphrase of ``text`` in ``key``'s context
        (``model``: the one the request named, for the judge)."""
        if self.judge is not None and key.context is not None and len(self.judge):
            hit = await self._aliased(key, text)
            if hit is not None:
                return hit
        if isinstance(self.verifier, LearnedVerifier) and self.verifier.unreadable(text):
            self.rejections[MESSAGE_TOO_LONG] += 1  # no pair with it could be read whole
            return None
        vector: np.ndarray | None = None
        embedded = False
        if self.shared is not None and key.context is not None:
            if key.context in self._indexes:  # embed while the other replicas' news is read
                vector, _ = await asyncio.gather(self._vector(text), self.shared.sync())
                embedded = True
            else:
                await self.shared.sync()
        index = self._indexes.get(key.context) if key.context is not None else None
        if index is None or not len(index):
            self.results["miss"] += 1
            return None
        if not embedded:
            vector = await self._vector(text)
        if vector is None or vector.shape[0] != index.dims:
            self.results["miss"] += 1
            return None
        grey: tuple[float, Pair, CachedResponse] | None = None
        reads = 0  # candidates the cross-encoder read
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
            if not isinstance(self.verifier, LearnedVerifier):
                verdict = self.verifier(entry.prompt, text, similarity)
            else:
                verdict, score, read = await self.verifier.check(
                    entry.prompt, text, similarity, may_read=reads < MAX_CROSS
                )
                reads += read
                if (
                    self.judge is not None
                    and key.context is not None
                    and verdict.reason == SCORE
                    and score >= self.judge.settings.min_score
                    and (grey is None or score > grey[0])
                ):
                    pair = Pair(
                        key.context,
                        key.scope,
                        text,
                        prompt_form(text),
                        entry.prompt,
                        entry_key,
                        entry.created_at,
                        similarity,
                        model,
                    )
                    grey = (score, pair, entry)
            if not verdict.ok:
                self.rejections[verdict.reason] += 1
                continue
            if entry_key in self._lru:
                self._lru.move_to_end(entry_key)
            self.results[EMBEDDING] += 1
            return Hit(entry, EMBEDDING, similarity, entry_key)
        if grey is not None and self.judge is not None:
            _, pair, entry = grey
            if self.judge.settings.mode == "inline":
                same = await self.judge.decide(pair)
                self.results[f"judge_inline_{'none' if same is None else same}"] += 1
                if same:
                    self.results[JUDGED] += 1
                    return Hit(entry, JUDGED, pair.similarity, pair.entry_key)
            else:
                self.results[f"judge_{self.judge.submit(pair)}"] += 1
        self.results["miss"] += 1
        return None

    async def _aliased(self, key: RequestKey, text: str) -> Hit | None:
        """The entry a judge's alias names for ``text``, while it is still the entry that
        was judged, of this tenant and context."""
        assert self.judge is not None and key.context is not None
        form = prompt_form(text)
        alias = self.judge.alias(key.context, form)
        if alias is None:
            return None
        try:
            entry = await self.store.get(alias.entry_key)
        except StoreError as exc:
            log.debug("embedding tier (%s): store failed: %s", self.name, exc)
            self.results["store_error"] += 1
            return None
        if (
            entry is None
            or entry.created_at != alias.created_at
            or entry.scope != key.scope
            or entry.scope != alias.scope
            or entry.context != key.context
        ):
            self.judge.drop(key.context, form)
            self.results["alias_stale"] += 1
            return None
        self.results[JUDGED] += 1
        return Hit(entry, JUDGED, alias.similarity, alias.entry_key)

    async def add(self, key: RequestKey, text: str, entry_key: str) -> None:
        """Index ``text``, the final user message of the entry stored under ``entry_key``."""
        if key.context is None:
            return
        if isinstance(self.verifier, LearnedVerifier) and self.verifier.unreadable(text):
            return  # never verifiable: not worth its embedding or its place
        vector = await self._vector(text)
        if vector is None:
            return
        index = self._indexes.get(key.context)
        if index is not None and index.dims != vector.shape[0]:
            for old in index.keys():  # the embedder's dimensions changed: start over
                self._lru.pop(old, None)
            del self._indexes[key.context]
        self._file(key.context, entry_key, vector)
        if self.shared is not None:
            await self.shared.publish(key.context, entry_key, vector)

    def add_vector(self, context: str, entry_key: str, vector: np.ndarray) -> bool:
        """Index another replica's unit ``vector`` for ``entry_key`` in ``context``; False
        (not indexed) when its dimensions are not this embedder's."""
        index = self._indexes.get(context)
        dims = vector.shape[0]
        if (self.dims is not None and dims != self.dims) or (
            index is not None and dims != index.dims
        ):
            return False
        self._file(context, entry_key, vector)
        return True

    def _file(self, context: str, entry_key: str, vector: np.ndarray) -> None:
        index = self._indexes.get(context)
        if index is None:
            index = self._indexes[context] = VectorIndex(vector.shape[0])
        previous = self._lru.pop(entry_key, None)
        if previous is not None and previous != context:
            self._drop(previous, entry_key)
        index.add(entry_key, vector)
        self._lru[entry_key] = context
        while len(self._lru) > self.max_entries:
            old_key, old_context = self._lru.popitem(last=False)
            self._drop(old_context, old_key)
            self.results["evicted"] += 1

    def forget(self, entry_key: str) -> bool:
        """Drop ``entry_key`` from the index and the judge's aliases (e.g. after a purge);
        False if it was in neither."""
        aliases = self.judge.forget(entry_key) if self.judge is not None else 0
        if entry_key not in self._lru:
            return aliases > 0
        self._forget(entry_key)
        return True

    def clear(self) -> None:
        """Drop every indexed entry."""
        self._indexes.clear()
        self._lru.clear()

    def drain(self) -> None:
        """Shutdown has begun: the judge takes no more pairs."""
        if self.judge is not None:
            self.judge.drain()

    async def aclose(self) -> None:
        """Stop reading the shared stream and judging (when a reload replaces the tier)."""
        if self.judge is not None:
            await self.judge.aclose()
        if self.shared is not None:
            await self.shared.aclose()

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
        self.dims = vector.shape[0]
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
            f"verifier={_verifier_name(self.verifier)} "
            f"entries={len(self)}/{self.max_entries} contexts={self.contexts} "
            f"rejected={rejected}{' ' + results if results else ''}"
            f"{' judge=' + str(len(self.judge)) + '_aliases' if self.judge is not None else ''}"
            f"{' shared=' + self.shared.last_id if self.shared is not None else ''}>"
        )


def _verifier_name(verifier: Verifier) -> str:
    min_score = getattr(verifier, "min_score", None)
    if min_score is not None:
        return f"learned>={min_score:.3f}"
    return "rules" if verifier is rules else getattr(verifier, "__name__", "custom")
