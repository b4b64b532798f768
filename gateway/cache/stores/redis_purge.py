"""Purging the Redis store: the entries matching filters, or everything under the prefix.

A filtered purge reads the purge-index sets (``i:b:<backend>``, ``i:m:<model_version>``,
``i:s:<scope>``) and intersects them.  It first deletes those entries' records from every
route's embedding index stream (named in the set ``vs``; format in ``cache/vector_stream``):
``XRANGE`` through each in batches, ``XDEL`` the matches, so no vector of a purged tenant's
prompt stays readable in Redis.  Then it deletes the entries, settles the shared counts at
once, and drops the keys from the purge-index sets last: a purge that fails part way leaves
the sets naming what is left to do, and the operator's retry finishes it.  A vector a tier
publishes while the purge runs, for an entry it stored just before, can land after the
stream was read: it points at nothing (a stale miss) and goes when the stream is trimmed.
A purge of everything deletes every key of the cache's layout under the prefix (``SCAN``
of each of its sub-prefixes, streams and counts included), and nothing else there: the
shared rate limits (``rl:``) and the rate history (``rate:``) live under the same prefix.

An operator asked and waits for the answer, so a purge runs without the per-request budget
(the store's ``_run`` with ``bounded=False``); every command is single-key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from gateway.cache import vector_stream
from gateway.cache.stores.redis_counts import RedisCounts

PURGE_BATCH = 500
"""Keys deleted, set members removed or stream records read per round trip."""
CACHE_PATTERNS = ("e:*", "b:*", "i:*", "v:*")
"""The cache's keys under its prefix (entries, SimHash buckets, purge indexes, streams)..."""
CACHE_KEYS = ("n", "sz", "bytes", "vs")
"""...and its single keys (the shared counts, the streams' names): see ``stores/redis``."""


class RedisPurge:
    """The store's purges, over its client, prefix, counts and entry key naming."""

    def __init__(
        self, client: Any, prefix: str, counts: RedisCounts, entry: Callable[[str], str]
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._counts = counts
        self._entry = entry

    async def matching(self, indexes: Sequence[str]) -> int:
        """Delete the entries in every one of the purge-index sets ``indexes``; how many."""
        keys: set[bytes] | None = None
        for index in indexes:
            members = set(await self._client.smembers(index))
            keys = members if keys is None else keys & members
        doomed = sorted(keys or ())
        if doomed:
            await self._prune_vectors(frozenset(doomed))
        deleted = await self._delete_many(self._entry(k.decode()) for k in doomed)
        for start in range(0, len(doomed), PURGE_BATCH):
            await self._counts.forget(doomed[start : start + PURGE_BATCH])
        self._counts.due()
        for index in indexes:
            if len(indexes) == 1:
                await self._client.delete(index)
            else:
                for start in range(0, len(doomed), PURGE_BATCH):
                    await self._client.srem(index, *doomed[start : start + PURGE_BATCH])
        return deleted

    async def everything(self) -> int:
        """Delete every key of the cache under the prefix; how many of them were entries."""
        prefix = _glob_escape(self._prefix)
        batch: list[bytes | str] = [self._prefix + key for key in CACHE_KEYS]
        deleted = 0
        for pattern in CACHE_PATTERNS:
            async for name in self._client.scan_iter(match=prefix + pattern, count=PURGE_BATCH):
                batch.append(name)
                if len(batch) >= PURGE_BATCH:
                    deleted += await self._delete_many(batch, count_entries=True)
                    batch = []
        deleted += await self._delete_many(batch, count_entries=True)
        self._counts.cleared()
        return deleted

    async def _prune_vectors(self, doomed: frozenset[bytes]) -> None:
        """Delete the embedding index streams' records of the ``doomed`` entry keys (every
        route's stream, read through in batches)."""
        for name in await self._client.smembers(self._prefix + vector_stream.STREAMS):
            start = b"-"
            while True:
                records = await self._client.xrange(name, start, "+", count=PURGE_BATCH)
                ids = [i for i, f in records if vector_stream.entry_key(f) in doomed]
                if ids:
                    await self._client.xdel(name, *ids)
                if len(records) < PURGE_BATCH:
                    break
                start = b"(" + _as_bytes(records[-1][0])

    async def _delete_many(self, names: Iterable[bytes | str], count_entries: bool = False) -> int:
        names = list(names)
        if not names:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for name in names:
            pipe.delete(name)
        results = await pipe.execute()
        entry_prefix = self._entry("").encode()
        return sum(
            int(r)
            for name, r in zip(names, results, strict=True)
            if not count_entries or _as_bytes(name).startswith(entry_prefix)
        )


def _glob_escape(text: str) -> str:
    """``text`` matched literally by a SCAN ``MATCH`` pattern (a prefix may hold ``*``)."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _as_bytes(name: bytes | str) -> bytes:
    return name if isinstance(name, bytes) else name.encode()
