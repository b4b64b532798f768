"""``tenants.concurrency_store: redis``: the caps of ``concurrency.py`` counted once for
every gateway process and replica, in the gateway's Redis.

Counted in each process, a tenant capped at 2 holds 2 calls in every one of them:
``--workers 4`` in 3 replicas let it hold 24.  Shared, its calls in flight anywhere are one
count, as its ``store: redis`` rate limits are one bucket (``rate_shared.py``).

Each tenant (or client address) is one sorted set, ``gw:cc:{tenant:<name>}`` (or
``{client:<address>}``): a member per call in flight, scored by the Redis time at which
its lease ends.  Taking a place is one script call (``SLOTS``): it drops the lapsed leases,
counts the rest and, under the cap, adds the call's own, atomically; giving it back is a
``ZREM``.  Each process renews its calls' leases every third of ``LEASE_S``, so a call of
any length keeps its place, and the places of a process that died (killed, its node lost)
lapse within one lease.  Time is Redis's own (``TIME`` in the script), as in
``rate_redis.py``; a caller may pass ``now_us`` instead (tests).  A set is one key, so each
call is single-slot on Redis Cluster.

While Redis cannot decide (down, past its budget, or answering with an error), each process
holds a tenant to its local share, its cap over ``concurrency_replicas`` (at least 1),
counting every call it has in flight; the request never fails for it.  A place whose taking
was answered too late is given back at once; one whose giving back fails (or overtakes its
taking) lapses with its lease.  ``gateway_concurrency_decisions_total{store}`` counts where
decisions were made.

A reload that changes ``redis:`` (another server, a rotated password) makes a new link and a
new count over it, which adopts the old one's places: it renews them on the new link at once
(adding each where it is missing, as on another server) and gives each back when its call
ends, so a long call keeps its place through the change.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError
from gateway.metrics import Metrics
from gateway.policy.model import Tenants
from gateway.policy.redis import Redis
from gateway.redis import RedisLink, shared_link
from gateway.redis.keys import tag
from gateway.resilience.concurrency import CLIENTS_IN_FLIGHT, IN_FLIGHT, InFlight, Slot
from gateway.state import Kind, Registry

DEFAULT_PREFIX = "gw:cc:"
DEFAULT_BUDGET_S = 0.025
"""How long a request waits for its decision before it is made locally (as a rate limit's)."""
LEASE_S = 30.0
"""How long a place outlives its process's last renewal: at most how long a dead process's
calls keep their tenant's places."""
RENEWALS_PER_LEASE = 3
RENEWING_AT_ONCE = 32
"""Keys renewed together: one at a time, each within its budget, a process holding places
for a thousand addresses took up to 25 s to renew them on a slow Redis, near their lease."""
TENANT, CLIENT = "tenant", "client"

SLOTS = """
-- KEYS[1]: one tenant's (or address's) calls in flight: a sorted set of call ids, each
-- scored by the Redis time (microseconds) at which its lease ends.
-- ARGV[1]: 'take' or 'renew'; ARGV[2]: now in microseconds, or '' for Redis's TIME;
-- ARGV[3]: the lease in microseconds; 'take': ARGV[4] the cap, ARGV[5] the call's id;
-- 'renew': ARGV[4...] the ids of one process's calls in flight (added again if lapsed:
-- they are in flight).  Answers {taken, the calls in flight after}.
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local lease = tonumber(ARGV[3])
local ends = string.format('%.0f', now + lease)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', string.format('%.0f', now))
if ARGV[1] == 'take' then
  local held = redis.call('ZCARD', KEYS[1])
  if held >= tonumber(ARGV[4]) then
    return {0, held}
  end
  redis.call('ZADD', KEYS[1], ends, ARGV[5])
else
  for i = 4, #ARGV do
    redis.call('ZADD', KEYS[1], ends, ARGV[i])
  end
end
redis.call('PEXPIRE', KEYS[1], math.ceil(lease / 1000))
return {1, redis.call('ZCARD', KEYS[1])}
"""


class RedisSlots:
    """The sorted sets in the gateway's Redis, over its ``RedisLink`` (closed with this
    only when ``owns_link``: a test's own, ``RedisLink.patient``)."""

    def __init__(
        self,
        link: RedisLink,
        *,
        prefix: str = DEFAULT_PREFIX,
        lease_s: float = LEASE_S,
        budget_s: float = DEFAULT_BUDGET_S,
        owns_link: bool = False,
    ) -> None:
        self.link = link
        self.prefix = prefix
        self.lease_s = lease_s
        self.budget_s = budget_s
        self._owns_link = owns_link
        self._script = link.client.register_script(SLOTS)

    def key(self, kind: str, name: str) -> str:
        """``<prefix>{<kind>:<name>}``, escaped as every hash tag is (``keys.py``)."""
        return self.prefix + tag(kind, name)

    async def take(
        self, key: str, cap: int, call_id: str, now_us: int | None = None
    ) -> tuple[bool, int]:
        """A place for ``call_id`` if fewer than ``cap`` leases of ``key`` are live: whether
        it was taken, and the calls in flight after."""
        return await self._run("take", key, [cap, call_id], now_us)

    async def renew(self, key: str, call_ids: list[str], now_us: int | None = None) -> int:
        """A fresh lease for each of ``call_ids``; the calls in flight after."""
        return (await self._run("renew", key, list(call_ids), now_us))[1]

    async def give_back(self, key: str, call_id: str) -> None:
        await self.link.run(
            "concurrency give back", lambda: self.link.client.zrem(key, call_id), self.budget_s
        )

    async def _run(
        self, mode: str, key: str, more: list[Any], now_us: int | None
    ) -> tuple[bool, int]:
        args = [mode, "" if now_us is None else str(now_us), round(self.lease_s * 1e6), *more]
        answer = await self.link.run(
            f"concurrency {mode}", lambda: self._script(keys=[key], args=args), self.budget_s
        )
        try:
            taken, held = answer
            return bool(int(taken)), int(held)
        except (TypeError, ValueError) as exc:  # not the script's answer
            raise StoreError(f"concurrency redis {mode}: unexpected answer {answer!r}") from exc

    async def aclose(self) -> None:
        if self._owns_link:
            await self.link.aclose()

    def __repr__(self) -> str:
        return f"<RedisSlots prefix={self.prefix!r} lease={self.lease_s:g}s {self.link!r}>"


class SharedInFlight:
    """One kind of cap (tenants', or addresses') decided in Redis when it can be, else by
    ``local`` over the local share; see the module docstring."""

    def __init__(
        self,
        local: InFlight,
        slots: RedisSlots,
        kind: str,
        *,
        replicas: int,
        metrics: Metrics,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Callable[[float], Awaitable[Any]] | None = None,
    ) -> None:
        self.local = local
        self.replicas = replicas
        self.slots = slots
        self._kind = kind
        self._decisions = metrics.concurrency_decisions
        self._sleep = sleep or getattr(clock, "sleep", None) or asyncio.sleep
        self._ids = map(f"{secrets.token_hex(6)}:{{}}".format, itertools.count())
        self._held: dict[str, set[str]] = {}  # this process's places in Redis, by key
        self._renewer: asyncio.Task[None] | None = None
        self._renew_now = False  # adopted places: renewed at once, on this link
        self._successor: SharedInFlight | None = None  # adopted this one's places
        self._tasks: set[asyncio.Task[None]] = set()  # places being given back

    async def take(self, name: str, cap: int) -> Slot:
        """A slot for one of ``name``'s calls, or ``ConcurrencyLimited`` past ``cap``
        across every process (past the local share while Redis cannot decide)."""
        if self.slots.link.usable():
            key, call_id = self.slots.key(self._kind, name), next(self._ids)
            try:
                taken, held = await self.slots.take(key, cap, call_id)
            except asyncio.CancelledError:  # its client left: the place, if taken, goes back
                self._later(self._give_back(key, call_id))
                raise
            except StoreError:
                self._later(self._give_back(key, call_id))  # in case it was taken after all
            else:
                self._decisions.labels("redis").inc()
                if not taken:
                    raise self.local.refusal(name, held, cap, " across the gateway's processes")
                self._held.setdefault(key, set()).add(call_id)
                self._renewing()
                return self.local.enter(name, None, functools.partial(self._left, key, call_id))
        self._decisions.labels("local").inc()
        held = self.local.held(name)
        if held >= max(1, cap // self.replicas):
            where = " in this gateway process, its share while Redis is unreachable"
            raise self.local.refusal(name, held, cap, where)
        return self.local.enter(name, None)

    def held(self, name: str) -> int:
        """``name``'s calls in flight in this process."""
        return self.local.held(name)

    def adopt(self, old: SharedInFlight) -> None:
        """Take over ``old``'s places (a reload changed ``redis:``): they are renewed on this
        link once started (``start``), and given back through it when their calls end."""
        old._successor = self
        for key, ids in old._held.items():
            self._held.setdefault(key, set()).update(ids)
        old._held = {}
        self._renew_now = bool(self._held)

    def start(self) -> None:
        """On the running loop (the registry's ``start``): renew adopted places at once."""
        if self._renew_now:
            self._renewing()

    def _renewing(self) -> None:
        """Renew this process's places from now on, unless that is under way."""
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.get_running_loop().create_task(self._renew())

    def _left(self, key: str, call_id: str) -> None:
        if self._successor is not None:  # a reload moved the place to another link
            self._successor._left(key, call_id)
            return
        ids = self._held.get(key)
        if ids is not None:
            ids.discard(call_id)
            if not ids:
                del self._held[key]
        self._later(self._give_back(key, call_id))

    async def _give_back(self, key: str, call_id: str) -> None:
        try:
            await self.slots.give_back(key, call_id)
        except StoreError:
            pass  # its lease lapses

    async def _renew(self) -> None:
        while self._held:
            if not self._renew_now:
                await self._sleep(self.slots.lease_s / RENEWALS_PER_LEASE)
            self._renew_now = False
            held = [(key, sorted(ids)) for key, ids in self._held.items()]
            for at in range(0, len(held), RENEWING_AT_ONCE):
                await asyncio.gather(
                    *(self._renew_key(*k) for k in held[at : at + RENEWING_AT_ONCE])
                )

    async def _renew_key(self, key: str, call_ids: list[str]) -> None:
        try:
            await self.slots.renew(key, call_ids)
        except StoreError:
            pass  # the next renewal, within the lease, may reach it

    def _later(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Stop renewing (the places lapse) and finish giving back the places left."""
        if self._renewer is not None:
            self._renewer.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def __repr__(self) -> str:
        held = sum(map(len, self._held.values()))
        return f"<SharedInFlight {self._kind} replicas={self.replicas} held_in_redis={held}>"


Counts = InFlight | SharedInFlight
SHARED_IN_FLIGHT: Kind[SharedInFlight] = Kind("shared_in_flight")


def in_flight_counts(
    tenants: Tenants, registry: Registry, metrics: Metrics, clock: Clock, redis: Redis
) -> tuple[Counts, Counts]:
    """The tenants' counts and the addresses' for ``tenants``, kept across reloads: each
    process's own, or shared through the gateway's Redis (``redis``, the policy's
    ``redis:``) with ``concurrency_store: redis``.  A reload that changes only
    ``concurrency_replicas`` keeps the places in Redis and their renewals; one that changes
    ``redis`` moves them to the new link (``SharedInFlight.adopt``)."""
    local = (
        registry.get(IN_FLIGHT, "", None, functools.partial(InFlight, metrics)),
        registry.get(
            CLIENTS_IN_FLIGHT, "", None, functools.partial(InFlight, metrics, clients=True)
        ),
    )
    if tenants.concurrency_store != "redis":
        return local
    link = shared_link(registry, redis, clock, metrics)
    replicas = tenants.concurrency_replicas

    def shared(kind: str, counts: InFlight) -> SharedInFlight:
        old = registry.peek(SHARED_IN_FLIGHT, kind)
        made = registry.get(
            SHARED_IN_FLIGHT,
            kind,
            redis,
            lambda: SharedInFlight(
                counts, RedisSlots(link), kind, replicas=replicas, metrics=metrics, clock=clock
            ),
        )
        made.replicas = replicas
        if old is not None and made is not old:
            made.adopt(old)
        return made

    return shared(TENANT, local[0]), shared(CLIENT, local[1])
