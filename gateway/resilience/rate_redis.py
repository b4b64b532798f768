"""The Redis that ``store: redis`` rate limits share: the GCRA script, the key layout, the
time budget, and whether Redis is usable now.

GCRA (the generic cell rate algorithm) keeps one number per bucket: its theoretical
arrival time (TAT), the Redis time at which the bucket would be full again.  A bucket of
``capacity`` units refilled at ``rate_per_s`` admits ``amount`` when ``max(TAT, now) +
amount / rate_per_s - now <= capacity / rate_per_s``, and the TAT moves by that much; the
seconds past that bound are the wait.  That is exactly the token bucket of
``rate_limit.py`` (level = capacity - (TAT - now) x rate), so both stores mean the same
limit, burst and debt.

Keys: ``gw:rl:{<route>:<tenant>}:rq`` (requests) and ``...:tk`` (tokens), each a string
holding its TAT in microseconds and expiring when its bucket is full again (a full bucket
is no key).  One decision is one ``EVALSHA`` of ``GCRA`` (redis-py's ``register_script``
loads it again on ``NOSCRIPT``, after a Redis restart): it reads the route's buckets,
refuses with the wait if any cannot pay (taking nothing from either), else charges both,
atomically.  The keys of one call share the hash tag ``{<route>:<tenant>}``, so the call
is single-slot on Redis Cluster.  Time is Redis's own (``TIME`` inside the script), so the
replicas' clocks do not matter; a caller may pass ``now_us`` instead (tests).

Redis is a boundary, translated once: any redis or socket failure, or a call past
``budget_s`` (25 ms), raises ``StoreError``, and the caller decides without Redis.  A
failure (a refused or broken connection, an error Redis answered with) takes Redis for down
for ``retry_s`` at once; a late answer does so only ``LATE_IN_A_ROW`` times in a row (on 2
shared cores the event loop itself runs late; one late reply proves nothing), or when the
command, left to run on, fails.  While down no request asks it; after ``retry_s`` the next
caller starts one background ``PING`` and goes on without Redis; when the PING answers,
Redis is up again.  No request ever waits for a Redis that is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError

log = logging.getLogger("gateway.rate_limit")

DEFAULT_PREFIX = "gw:rl:"
DEFAULT_BUDGET_S = 0.025
"""How long a request waits for its decision before it is made locally."""
DEFAULT_RETRY_S = 1.0
"""How long Redis is left alone after a failure before it is probed again."""
LATE_IN_A_ROW = 3
PROBE_TIMEOUT_S = 0.2
REQUESTS, TOKENS = "rq", "tk"
"""The limit kinds, each a key of its own."""
_FAILURES = (RedisError, TimeoutError, OSError)
"""What makes a decision local: every redis failure (an error Redis answered too), a socket's."""

GCRA = """
-- KEYS: one bucket each (its TAT, in microseconds of Redis time).
-- ARGV[1]: 'check' (admit all or none) or 'charge' (add, debt allowed, never above full);
-- ARGV[2]: now in microseconds, or '' for Redis's TIME;
-- then per key: microseconds per unit, capacity (units), amount (units).
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local tats, wait = {}, 0
for i, key in ipairs(KEYS) do
  local per_unit = tonumber(ARGV[3 * i])
  local capacity = tonumber(ARGV[3 * i + 1])
  local amount = tonumber(ARGV[3 * i + 2])
  local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
  if ARGV[1] == 'charge' then
    tats[i] = math.max(now, tat + amount * per_unit)
  else
    tats[i] = tat + math.min(amount, capacity) * per_unit
    wait = math.max(wait, tats[i] - now - capacity * per_unit)
  end
end
if wait > 1 then -- past a microsecond: the stored times are rounded to one
  return {0, math.ceil(wait / 1000)}
end
for i, key in ipairs(KEYS) do
  local ttl_ms = math.ceil((tats[i] - now) / 1000)
  if ttl_ms > 0 then
    redis.call('SET', key, string.format('%.0f', tats[i]), 'PX', ttl_ms)
  else
    redis.call('DEL', key)
  end
end
return {1, 0}
"""


@dataclass(frozen=True, slots=True)
class Bucket:
    """One limit kind of a route: ``capacity`` units, refilled at ``rate_per_s``."""

    kind: str
    rate_per_s: float
    capacity: float


def bucket_key(prefix: str, route: str, tenant: str, kind: str) -> str:
    """``<prefix>{<route>:<tenant>}:<kind>``; braces, colons and ``%`` in the route (and
    braces and ``%`` in the tenant) are escaped, so the hash tag is the whole pair and no
    two pairs share a key."""
    tag = f"{_escape(route, ':')}:{_escape(tenant)}"
    return f"{prefix}{{{tag}}}:{kind}"


def _escape(text: str, also: str = "") -> str:
    for char in "%{}" + also:
        text = text.replace(char, f"%{ord(char):02X}")
    return text


