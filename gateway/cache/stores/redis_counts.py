"""How many entries the Redis store holds, and how many bytes: counts every replica shares.

Three single-key structures under the store's prefix, besides the entries themselves:

* ``n``: a sorted set of entry keys scored by expiry time (wall clock, ms since the epoch);
* ``sz``: a hash of entry key -> serialised size;
* ``bytes``: the sum of those sizes, a counter.

A write adds to all three in the write's own pipeline (``HMGET`` of the old sizes, ``HSET``,
``ZADD``, ``INCRBY``): no extra round trip.  The old size of a rewritten key is owed to the
counter and subtracted in the next write's pipeline or refresh, whichever comes first.

Whoever removes a key from ``n`` owns its size: it reads the size, deletes the field and
owes the size; nobody else touches that field.  Entries expire in Redis on their own, and
their members are swept here: ``stats()`` answers at once with the counts of the last
refresh and, when those are older than ``refresh_s``, starts a background refresh that
counts the expired members (``ZCOUNT``), takes them in batches with ``ZPOPMIN`` (atomic, so
replicas sweeping at once never take one member twice; an unexpired member taken because
another replica got the expired ones first is put back with ``ZADD NX``), forgets their
sizes, then reads the unexpired count and the counter.  A purge takes its keys with
``ZREM``, one per key.  A failed refresh keeps the last counts.

A sweep's sizes are subtracted at the end of its refresh, so another replica reading
meanwhile still counts them, until its next refresh; a purge subtracts at once.  Otherwise
the counts are exact while nothing races, and drift only a little when something does: two
replicas rewriting one key at the same instant may both count it, a key re-stored in the
moment it is being swept or purged may go on counting its old size, and a pipeline cut
short by the budget may leave its batch half counted.  Entries Redis evicts under
``maxmemory`` stay counted until they would have expired (an overestimate bounded by the
TTL); a flush or a purge of everything deletes the counts with the entries.  The three keys
carry no TTL, so a ``volatile-*`` eviction policy never takes them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol, TypeVar

from gateway.clock import Clock
from gateway.errors import StoreError

DEFAULT_REFRESH_S = 10.0
SWEEP_BATCH = 100
"""Members taken per round trip: parsing a batch's answers holds the event loop (about
2 ms per 100 with redis-py's Python parser)."""
SWEEP_ROUNDS = 100
"""Batches per refresh: 10,000 expiries per replica per ``refresh_s``; replicas sweeping at
once share the work."""
ENTRY_OVERHEAD_BYTES = 2400
"""Redis's memory per entry beyond its serialised size (its key, three purge-index set
members, four band-bucket members, its counting members; ``bench/bench_cache.py``), so the
byte gauge approximates the footprint in Redis as the memory store's does in memory."""

T = TypeVar("T")


class Runner(Protocol):
    """``RedisStore._run``: a Redis call under the budget, errors as ``StoreError``."""

    def __call__(
        self, op: str, fn: Callable[[], Awaitable[T]], bounded: bool = ..., entries: int = ...
    ) -> Awaitable[T]: ...


