"""The shared store: plain Redis 7 commands (no modules), on a standalone Redis, a Redis
Cluster or a Sentinel-managed master alike (the client and its health are the Redis
layer's, ``gateway/redis/``).

Layout under ``prefix`` (default ``gw:``).  Every command names one key, and every key a
command set uses together either shares a hash tag (one Cluster slot: one master, one round
trip) or goes as single-key calls that a Cluster pipeline sends to each master at once:

* ``e:<key>``: the serialised entry, ``SET .. PX ttl``; ``get_many`` and ``set_many`` send
  one ``GET``/``SET`` per entry;
* ``b:{<context>}:<band>:<value>``: a set of ``<fingerprint hex>:<key>``, one per SimHash
  band, expiring with the longest-lived entry filed in it (``EXPIRE NX`` then ``EXPIRE GT``);
  a context's buckets share its hash tag, so a near-duplicate lookup reads one master;
* ``i:b:<backend>``, ``i:m:<model_version>``, ``i:s:<scope>``: sets of keys for purging
  (``redis_purge``), each read whole and intersected here;
* ``n`` (keys by expiry time), ``sz`` (key -> serialised size) and ``bytes`` (their sum): the
  entry and byte counts every replica shares, without TTL (``redis_counts``);
* ``v:<route>``: a stream of the embedding tier's index entries, so that every replica's
  tier finds paraphrases of answers any replica stored (``embedding/shared.py``; the record
  format in ``cache/vector_stream.py``); a filtered purge deletes its entries' records there;
* ``vs``: the set of those streams' names, for that purge.

A purge of everything scans every master (``SCAN`` on each, the Cluster client's
``scan_iter``).  Index members may outlive their entries; a dangling member is a miss,
never a wrong hit.

Every operation runs under a time budget (default 50 ms, more for a batch of many
entries): past it the caller gets a miss (``StoreError``) and the command runs on, its
outcome counting for Redis's health (``RedisLink``).  While Redis is down, operations raise
``StoreError`` at once until the link's probe finds it back.  ``on_health(up)`` hears each
transition (``gateway_cache_store_up``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from redis.exceptions import ResponseError

from gateway.cache import vector_stream
from gateway.cache.entry import CachedResponse, dumps, loads
from gateway.cache.simhash import bands, hamming
from gateway.cache.stores.base import MAX_BUCKET_SCAN, Candidate, StoreStats
from gateway.cache.stores.redis_counts import DEFAULT_REFRESH_S, RedisCounts
from gateway.cache.stores.redis_purge import RedisPurge
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.policy.redis import Redis
from gateway.redis import Health, RedisLink
from gateway.redis.keys import tag
from gateway.redis.link import DEFAULT_RETRY_S

DEFAULT_PREFIX = "gw:"
DEFAULT_BUDGET_S = 0.05
ENTRIES_PER_BUDGET = 10
"""Entries written (or read) within one ``budget_s``; larger batches get proportionally more."""

T = TypeVar("T")
StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""A stream entry: its id and fields."""


