"""``SharedIndex``: a route's embedding index shared by every replica through Redis.

With the Redis store the entries are shared, but each replica's ``VectorIndex`` is in its
own process.  So every tier over a ``RedisStore`` appends each vector it indexes to one
stream per route, ``<prefix>v:<route>``, and indexes the other replicas' from it: a replica
finds paraphrases of answers any replica stored, as it finds their exact and SimHash matches.

A stream entry (its format in ``cache/vector_stream.py``) holds its origin (random per
tier instance, so a tier skips what it published itself), the embedder's identity (a tier
ignores other embedders' vectors; one of other dimensions is refused by ``apply``), the
context key, the entry key and the unit vector as float16, in one field: parsing is most of
a catch-up's time, and it is paid per field (about 10 us a field with redis-py's own
parser; less with hiredis, a dependency).  With MiniLM (384 dims, 768 B) an entry takes
about 1 kB in Redis; the stream is trimmed to about ``max_entries`` (``XADD MAXLEN ~``,
plus up to one stream node, 100 entries by default), the bound of each replica's index, so
about 100 MB at the default 100k.

Catch-up runs without a long-lived task.  ``sync()`` (each lookup) starts a reader task if
none runs, or asks the running one for one more pass, and waits, at most ``wait_s``, for a
pass begun after the call to have read the stream to its end: ``READ_COUNT`` entries after
the last id seen (``XRANGE (<id> + COUNT``, an XREAD without BLOCK), repeated while reads
come back full, at most ``MAX_ROUNDS`` a pass.  Caught up, that is one round trip (0.15-0.25
ms on loopback), so an entry another replica stored is found by the next lookup after that
replica's response has finished (the cache's visibility rule).  A read that comes back full
means a backlog (a cold replica starts from the beginning of the stream, a warm index; or
one that had no lookups for a while): lookups stop waiting, and do not wait until it has
been read.  Publishing and reading run under the store's time budget and down-circuit; a
failure is counted and ignored: the tier goes on with its local index and reads on from
where it stopped once Redis answers.

A purge of everything deletes the stream (it is under the prefix).  Stream ids are Redis's
clock in milliseconds, so a stream created afresh normally continues above the last id
seen; but where Redis's clock is behind (a failover, a restored server) it would not, and
reading on from the last id seen would skip its entries for good.  So a pass that caught up
asks, at most every ``RECHECK_S``, for the stream's last generated id: when the stream is
gone or ends below the last id seen, reading starts again from the beginning.  A publish
whose new id is below the last id seen says the same at once.  Re-reading is harmless: an
entry indexed again replaces itself.

A filtered purge deletes the purged entries' records from the stream too (``XDEL``, in the
store); replicas that indexed them already drop each pointer when a lookup finds its entry
gone.  ``XDEL`` does not lower the stream's last generated id, which the recheck reads, so
deleting the newest records is not taken for a restart.  The index is only ever a list of
candidates: the tier fetches each from the store and re-checks scope, context and
``verify``, so a shared index cannot produce a cross-tenant or unverified hit.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections import Counter
from collections.abc import Callable

import numpy as np

from gateway.cache import vector_stream
from gateway.cache.stores.redis import RedisStore, StreamEntry
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError, StoreTimeout

log = logging.getLogger("gateway.cache")

READ_COUNT = 200
"""Entries per read.  Reading and indexing them holds the event loop for about 6 ms
(measured on 2 cores: 30 us an entry with hiredis, 60 with redis-py's own parser), so a
cold replica's catch-up delays its requests by at most about that much at a time."""
MAX_ROUNDS = 500
"""Reads per pass: a cold replica indexes up to 100k entries in one pass, then the next
lookup starts the next pass."""
RECHECK_S = 1.0
START = b"0-0"

Apply = Callable[[str, str, np.ndarray], bool]
"""Index a foreign vector: (context, entry key, unit vector) -> whether it was taken."""


class SharedIndex:
    """One route's stream of index entries: ``publish`` what this tier indexes, ``sync``
    what the others did into ``apply``."""

    def __init__(
        self,
        store: RedisStore,
        route: str,
        embedder: str,
        apply: Apply,
        *,
        max_entries: int,
        clock: Clock = SYSTEM_CLOCK,
        wait_s: float | None = None,
    ) -> None:
        self.store = store
        self.stream = vector_stream.STREAM + route
        self.embedder = embedder
        self.max_entries = max_entries
        self.wait_s = store.budget_s if wait_s is None else wait_s
        self.max_rounds = MAX_ROUNDS
        self.origin = secrets.token_hex(8)
        self.counts: Counter[str] = Counter()
        self._apply = apply
        self._clock = clock
        self._origin = self.origin.encode()
        self._embedder = vector_stream.clean(embedder.encode())
        self._last = START
        self._backlog = False
        self._recheck_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._pending: asyncio.Future[None] | None = None

    @property
    def last_id(self) -> str:
        return self._last.decode()

    @property
    def reading(self) -> bool:
        """Whether a reader task is running."""
        return self._task is not None

    async def publish(self, context: str, entry_key: str, vector: np.ndarray) -> None:
        """Append an entry for ``vector`` (unit length) filed under ``entry_key`` in
        ``context``; a failure is counted, never raised."""
        keys = (context.encode(), entry_key.encode())
        if not all(map(vector_stream.packable, keys)):
            self.counts["unpublishable"] += 1
            return
        data = vector_stream.pack(
            self._origin, self._embedder, *keys, vector.astype("<f2").tobytes()
        )
        try:
            new_id = await self.store.stream_add(
                self.stream, {vector_stream.FIELD: data}, self.max_entries
            )
        except StoreTimeout as exc:  # past its budget: the command runs on, and may land
            self._failed("publish_timeout", exc)
            return
        except StoreError as exc:
            self._failed("publish_error", exc)
            return
        self.counts["published"] += 1
        if _order(new_id) <= _order(self._last):
            self._restart("the stream restarted below the last id read")

    async def sync(self) -> None:
        """Index what the other replicas published since the last read, waiting for a read
        begun now to reach the end of the stream: at most ``wait_s``, and not at all while
        a backlog is being read.  Never raises."""
        if self._pending is None:
            self._pending = asyncio.get_running_loop().create_future()
        pending = self._pending
        if self._task is None:
            self._task = asyncio.create_task(self._passes())
        if not self._backlog:
            await asyncio.wait((pending,), timeout=self.wait_s)

    async def aclose(self) -> None:
        """Stop a pass in progress."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pending is not None and not self._pending.done():
            self._pending.set_result(None)
        self._pending = None

    async def _passes(self) -> None:
        try:
            while self._pending is not None:
                done, self._pending = self._pending, None
                caught_up = False
                try:
                    caught_up = await self._read(done)
                except StoreError as exc:
                    self._failed("read_error", exc)
                except Exception:  # a background task: log it, never end the lookups
                    log.exception("embedding index stream %s: reading failed", self.stream)
                finally:
                    if not done.done():
                        done.set_result(None)
                if caught_up and self._clock.now() >= self._recheck_at:
                    await self._recheck()
        finally:
            self._task = None

    async def _read(self, done: asyncio.Future[None]) -> bool:
        """Read on from the last id seen; True once caught up.  A full read means a
        backlog: the lookups waiting for this pass stop waiting."""
        for _ in range(self.max_rounds):
            entries = await self.store.stream_read(self.stream, self._last, READ_COUNT)
            for entry in entries:
                self._take(entry)
            if entries:
                self._last = entries[-1][0]
            self._backlog = len(entries) >= READ_COUNT
            if not self._backlog:
                return True
            if not done.done():
                done.set_result(None)
        return False

    async def _recheck(self) -> None:
        self._recheck_at = self._clock.now() + RECHECK_S
        try:
            last = await self.store.stream_last(self.stream)
        except StoreError as exc:
            self._failed("read_error", exc)
            return
        if self._last == START:
            return
        if last is None:
            self._restart("the stream is gone")
        elif _order(last) < _order(self._last):
            self._restart("the stream restarted below the last id read")

    def _take(self, entry: StreamEntry) -> None:
        record = vector_stream.unpack(entry[1])
        if record is None:
            self.counts["malformed"] += 1
            return
        if record.origin == self._origin:
            self.counts["own"] += 1
            return
        if record.embedder != self._embedder:
            self.counts["other_embedder"] += 1
            return
        decoded = _decode(record.context, record.entry_key, record.vector)
        if decoded is None:
            self.counts["malformed"] += 1
        elif self._apply(*decoded):
            self.counts["indexed"] += 1
        else:
            self.counts["refused"] += 1

    def _restart(self, why: str) -> None:
        log.info("embedding index stream %s: %s; reading it from the start", self.stream, why)
        self.counts["restarts"] += 1
        self._last = START

    def _failed(self, what: str, exc: StoreError) -> None:
        self.counts[what] += 1
        level = logging.DEBUG if self.counts[what] > 1 else logging.WARNING
        log.log(level, "embedding index stream %s: %s: %s", self.stream, what, exc)

    def __repr__(self) -> str:
        counts = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        state = "reading" if self.reading else "idle"
        backlog = " backlog" if self._backlog else ""
        return (
            f"<SharedIndex {self.stream} {state}{backlog} last={self.last_id}"
            f"{' ' + counts if counts else ''}>"
        )


def _order(stream_id: bytes) -> tuple[int, int]:
    ms, _, seq = stream_id.partition(b"-")
    return int(ms), int(seq or 0)


def _decode(context: bytes, entry_key: bytes, raw: bytes) -> tuple[str, str, np.ndarray] | None:
    """(context, entry key, unit float32 vector); None if malformed."""
    if not raw or len(raw) % 2:
        return None
    try:
        text = context.decode(), entry_key.decode()
    except UnicodeDecodeError:
        return None
    vector = np.frombuffer(raw, dtype="<f2").astype(np.float32)
    norm = float(np.linalg.norm(vector))
    if not np.isfinite(norm) or norm == 0.0:
        return None
    return text[0], text[1], vector / norm
