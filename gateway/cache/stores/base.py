"""The ``CacheStore`` protocol every store implements, and the values stores return.

A store keeps ``CachedResponse`` entries under exact keys with a TTL, and a near-duplicate
index: each entry with a context key and a SimHash fingerprint is filed under its
``BANDS`` band buckets of that context, so ``candidates`` reads a few buckets instead of
scanning.  Stores raise only ``StoreError``; the tiers (``ResponseCache``) turn that into a
miss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.cache.entry import CachedResponse

MAX_BUCKET_SCAN = 64
"""A lookup reads at most this many members of one SimHash bucket.  Buckets stay small
because the context key partitions them by the guard's signature; over long shared text,
though, near-identical fingerprints could still fill one bucket, and a lookup must not
slow down with the number of entries.  Past the cap, some near-duplicates are missed
(never a wrong hit)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """A near-duplicate candidate: its key and Hamming distance; ``entry`` when the store
    already holds it in memory (otherwise ``get(key)`` fetches it)."""

    key: str
    distance: int
    entry: CachedResponse | None = None


@dataclass(frozen=True, slots=True)
class StoreStats:
    """What a store can say about itself; None where it cannot know cheaply."""

    entries: int | None
    bytes: int | None
    errors: int = 0
    evictions: int = 0
    available: bool = True


class CacheStore(Protocol):
    """Where cached answers live (memory or Redis)."""

    async def get(self, key: str) -> CachedResponse | None:
        """The live entry under ``key``, or None."""
        ...

    async def set(self, key: str, entry: CachedResponse, ttl_s: float) -> None:
        """Store ``entry`` for ``ttl_s`` seconds and index it for near-duplicate lookups
        when it has a context and fingerprint."""
        ...

    async def get_many(self, keys: Sequence[str]) -> list[CachedResponse | None]:
        """``get`` for several keys in one round trip, in order."""
        ...

    async def set_many(self, items: Sequence[tuple[str, CachedResponse]], ttl_s: float) -> None:
        """``set`` for several entries in one round trip."""
        ...

    async def delete(self, key: str) -> None: ...

    async def candidates(
        self, context: str, fingerprint: int, max_distance: int
    ) -> tuple[Candidate, ...]:
        """Entries of ``context`` within ``max_distance`` of ``fingerprint``, nearest first."""
        ...

    async def purge(
        self,
        *,
        backend: str | None = None,
        model_version: str | None = None,
        scope: str | None = None,
    ) -> int:
        """Delete entries matching every given filter (all entries when none is given);
        the number deleted."""
        ...

    def stats(self) -> StoreStats: ...

    async def close(self) -> None: ...
