"""``ResponseCache``: the exact and near-duplicate tiers over one store.

Lookups try the exact key first, then (for chat requests whose last message is plain user
text) the SimHash candidates of the same context, nearest first, each re-checked by the
guard against the prompt it was stored for.  Every hit is also checked to belong to the
asking tenant's scope, whatever the store returned.  A ``StoreError`` is a miss: counted,
reported to ``on_store_error``, never raised.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache

from gateway.cache.entry import CachedResponse
from gateway.cache.guard import check
from gateway.cache.items import CachedItem, ItemPlan, decode_item, encode_item
from gateway.cache.keys import RequestKey
from gateway.cache.normalize import comparable_form, normalize
from gateway.cache.simhash import BITS, MAX_DISTANCE, fingerprint
from gateway.cache.stores.base import CacheStore
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError

DEFAULT_MAX_DISTANCE = MAX_DISTANCE
"""Default SimHash threshold: the widest the band index serves.  Measured (docs): with the
guard, precision is 100% at every threshold 0..3 on the adversarial, question-pair and PAWS
sets, so the widest threshold costs nothing and finds the most candidates."""

MAX_CANDIDATES = 8
"""At most this many candidates are fetched and guarded per lookup (bounds the time)."""

EXACT, SIMHASH = "exact", "simhash"


@dataclass(frozen=True, slots=True)
class Hit:
    """A cached answer for a request: how it matched and how similar the prompts were."""

    entry: CachedResponse
    match: str
    similarity: float
    key: str


@lru_cache(maxsize=1024)
def prompt_fingerprint(prompt: str) -> int:
    """The SimHash of a prompt, memoised between a miss's lookup and its store."""
    return fingerprint(prompt)


@lru_cache(maxsize=1024)
def prompt_form(prompt: str) -> str:
    """The ``comparable_form`` of a prompt, memoised between a miss's lookup and its store."""
    return comparable_form(normalize(prompt))


class ResponseCache:
    """The cache tiers in front of a backend, over an injected ``CacheStore``."""

    def __init__(
        self,
        store: CacheStore,
        *,
        max_distance: int = DEFAULT_MAX_DISTANCE,
        on_store_error: Callable[[StoreError], None] | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not 0 <= max_distance <= MAX_DISTANCE:
            raise ValueError(f"max_distance must be within 0..{MAX_DISTANCE}")
        self.store = store
        self.max_distance = max_distance
        self._on_store_error = on_store_error
        self._clock = clock
        self.store_errors = 0
        self.results: Counter[str] = Counter()

    async def lookup(self, key: RequestKey, *, near: bool = True, exact: bool = True) -> Hit | None:
        """The cached answer for ``key``, or None; never raises for a store failure.

        ``exact=False`` skips the exact tier, for a caller that already tried it (with a key
        lacking the context, which is cheaper to compute).  ``results`` counts calls."""
        try:
            hit = await self._lookup(key, near, exact)
        except StoreError as exc:
            self._failed(exc)
            hit = None
        self.results[hit.match if hit else "miss"] += 1
        return hit

    async def put(self, key: RequestKey, entry: CachedResponse, ttl_s: float) -> bool:
        """Store ``entry`` as the answer for ``key``; False when the store failed.

        The entry's scope, prompt, context, fingerprint and prompt form are taken from
        ``key``.
        """
        entry = replace(
            entry,
            scope=key.scope,
            prompt=key.prompt,
            context=key.context,
            fingerprint=prompt_fingerprint(key.prompt) if key.prompt is not None else None,
            prompt_form=prompt_form(key.prompt) if key.prompt is not None else None,
        )
        try:
            await self.store.set(key.exact, entry, ttl_s)
        except StoreError as exc:
            self._failed(exc)
            return False
        return True

    async def get_items(self, plan: ItemPlan) -> list[CachedItem | None]:
        """The cached embedding of each item of ``plan`` (None where missing); all None when
        the store fails."""
        try:
            entries = await self.store.get_many(plan.keys)
        except StoreError as exc:
            self._failed(exc)
            return [None] * len(plan.keys)
        items: list[CachedItem | None] = []
        for entry in entries:
            try:
                item = decode_item(entry.body) if entry and entry.body is not None else None
            except ValueError:
                item = None
            items.append(replace(item, created_at=entry.created_at) if entry and item else None)
        hits = sum(1 for item in items if item is not None)
        self.results["item_hit"] += hits
        self.results["item_miss"] += len(items) - hits
        return items

    async def put_items(
        self,
        plan: ItemPlan,
        fresh: Mapping[int, CachedItem],
        ttl_s: float,
        *,
        scope: str,
        backend: str,
        model_version: str,
        route: str,
    ) -> bool:
        """Store the items fetched upstream; False when the store failed."""
        now = self._clock.wall()
        entries = [
            (
                plan.keys[i],
                CachedResponse(
                    200, (), encode_item(item), None, now, backend, model_version, route, scope
                ),
            )
            for i, item in sorted(fresh.items())
        ]
        try:
            await self.store.set_many(entries, ttl_s)
        except StoreError as exc:
            self._failed(exc)
            return False
        return True

    async def purge(
        self,
        *,
        backend: str | None = None,
        model_version: str | None = None,
        scope: str | None = None,
    ) -> int:
        """Delete matching entries (all when no filter); raises ``StoreError`` if it fails,
        since an operator asked for it and must know."""
        return await self.store.purge(backend=backend, model_version=model_version, scope=scope)

    async def _lookup(self, key: RequestKey, near: bool, exact: bool) -> Hit | None:
        if exact:
            entry = await self.store.get(key.exact)
            if entry is not None and entry.scope == key.scope:
                return Hit(entry, EXACT, 1.0, key.exact)
        if not near or key.context is None or key.prompt is None:
            return None
        fp = prompt_fingerprint(key.prompt)
        candidates = await self.store.candidates(key.context, fp, self.max_distance)
        if not candidates:  # the prompt's form is needed only to compare it with theirs
            return None
        form = prompt_form(key.prompt)
        for candidate in candidates[:MAX_CANDIDATES]:
            found = candidate.entry or await self.store.get(candidate.key)
            if (
                found is not None
                and found.scope == key.scope
                and found.context == key.context
                and found.prompt is not None
                # Equal forms mean equal normalised messages, which the guard always passes:
                # the stored prompt need not be normalised again.
                and (found.prompt_form == form or check(found.prompt, key.prompt).ok)
            ):
                return Hit(found, SIMHASH, 1 - candidate.distance / BITS, candidate.key)
        return None

    def _failed(self, exc: StoreError) -> None:
        self.store_errors += 1
        if self._on_store_error is not None:
            self._on_store_error(exc)

    def __repr__(self) -> str:
        results = " ".join(f"{k}={v}" for k, v in sorted(self.results.items()))
        return (
            f"<ResponseCache store={self.store!r} max_distance={self.max_distance} "
            f"store_errors={self.store_errors} {results}>".replace("  ", " ").replace(" >", ">")
        )