class RedisStore:
    """A ``CacheStore`` in Redis, over the gateway's ``RedisLink`` (closed with the store
    only when ``owns_link``)."""

    def __init__(
        self,
        link: RedisLink,
        *,
        prefix: str = DEFAULT_PREFIX,
        budget_s: float = DEFAULT_BUDGET_S,
        count_refresh_s: float = DEFAULT_REFRESH_S,
        on_health: Callable[[bool], None] | None = None,
        owns_link: bool = False,
    ) -> None:
        self.link = link
        self._client = link.client
        self._prefix = prefix
        self.budget_s = budget_s
        self._owns_link = owns_link
        self._unsubscribe = link.subscribe(on_health) if on_health is not None else None
        self._counts = RedisCounts(self._client, prefix, self._run, link.clock, count_refresh_s)
        self._purge = RedisPurge(self._client, prefix, self._counts, self._entry)

    @classmethod
    def connect(
        cls,
        settings: Redis,
        *,
        clock: Clock = SYSTEM_CLOCK,
        retry_s: float = DEFAULT_RETRY_S,
        **options: Any,
    ) -> RedisStore:
        """A store on a link of its own to the Redis of ``settings`` (tests, benches)."""
        budget_s = options.get("budget_s", DEFAULT_BUDGET_S)
        link = RedisLink.patient(settings, budget_s, clock=clock, retry_s=retry_s)
        return cls(link, owns_link=True, **options)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """``connect`` to the standalone Redis at ``url``."""
        return cls.connect(Redis(url=url), **options)

    @property
    def health(self) -> Health:
        return self.link.health

    @property
    def errors(self) -> int:
        return self.link.errors

    @property
    def available(self) -> bool:
        return self.health.up

    async def get(self, key: str) -> CachedResponse | None:
        data = await self._run("get", lambda: self._client.get(self._entry(key)))
        if data is None:
            return None
        try:
            return loads(data)
        except ValueError:
            return None

    async def get_many(self, keys: Sequence[str]) -> list[CachedResponse | None]:
        async def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.get(self._entry(key))
            return list(await pipe.execute())

        out: list[CachedResponse | None] = []
        for data in await self._run("get_many", read, entries=len(keys)) if keys else []:
            try:
                out.append(None if data is None else loads(data))
            except ValueError:
                out.append(None)
        return out

    async def set(self, key: str, entry: CachedResponse, ttl_s: float) -> None:
        await self.set_many([(key, entry)], ttl_s)

    async def set_many(self, items: Sequence[tuple[str, CachedResponse]], ttl_s: float) -> None:
        ttl_ms = max(1, int(ttl_s * 1000))
        if not items or ttl_s <= 0:
            return
        payloads = [(key, entry, dumps(entry)) for key, entry in items]
        sizes = {key: len(data) for key, _, data in payloads}

        async def write() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, entry, data in payloads:
                pipe.set(self._entry(key), data, px=ttl_ms)
                for index in self._indexes(entry):
                    _add_expiring(pipe, index, key.encode(), ttl_ms)
                if entry.context is not None and entry.fingerprint is not None:
                    member = f"{entry.fingerprint:016x}:{key}".encode()
                    for bucket in self._buckets(entry.context, entry.fingerprint):
                        _add_expiring(pipe, bucket, member, ttl_ms)
            counting = self._counts.queue_write(pipe, sizes, ttl_ms)
            self._counts.written((await pipe.execute())[-counting:])

        await self._run("set", write, entries=len(payloads))

    async def delete(self, key: str) -> None:
        async def delete() -> None:
            await self._client.delete(self._entry(key))
            await self._counts.forget([key])

        await self._run("delete", delete)

    async def candidates(
        self, context: str, fingerprint: int, max_distance: int
    ) -> tuple[Candidate, ...]:
        async def read() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for bucket in self._buckets(context, fingerprint):
                pipe.srandmember(bucket, MAX_BUCKET_SCAN)
            return list(await pipe.execute())

        found: dict[str, int] = {}
        for members in await self._run("candidates", read):
            for member in members:
                fp_hex, _, key = member.decode().partition(":")
                distance = hamming(fingerprint, int(fp_hex, 16))
                if distance <= max_distance:
                    found[key] = distance
        return tuple(Candidate(k, d) for k, d in sorted(found.items(), key=lambda kv: kv[1]))

    async def purge(
        self,
        *,
        backend: str | None = None,
        model_version: str | None = None,
        scope: str | None = None,
    ) -> int:
        if backend is None and model_version is None and scope is None:
            return await self._run("purge", self._purge.everything, bounded=False)
        indexes = [
            self._key("i", kind, value)
            for kind, value in (("b", backend), ("m", model_version), ("s", scope))
            if value is not None
        ]
        return await self._run("purge", partial(self._purge.matching, indexes), bounded=False)

    async def stream_add(self, stream: str, fields: Mapping[bytes, bytes], max_len: int) -> bytes:
        """Append ``fields`` to the stream ``<prefix><stream>`` (XADD), trimmed to about
        ``max_len`` entries (``MAXLEN ~``, whole nodes at a time), and file its name in the
        set of streams a filtered purge prunes (in the same round trip); the new entry's id."""
        name = self._prefix + stream

        async def add() -> bytes:
            pipe = self._client.pipeline(transaction=False)
            pipe.xadd(name, dict(fields), maxlen=max_len, approximate=True)
            pipe.sadd(self._prefix + vector_stream.STREAMS, name)
            new_id, _ = await pipe.execute()
            return _as_bytes(new_id)

        return await self._run("xadd", add)

    async def stream_read(self, stream: str, after: bytes, count: int) -> list[StreamEntry]:
        """Up to ``count`` entries of the stream after the id ``after``, oldest first; an
        empty list when there is nothing newer, or no stream.  ``XRANGE (after + COUNT``:
        XREAD without BLOCK, in a reply shaped alike in RESP2 and RESP3."""
        name = self._prefix + stream

        async def read() -> list[StreamEntry]:
            entries = await self._client.xrange(name, b"(" + after, "+", count=count)
            return [(_as_bytes(i), f) for i, f in entries]

        return await self._run("xrange", read, entries=count)

    async def stream_last(self, stream: str) -> bytes | None:
        """The last id the stream generated (``XINFO STREAM``), which ``XDEL`` of its newest
        entries does not lower; None when there is no stream."""
        name = self._prefix + stream

        async def last() -> bytes | None:
            try:
                info = await self._client.xinfo_stream(name)
            except ResponseError as exc:
                if "no such key" in str(exc).lower():
                    return None
                raise
            return _as_bytes(info["last-generated-id"])

        return await self._run("xinfo", last)

    async def ping(self) -> bool:
        """Probe Redis; marks it up on success."""
        return await self.link.ping()

    def stats(self) -> StoreStats:
        """The shared counts as of the last refresh (None before the first); starts a
        background refresh when they are older than ``count_refresh_s``."""
        self._counts.poll()
        return StoreStats(
            self._counts.entries, self._counts.bytes, errors=self.errors, available=self.available
        )

    async def refresh_counts(self) -> StoreStats:
        """Refresh the shared counts now (sweeping expired members); ``StoreError``."""
        await self._counts.refresh()
        return self.stats()

    async def close(self) -> None:
        await self._counts.close()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._owns_link:
            await self.link.aclose()

    def _run(
        self, op: str, fn: Callable[[], Awaitable[T]], bounded: bool = True, entries: int = 1
    ) -> Awaitable[T]:
        # The budget is per request's worth of work: a batch of many entries (a 100-input
        # embeddings call) gets it once per ENTRIES_PER_BUDGET of them.
        budget = self.budget_s * max(1.0, entries / ENTRIES_PER_BUDGET) if bounded else None
        return self.link.run(op, fn, budget)

    def _key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)

    def _entry(self, key: str) -> str:
        return self._key("e", key)

    def _indexes(self, entry: CachedResponse) -> list[str]:
        return [
            self._key("i", "b", entry.backend),
            self._key("i", "m", entry.model_version),
            self._key("i", "s", entry.scope),
        ]

    def _buckets(self, context: str, fingerprint: int) -> list[str]:
        context_tag = tag(context)
        return [
            self._key("b", context_tag, str(i), f"{v:04x}")
            for i, v in enumerate(bands(fingerprint))
        ]

    def __repr__(self) -> str:
        counts = self._counts
        return (
            f"<RedisStore prefix={self._prefix!r} {self.link!r} entries={counts.entries} "
            f"bytes={counts.bytes}>"
        )


def _add_expiring(pipe: Any, name: str, member: bytes, ttl_ms: int) -> None:
    pipe.sadd(name, member)
    pipe.pexpire(name, ttl_ms, nx=True)
    pipe.pexpire(name, ttl_ms, gt=True)


def _as_bytes(name: bytes | str) -> bytes:
    return name if isinstance(name, bytes) else name.encode()