class RedisRates:
    """The GCRA buckets in one Redis (one client per gateway); takes a ready
    ``redis.asyncio`` client."""

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        budget_s: float = DEFAULT_BUDGET_S,
        retry_s: float = DEFAULT_RETRY_S,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self.prefix = prefix
        self.budget_s = budget_s
        self.retry_s = retry_s
        self.up = True
        self.errors = 0
        self._client = client
        self._script = client.register_script(GCRA)
        self._clock = clock
        self._retry_at = 0.0
        self._late_in_a_row = 0
        self._probe: asyncio.Task[bool] | None = None
        self._late: set[asyncio.Future[Any]] = set()

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisRates:
        """On a new client for ``url`` whose sockets give up soon after the budget, and
        which sends a command again once, on a new connection, when its pooled one has died
        (Redis restarted): a restart that finished costs no request its shared decision."""
        client = aioredis.Redis.from_url(
            url,
            socket_timeout=PROBE_TIMEOUT_S,
            socket_connect_timeout=PROBE_TIMEOUT_S,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
        )
        return cls(client, **options)

    def usable(self) -> bool:
        """Whether to ask Redis now; while it is down, False, and once ``retry_s`` has
        passed, one background probe is started."""
        if self.up:
            return True
        if self._probe is None and self._clock.now() >= self._retry_at:
            self._probe = asyncio.get_running_loop().create_task(self._background_probe())
        return False

    async def admit(
        self, buckets: Sequence[tuple[str, Bucket, float]], now_us: int | None = None
    ) -> float:
        """Take ``amount`` from each ``(key, bucket, amount)`` if all can pay, atomically:
        0.0 when admitted, else the seconds until they could (nothing taken)."""
        admitted, wait_ms = await self._run("check", buckets, now_us)
        return 0.0 if admitted else wait_ms / 1000

    async def charge(
        self, key: str, bucket: Bucket, amount: float, now_us: int | None = None
    ) -> None:
        """Add ``amount`` (negative refunds) to a bucket whatever it holds: it may go into
        debt, never above full."""
        await self._run("charge", [(key, bucket, amount)], now_us)

    async def _run(
        self, mode: str, buckets: Sequence[tuple[str, Bucket, float]], now_us: int | None
    ) -> tuple[int, int]:
        args: list[str | float] = [mode, "" if now_us is None else str(now_us)]
        for _, bucket, amount in buckets:
            args += [1_000_000 / bucket.rate_per_s, bucket.capacity, amount]
        call = self._script(keys=[key for key, _, _ in buckets], args=args)
        command: asyncio.Future[Any] = asyncio.ensure_future(call)
        try:
            done, _ = await asyncio.wait((command,), timeout=self.budget_s)
            if not done:
                self._leave(command)
                self._late_in_a_row += 1
                if self._late_in_a_row >= LATE_IN_A_ROW:
                    self._failed(f"answered later than {self.budget_s * 1000:.0f} ms")
                raise StoreError(f"rate limit redis {mode}: over its budget")
            admitted, wait_ms = command.result()
        except asyncio.CancelledError:
            self._leave(command)  # the caller left; the command runs on
            raise
        except _FAILURES as exc:
            self._failed(f"{type(exc).__name__}: {exc}")
            raise StoreError(f"rate limit redis {mode}: {type(exc).__name__}: {exc}") from exc
        except (TypeError, ValueError) as exc:  # not the script's answer
            self._failed(f"unexpected answer: {exc}")
            raise StoreError(f"rate limit redis {mode}: unexpected answer") from exc
        self._late_in_a_row = 0
        return int(admitted), int(wait_ms)

    def _leave(self, command: asyncio.Future[Any]) -> None:
        """Let a command run on without a caller; a failure, when it comes, still counts."""
        self._late.add(command)

        def done(future: asyncio.Future[Any]) -> None:
            self._late.discard(future)
            exc = None if future.cancelled() else future.exception()
            if isinstance(exc, _FAILURES):
                self._failed(f"{type(exc).__name__}: {exc}")

        command.add_done_callback(done)

    def _failed(self, why: str) -> None:
        self.errors += 1
        self._late_in_a_row = 0
        self._retry_at = self._clock.now() + self.retry_s
        if self.up:
            log.warning(
                "rate limits: redis %s; each process enforces its local share, retrying in %.1f s",
                why,
                self.retry_s,
            )
            self.up = False

    async def ping(self) -> bool:
        """Probe Redis; up again when it answers."""
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self._client.ping()
        except _FAILURES:
            self._retry_at = self._clock.now() + self.retry_s
            return False
        if not self.up:
            log.warning("rate limits: redis is back; limits are shared again")
            self.up = True
        return True

    async def _background_probe(self) -> bool:
        try:
            return await self.ping()
        finally:
            self._probe = None

    async def aclose(self) -> None:
        for late in list(self._late):
            late.cancel()
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)
            self._probe = None
        await self._client.aclose()

    def __repr__(self) -> str:
        if self.up:
            state = "up"
        else:
            state = f"down retry_in={max(0.0, self._retry_at - self._clock.now()):.1f}s"
        return f"<RedisRates prefix={self.prefix!r} {state} errors={self.errors}>"