class RedisCounts:
    """The shared entry and byte counts of one ``RedisStore`` prefix."""

    def __init__(
        self, client: Any, prefix: str, run: Runner, clock: Clock, refresh_s: float
    ) -> None:
        self._client = client
        self._run = run
        self._clock = clock
        self.refresh_s = refresh_s
        self.members = prefix + "n"
        self.sizes = prefix + "sz"
        self.total = prefix + "bytes"
        self.entries: int | None = None
        self.bytes: int | None = None
        self.owed = 0
        """Bytes of rewritten or forgotten entries not yet subtracted from the counter."""
        self._refreshed_at: float | None = None
        self._refresh: asyncio.Task[None] | None = None

    def queue_write(self, pipe: Any, sizes: Mapping[str, int], ttl_ms: int) -> int:
        """Queue the counting of a write at the end of ``pipe``; how many commands, whose
        results go to ``written``."""
        expires_ms = self._now_ms() + ttl_ms
        pipe.hmget(self.sizes, list(sizes))
        pipe.hset(self.sizes, mapping=dict(sizes))
        pipe.zadd(self.members, dict.fromkeys(sizes, expires_ms))
        pipe.incrby(self.total, sum(sizes.values()))
        return 4 + self._queue_owed(pipe)

    def written(self, results: list[Any]) -> None:
        """Owe the old sizes of rewritten keys (the first of ``queue_write``'s results)."""
        self.owed += sum(int(old) for old in results[0] if old is not None)

    async def forget(self, keys: Sequence[str | bytes]) -> None:
        """Drop deleted entries' keys from the counts and subtract their sizes now (two round
        trips; redis errors)."""
        if not keys:
            return
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.zrem(self.members, key)
        pipe.hmget(self.sizes, list(keys))
        *removed, sizes = await pipe.execute()
        owned = [(k, s) for k, s, r in zip(keys, sizes, removed, strict=True) if r]
        if owned:
            self.owed += sum(int(size) for _, size in owned if size is not None)
            pipe = self._client.pipeline(transaction=False)
            pipe.hdel(self.sizes, *(key for key, _ in owned))
            self._queue_owed(pipe)
            await pipe.execute()

    def due(self) -> None:
        """Refresh on the next look (after a purge)."""
        self._refreshed_at = None

    def cleared(self) -> None:
        """Everything under the prefix was deleted, the counter too: owe nothing."""
        self.owed = 0
        self.due()

    def poll(self) -> None:
        """Start a background refresh when the counts are stale and none is running."""
        if self._refresh is not None:
            return
        now = self._clock.now()
        if self._refreshed_at is not None and now - self._refreshed_at < self.refresh_s:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._refresh = loop.create_task(self._background())

    async def refresh(self) -> None:
        """Sweep expired members, settle what is owed, read the counts; ``StoreError``."""
        self._refreshed_at = self._clock.now()
        now_ms = self._now_ms()
        expired: int = await self._run(
            "count", lambda: self._client.zcount(self.members, "-inf", now_ms)
        )
        for _ in range(SWEEP_ROUNDS):
            if not expired:
                break
            batch = min(expired, SWEEP_BATCH)
            popped = await self._run(
                "count", partial(self._client.zpopmin, self.members, batch), entries=batch
            )
            expired = await self._run("count", partial(self._settle, popped, now_ms), entries=batch)

        async def read() -> tuple[int, int]:
            pipe = self._client.pipeline(transaction=False)
            self._queue_owed(pipe)
            pipe.zcount(self.members, f"({now_ms}", "+inf")
            pipe.get(self.total)
            *_, entries, total = await pipe.execute()
            return int(entries), int(total or 0)

        entries, total = await self._run("count", read)
        self.entries = entries
        self.bytes = max(0, total) + entries * ENTRY_OVERHEAD_BYTES if entries else 0

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
            await asyncio.gather(self._refresh, return_exceptions=True)
            self._refresh = None

    async def _settle(self, popped: list[tuple[bytes, float]], now_ms: int) -> int:
        """Forget the expired members just popped and put back any that had not expired;
        how many expired members are left."""
        expired = [key for key, expires_ms in popped if expires_ms <= now_ms]
        live = {key: expires_ms for key, expires_ms in popped if expires_ms > now_ms}
        pipe = self._client.pipeline(transaction=False)
        if live:
            pipe.zadd(self.members, live, nx=True)  # a re-store's newer score wins
        if expired:
            pipe.hmget(self.sizes, expired)
            pipe.hdel(self.sizes, *expired)
        pipe.zcount(self.members, "-inf", now_ms)
        *results, left = await pipe.execute()
        if expired:
            self.owed += sum(int(size) for size in results[-2] if size is not None)
        return int(left)

    async def _background(self) -> None:
        try:
            await self.refresh()
        except StoreError:  # counted by the store; the last counts stay
            self.due()  # and the next look tries again, not refresh_s later
        finally:
            self._refresh = None

    def _queue_owed(self, pipe: Any) -> int:
        # Taken before the pipeline runs and not given back if it fails: a pipeline cut
        # short may or may not have applied it, and dropping it errs towards an overestimate.
        owed, self.owed = self.owed, 0
        if not owed:
            return 0
        pipe.decrby(self.total, owed)
        return 1

    def _now_ms(self) -> int:
        return int(self._clock.wall() * 1000)

    def __repr__(self) -> str:
        return f"<RedisCounts entries={self.entries} bytes={self.bytes} owed={self.owed}>"
