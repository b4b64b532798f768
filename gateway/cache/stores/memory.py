"""The in-process store: LRU bounded by bytes, TTL read from an injected clock.

Entries are kept serialised (``entry.dumps``) next to a tuple of plain metadata.  Bytes,
strings, ints and tuples of them are invisible to Python's cyclic GC, so 100k entries add
almost nothing to a full collection: keeping ``CachedResponse`` objects instead put
multi-millisecond GC pauses into the lookup tail.  A hit pays one ``loads`` (microseconds).

No background task: expired entries are dropped when touched, when the LRU evicts them, or
by ``sweep()``.  An entry's bytes are its serialised size plus ``ENTRY_OVERHEAD_BYTES`` for
the dict slots, metadata and index (measured: bench/bench_cache_lookup.py), so
``max_bytes`` bounds the real footprint approximately.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import islice
from typing import Final

from gateway.cache.entry import CachedResponse, dumps, loads
from gateway.cache.simhash import BAND_BITS, bands
from gateway.cache.stores.base import MAX_BUCKET_SCAN, Candidate, StoreStats
from gateway.clock import SYSTEM_CLOCK, Clock

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
ENTRY_OVERHEAD_BYTES = 1200


_Meta = tuple[float, int, str, str, str, str | None, int | None]
"""An entry's metadata as an exact tuple (read by the indices below), never a NamedTuple:
CPython stops tracking only exact tuples of untracked items, so 100k NamedTuples were 100k
objects in every full collection (46 ms of GC pause here), 100k tuples are none."""
EXPIRES_AT: Final = 0
SIZE: Final = 1
BACKEND: Final = 2
VERSION: Final = 3
SCOPE: Final = 4
CONTEXT: Final = 5
FINGERPRINT: Final = 6


class MemoryStore:
    """A ``CacheStore`` in this process's memory."""

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES, clock: Clock = SYSTEM_CLOCK) -> None:
        self.max_bytes = max_bytes
        self._clock = clock
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._meta: dict[str, _Meta] = {}
        # context -> (band index << 16 | band value) -> one key, or {key: fingerprint} when
        # shared: most buckets hold a single key, and a bare str saves an object per band.
        # Shared buckets keep the fingerprints so that a lookup scanning them reads no
        # metadata until a member is within the distance.
        self._index: dict[str, dict[int, str | dict[str, int | None]]] = {}
        self._buckets = 0
        self._bytes = 0
        self.evictions = 0

    async def get(self, key: str) -> CachedResponse | None:
        if not self._live(key):
            return None
        self._data.move_to_end(key)
        return loads(self._data[key])

    async def get_many(self, keys: Sequence[str]) -> list[CachedResponse | None]:
        return [await self.get(key) for key in keys]

    async def set(self, key: str, entry: CachedResponse, ttl_s: float) -> None:
        data = dumps(entry)
        size = len(data) + ENTRY_OVERHEAD_BYTES
        self._remove(key)
        if size > self.max_bytes or ttl_s <= 0:
            return
        self._data[key] = data
        self._meta[key] = (
            self._clock.now() + ttl_s,
            size,
            entry.backend,
            entry.model_version,
            entry.scope,
            entry.context,
            entry.fingerprint,
        )
        self._bytes += size
        if entry.context is not None and entry.fingerprint is not None:
            self._file(key, entry.context, entry.fingerprint)
        while self._bytes > self.max_bytes:
            self._remove(next(iter(self._data)))
            self.evictions += 1

    async def set_many(self, items: Sequence[tuple[str, CachedResponse]], ttl_s: float) -> None:
        for key, entry in items:
            await self.set(key, entry, ttl_s)

    async def delete(self, key: str) -> None:
        self._remove(key)

    async def candidates(
        self, context: str, fingerprint: int, max_distance: int
    ) -> tuple[Candidate, ...]:
        buckets = self._index.get(context)
        if buckets is None:
            return ()
        # The hot loop of a near-duplicate lookup: a bucket may hold dozens of keys, so the
        # distance is checked before expiry, the clock read once, removals deferred.
        now = self._clock.now()
        meta_of = self._meta.get
        found: dict[str, int] = {}
        expired: list[str] = []
        for slot_id in _slot_ids(fingerprint):
            members = buckets.get(slot_id)
            if members is None:
                continue
            scan: Iterable[tuple[str, int | None]]
            if isinstance(members, str):
                single = meta_of(members)
                scan = ((members, single[FINGERPRINT] if single is not None else None),)
            elif len(members) <= MAX_BUCKET_SCAN:
                scan = members.items()
            else:  # the newest members, which an older overflow must not hide
                scan = islice(reversed(members.items()), MAX_BUCKET_SCAN)
            for key, filed in scan:
                if filed is None:
                    continue
                distance = (fingerprint ^ filed).bit_count()
                if distance > max_distance or key in found:
                    continue
                meta = meta_of(key)
                if meta is None:
                    continue
                if meta[EXPIRES_AT] <= now:
                    expired.append(key)
                else:
                    found[key] = distance
        for key in expired:
            self._remove(key)
        return tuple(Candidate(k, d) for k, d in sorted(found.items(), key=lambda kv: kv[1]))

    async def purge(
        self,
        *,
        backend: str | None = None,
        model_version: str | None = None,
        scope: str | None = None,
    ) -> int:
        doomed = [
            key
            for key, meta in self._meta.items()
            if (backend is None or meta[BACKEND] == backend)
            and (model_version is None or meta[VERSION] == model_version)
            and (scope is None or meta[SCOPE] == scope)
        ]
        for key in doomed:
            self._remove(key)
        return len(doomed)

    def sweep(self) -> int:
        """Drop every expired entry now; the number dropped."""
        now = self._clock.now()
        doomed = [key for key, meta in self._meta.items() if meta[EXPIRES_AT] <= now]
        for key in doomed:
            self._remove(key)
        return len(doomed)

    def stats(self) -> StoreStats:
        return StoreStats(len(self._data), self._bytes, evictions=self.evictions)

    async def close(self) -> None:
        self._data.clear()
        self._meta.clear()
        self._index.clear()
        self._buckets = 0
        self._bytes = 0

    def _live(self, key: str) -> bool:
        meta = self._meta.get(key)
        if meta is None:
            return False
        if meta[EXPIRES_AT] <= self._clock.now():
            self._remove(key)
            return False
        return True

    def _remove(self, key: str) -> None:
        meta = self._meta.pop(key, None)
        if meta is None:
            return
        del self._data[key]
        self._bytes -= meta[SIZE]
        if meta[CONTEXT] is not None and meta[FINGERPRINT] is not None:
            self._unfile(key, meta[CONTEXT], meta[FINGERPRINT])

    def _file(self, key: str, context: str, fingerprint: int) -> None:
        buckets = self._index.setdefault(context, {})
        for slot_id in _slot_ids(fingerprint):
            members = buckets.get(slot_id)
            if members is None:
                buckets[slot_id] = key
                self._buckets += 1
            elif isinstance(members, str):
                if members != key:
                    buckets[slot_id] = {members: self._meta[members][FINGERPRINT], key: fingerprint}
            else:
                members[key] = fingerprint

    def _unfile(self, key: str, context: str, fingerprint: int) -> None:
        buckets = self._index.get(context)
        if buckets is None:
            return
        for slot_id in _slot_ids(fingerprint):
            members = buckets.get(slot_id)
            if members == key:
                del buckets[slot_id]
                self._buckets -= 1
            elif isinstance(members, dict):
                members.pop(key, None)
                if len(members) == 1:
                    buckets[slot_id] = next(iter(members))
        if not buckets:
            del self._index[context]

    def __repr__(self) -> str:
        return (
            f"<MemoryStore entries={len(self._data)} bytes={self._bytes}/{self.max_bytes} "
            f"buckets={self._buckets} evictions={self.evictions}>"
        )


def _slot_ids(fingerprint: int) -> list[int]:
    return [i << BAND_BITS | value for i, value in enumerate(bands(fingerprint))]
