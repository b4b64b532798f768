"""The Redis that ``store: redis`` rate limits share: the GCRA script, the key layout, the
time budget, and whether Redis is usable now.

GCRA (the generic cell rate algorithm) keeps one number per bucket: its theoretical
arrival time (TAT), the Redis time at which the bucket would be full again.  A bucket of
``capacity`` units refilled at ``rate_per_s`` admits ``amount`` when ``max(TAT, now) +
amount / rate_per_s - now <= capacity / rate_per_s``, and the TAT moves by that much; the
seconds past that bound are the wait.  That is exactly the token bucket of
``rate_limit.py`` (level = capacity - (TAT - now) x rate), so both stores mean the same
limit, burst and debt.

Keys: ``gw:rl:{<route>:<tenant>}:rq`` (requests), ``...:tk`` (tokens), ``...:rd`` and
``...:td`` (a day's requests and tokens), ``...:ti`` and ``...:to`` (a minute's prompt and
generated tokens), each a string
holding its TAT in microseconds and expiring when its bucket is full again (a full bucket
is no key).  One decision is one ``EVALSHA`` of ``GCRA`` (redis-py's ``register_script``
loads it again on ``NOSCRIPT``, after a Redis restart): it reads the route's buckets,
refuses with the wait if any cannot pay (taking nothing from any), else charges them all,
atomically, and answers each bucket's level after (``quota.py``: the ``x-ratelimit-*``
headers).  The keys of one call share the hash tag ``{<route>:<tenant>}``, so the call
is single-slot on Redis Cluster.  Time is Redis's own (``TIME`` inside the script), so the
replicas' clocks do not matter; a caller may pass ``now_us`` instead (tests).

Redis is the Redis layer's (``gateway/redis/``): its ``RedisLink`` translates every redis
or socket failure once into ``StoreError``, gives each call ``budget_s`` (25 ms) and judges
Redis's health by the commands' own outcomes; the caller decides without Redis whenever a
call fails or Redis is taken for down, and no request ever waits for a Redis that is down.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError
from gateway.policy.redis import Redis
from gateway.redis import RedisLink
from gateway.redis.keys import tag
from gateway.redis.link import DEFAULT_RETRY_S
from gateway.resilience.quota import Quota
from gateway.resilience.rate_limit import REQUESTS, TOKENS, Bucket

__all__ = ["REQUESTS", "TOKENS", "Bucket", "RedisRates", "bucket_key"]

DEFAULT_PREFIX = "gw:rl:"
DEFAULT_BUDGET_S = 0.025
"""How long a request waits for its decision before it is made locally."""

GCRA = """
-- KEYS: one bucket each (its TAT, in microseconds of Redis time).
-- ARGV[1]: 'check' (admit all or none) or 'charge' (add, debt allowed, never above full);
-- ARGV[2]: now in microseconds, or '' for Redis's TIME;
-- then per key: microseconds per unit, capacity (units), amount (units).
-- Answers {admitted, wait in ms, then each bucket's level after, in thousandths of a unit}.
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local tats, held, wait = {}, {}, 0
for i, key in ipairs(KEYS) do
  local per_unit = tonumber(ARGV[3 * i])
  local capacity = tonumber(ARGV[3 * i + 1])
  local amount = tonumber(ARGV[3 * i + 2])
  local tat = math.max(tonumber(redis.call('GET', key)) or now, now)
  held[i] = tat
  if ARGV[1] == 'charge' then
    tats[i] = math.max(now, tat + amount * per_unit)
  else
    tats[i] = tat + math.min(amount, capacity) * per_unit
    wait = math.max(wait, tats[i] - now - capacity * per_unit)
  end
end
local function levels(answer, times)
  for i = 1, #KEYS do
    local per_unit = tonumber(ARGV[3 * i])
    local capacity = tonumber(ARGV[3 * i + 1])
    answer[#answer + 1] = math.floor((capacity - (times[i] - now) / per_unit) * 1000)
  end
  return answer
end
if wait > 1 then -- past a microsecond: the stored times are rounded to one
  return levels({0, math.ceil(wait / 1000)}, held)
end
for i, key in ipairs(KEYS) do
  local ttl_ms = math.ceil((tats[i] - now) / 1000)
  if ttl_ms > 0 then
    redis.call('SET', key, string.format('%.0f', tats[i]), 'PX', ttl_ms)
  else
    redis.call('DEL', key)
  end
end
return levels({1, 0}, tats)
"""


def bucket_key(prefix: str, route: str, tenant: str, kind: str) -> str:
    """``<prefix>{<route>:<tenant>}:<kind>``; braces, colons and ``%`` in the route (and
    braces and ``%`` in the tenant) are escaped, so the hash tag is the whole pair and no
    two pairs share a key."""
    return f"{prefix}{tag(route, tenant)}:{kind}"


class RedisRates:
    """The GCRA buckets in the gateway's Redis, over its ``RedisLink`` (closed with this
    only when ``owns_link``)."""

    def __init__(
        self,
        link: RedisLink,
        *,
        prefix: str = DEFAULT_PREFIX,
        budget_s: float = DEFAULT_BUDGET_S,
        owns_link: bool = False,
    ) -> None:
        self.link = link
        self.prefix = prefix
        self.budget_s = budget_s
        self._owns_link = owns_link
        self._script = link.client.register_script(GCRA)

    @classmethod
    def connect(
        cls,
        settings: Redis,
        *,
        clock: Clock = SYSTEM_CLOCK,
        retry_s: float = DEFAULT_RETRY_S,
        **options: Any,
    ) -> RedisRates:
        """On a link of its own to the Redis of ``settings`` (tests)."""
        budget_s = options.get("budget_s", DEFAULT_BUDGET_S)
        link = RedisLink.patient(settings, budget_s, clock=clock, retry_s=retry_s)
        return cls(link, owns_link=True, **options)

    @property
    def up(self) -> bool:
        return self.link.up

    def usable(self) -> bool:
        """Whether to ask Redis now (``RedisLink.usable``: a probe once it is due)."""
        return self.link.usable()

    async def admit(
        self, buckets: Sequence[tuple[str, Bucket, float]], now_us: int | None = None
    ) -> float:
        """Take ``amount`` from each ``(key, bucket, amount)`` if all can pay, atomically:
        0.0 when admitted, else the seconds until they could (nothing taken)."""
        return (await self.decide(buckets, now_us))[0]

    async def decide(
        self, buckets: Sequence[tuple[str, Bucket, float]], now_us: int | None = None
    ) -> tuple[float, list[Quota]]:
        """``admit``'s wait, and each bucket's standing after the decision."""
        admitted, wait_ms, quotas = await self._run("check", buckets, now_us)
        return (0.0 if admitted else wait_ms / 1000), quotas

    async def charge(
        self, key: str, bucket: Bucket, amount: float, now_us: int | None = None
    ) -> Quota:
        """Add ``amount`` (negative refunds) to a bucket whatever it holds: it may go into
        debt, never above full.  Its standing after."""
        return (await self.settle([(key, bucket, amount)], now_us))[0]

    async def settle(
        self, buckets: Sequence[tuple[str, Bucket, float]], now_us: int | None = None
    ) -> list[Quota]:
        """``charge`` each ``(key, bucket, amount)``, atomically; their standings after."""
        return (await self._run("charge", buckets, now_us))[2]

    async def _run(
        self, mode: str, buckets: Sequence[tuple[str, Bucket, float]], now_us: int | None
    ) -> tuple[int, int, list[Quota]]:
        args: list[str | float] = [mode, "" if now_us is None else str(now_us)]
        for _, bucket, amount in buckets:
            args += [1_000_000 / bucket.rate_per_s, bucket.capacity, amount]
        keys = [key for key, _, _ in buckets]
        answer = await self.link.run(
            f"rate limit {mode}", lambda: self._script(keys=keys, args=args), self.budget_s
        )
        try:
            admitted, wait_ms, *levels = answer
            quotas = [
                Quota.of(bucket.capacity, int(level) / 1000, bucket.rate_per_s)
                for (_, bucket, _), level in zip(buckets, levels, strict=True)
            ]
            return int(admitted), int(wait_ms), quotas
        except (TypeError, ValueError) as exc:  # not the script's answer
            raise StoreError(f"rate limit redis {mode}: unexpected answer {answer!r}") from exc

    async def ping(self) -> bool:
        """Probe Redis; up again when it answers."""
        return await self.link.ping()

    async def aclose(self) -> None:
        if self._owns_link:
            await self.link.aclose()

    def __repr__(self) -> str:
        return f"<RedisRates prefix={self.prefix!r} {self.link!r}>"
