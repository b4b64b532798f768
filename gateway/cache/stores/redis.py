"""The shared store: plain Redis 7 commands, so Valkey, managed Redis and Cluster all work.

Layout under ``prefix`` (default ``gw:``), every command single-key (no cross-slot
operations, no hash tags needed, no modules, no Lua):

* ``e:<key>``: the serialised entry, ``SET .. PX ttl``;
* ``b:<context>:<band>:<value>``: a set of ``<fingerprint hex>:<key>``, one per SimHash
  band, expiring with the longest-lived entry filed in it (``EXPIRE NX`` then ``EXPIRE GT``);
* ``i:b:<backend>``, ``i:m:<model_version>``, ``i:s:<scope>``: sets of keys for purging
  (``redis_purge``);
* ``n`` (keys by expiry time), ``sz`` (key -> serialised size) and ``bytes`` (their sum): the
  entry and byte counts every replica shares, without TTL (``redis_counts``);
* ``v:<route>``: a stream of the embedding tier's index entries, so that every replica's
  tier finds paraphrases of answers any replica stored (``embedding/shared.py``; the record
  format in ``cache/vector_stream.py``); a filtered purge deletes its entries' records there;
* ``vs``: the set of those streams' names, for that purge.

Index members may outlive their entries; a dangling member is a miss, never a wrong hit.

Every operation runs under a time budget (default 50 ms): past it the caller gets a miss
(``StoreError``), but the command runs on, and its own outcome is the evidence of Redis's
health (``health.py``): down only after several connection failures or timeouts in a row, or
most commands of the last second failing that way, never for one late reply (on 2 shared
cores the event loop itself runs late).  Any redis or socket failure is translated once,
here, into ``StoreError``.  While Redis is down operations raise ``StoreError`` at once;
after ``retry_s`` the next operation starts one background PING, and when it answers, Redis
is up again.  ``on_health(up)`` hears each transition (``gateway_cache_store_up``).  A
command whose pooled connection has died (Redis restarted since it was opened) is tried
once more on a new connection first, so a restart that finished costs no request a miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.cache import vector_stream
from gateway.cache.entry import CachedResponse, dumps, loads
from gateway.cache.simhash import bands, hamming
from gateway.cache.stores.base import MAX_BUCKET_SCAN, Candidate, StoreStats
from gateway.cache.stores.health import Health
from gateway.cache.stores.redis_counts import DEFAULT_REFRESH_S, RedisCounts
from gateway.cache.stores.redis_purge import RedisPurge
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError

DEFAULT_PREFIX = "gw:"
DEFAULT_BUDGET_S = 0.05
ENTRIES_PER_BUDGET = 10
"""Entries written (or read) within one ``budget_s``; larger batches get proportionally more."""
DEFAULT_RETRY_S = 2.0
CONNECTION_RETRIES = 1

T = TypeVar("T")
StreamEntry = tuple[bytes, dict[bytes, bytes]]
"""A stream entry: its id and fields."""
_DOWN_ERRORS = (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError)


class RedisStore:
    """A ``CacheStore`` in Redis; takes a ready ``redis.asyncio`` client (or Cluster)."""

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        budget_s: float = DEFAULT_BUDGET_S,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Clock = SYSTEM_CLOCK,
        count_refresh_s: float = DEFAULT_REFRESH_S,
        on_health: Callable[[bool], None] | None = None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self.budget_s = budget_s
        self.retry_s = retry_s
        self._clock = clock
        self.health = Health(clock, on_health)
        self._retry_at = 0.0
        self._probe: asyncio.Task[bool] | None = None
        self._late: set[asyncio.Future[Any]] = set()
        self.errors = 0
        self._counts = RedisCounts(client, prefix, self._run, clock, count_refresh_s)
        self._purge = RedisPurge(client, prefix, self._counts, self._entry)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """A store on a new client for ``url`` with socket timeouts bounded by the budget
        and one immediate retry of a command whose connection failed, on a new connection:
        after a Redis restart every pooled connection is dead, and each would otherwise
        fail one request and mark Redis down for ``retry_s``.  The budget bounds both
        tries; the circuit decides the rest.  Only connection errors are retried, never a
        timeout: a command that timed out may have run, and running the counts' ``ZREM``
        or ``DECRBY`` twice would skew them for good."""
        budget_s = options.get("budget_s", DEFAULT_BUDGET_S)
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=max(budget_s * 4, 0.2),
            socket_connect_timeout=max(budget_s * 4, 0.2),
            retry=Retry(NoBackoff(), CONNECTION_RETRIES, supported_errors=(RedisConnectionError,)),
        )
        return cls(client, **options)

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
        """Probe Redis within the budget; marks it up on success."""
        try:
            async with asyncio.timeout(self.budget_s * 4):
                await self._client.ping()
        except (RedisError, *_DOWN_ERRORS):
            if self.health.up:
                self._failed()
            else:
                self._retry_at = self._clock.now() + self.retry_s
            return False
        self.health.recovered()
        return True

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
        for late in list(self._late):
            late.cancel()
        await self._counts.close()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None
        await self._client.aclose()

    async def _run(
        self, op: str, fn: Callable[[], Awaitable[T]], bounded: bool = True, entries: int = 1
    ) -> T:
        if not self.health.up:
            if self._clock.now() >= self._retry_at and self._probe is None:
                self._probe = asyncio.create_task(self._background_probe())
            raise StoreError(f"redis {op}: unavailable, retrying in the background")
        command = asyncio.ensure_future(fn())
        try:
            if bounded:
                # The budget is per request's worth of work: a batch of many entries (a
                # 100-input embeddings call) gets it once per ENTRIES_PER_BUDGET of them.
                budget = self.budget_s * max(1.0, entries / ENTRIES_PER_BUDGET)
                done, _ = await asyncio.wait((command,), timeout=budget)
                if not done:
                    self._judge_later(command)
                    raise StoreError(
                        f"redis {op}: over its {budget * 1000:.0f} ms budget (a miss; the "
                        "command runs on and its outcome is what counts)"
                    )
            result = await command
        except asyncio.CancelledError:
            self._judge_later(command)  # the caller left; the command's outcome still counts
            raise
        except (RedisError, *_DOWN_ERRORS) as exc:
            self._judge(exc)
            raise StoreError(f"redis {op}: {type(exc).__name__}: {exc}") from exc
        self.health.succeeded()
        return result

    def _judge_later(self, command: asyncio.Future[Any]) -> None:
        self._late.add(command)

        def judged(done: asyncio.Future[Any]) -> None:
            self._late.discard(done)
            if done.cancelled():
                return
            exc = done.exception()
            if exc is None:
                self.health.succeeded()
            elif isinstance(exc, (RedisError, *_DOWN_ERRORS)):
                self._judge(exc)

        command.add_done_callback(judged)

    def _judge(self, exc: BaseException) -> None:
        """One command's failure: Redis answered (up) or could not be reached (evidence)."""
        self.errors += 1
        if isinstance(exc, _DOWN_ERRORS):
            self._failed()
        else:
            self.health.succeeded()  # Redis answered, if with an error: it is up

    def _failed(self) -> None:
        if self.health.failed():
            self._retry_at = self._clock.now() + self.retry_s

    async def _background_probe(self) -> bool:
        try:
            return await self.ping()
        finally:
            self._probe = None

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
        return [
            self._key("b", context, str(i), f"{v:04x}") for i, v in enumerate(bands(fingerprint))
        ]

    def __repr__(self) -> str:
        if self.health.up:
            state = "up"
        else:
            state = f"down retry_in={max(0.0, self._retry_at - self._clock.now()):.1f}s"
        counts = self._counts
        return (
            f"<RedisStore prefix={self._prefix!r} {state} entries={counts.entries} "
            f"bytes={counts.bytes} errors={self.errors}>"
        )


def _add_expiring(pipe: Any, name: str, member: bytes, ttl_ms: int) -> None:
    pipe.sadd(name, member)
    pipe.pexpire(name, ttl_ms, nx=True)
    pipe.pexpire(name, ttl_ms, gt=True)


def _as_bytes(name: bytes | str) -> bytes:
    return name if isinstance(name, bytes) else name.encode()
