"""``RedisLink``: the gateway's one way to its Redis, and the one judge of whether Redis is
usable now.

Every user (the cache store, the shared rate limits, the fleet's rate history, the
embedding index streams through the store) runs its commands through ``run``, each under
its own time budget.  Past the budget the caller gets ``StoreTimeout`` and goes on without
Redis (a miss, a local decision), but the command runs on, and its own outcome is the
evidence of Redis's health (``health.py``): Redis goes down only after several commands in
a row could not reach it, or most of the last second's did not, never for one late reply
(on 2 shared cores the event loop itself runs late).  An error Redis answered with (a full
Redis refusing a write, ``WRONGTYPE``) fails that command only: Redis is up.  Timeouts that
would take Redis down are confirmed first by one ``PING`` sent then (``_confirm``): after an
event-loop stall longer than the socket timeout (a long callback, a CPU-throttled
container) every command in flight times out at once though Redis answered each, and the
``PING``, sent after the stall, is answered; a Redis that has stopped answering fails it
too, one socket timeout later.  A Cluster that cannot serve (``CLUSTERDOWN`` while a
failover runs, a slot not covered) counts as not reached.  Any redis or socket failure is
translated here, once, into ``StoreError``.

While Redis is down ``run`` raises ``StoreError`` at once (no caller waits for a Redis
that is down); after ``retry_s`` the next caller starts one background probe (``PING``; on a
Cluster, of every master, after reading the slot map again), and when it answers Redis is
up again.  Listeners (``subscribe``) hear each transition; ``figures`` is what the metrics
read.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import StoreError, StoreTimeout
from gateway.metrics.collectors import RedisFigures
from gateway.policy.redis import Redis
from gateway.redis.connect import SOCKET_TIMEOUT_S, client_for
from gateway.redis.health import Health

log = logging.getLogger("gateway.redis")

T = TypeVar("T")
DEFAULT_RETRY_S = 1.0
"""How long Redis is left alone once down before it is probed again."""
UNREACHED = (
    RedisConnectionError,
    RedisTimeoutError,
    TimeoutError,
    OSError,
    ClusterDownError,
    RedisClusterException,
)
"""Failures that say Redis could not be reached or cannot serve: evidence of an outage."""
FAILURES = (RedisError, *UNREACHED)
"""What a command may raise: Redis's errors and the network's.  Anything else the client
raises is its own fault, and is taken as Redis unreached too (redis-py 8's asyncio
connection raises ``AttributeError`` when a failover closes it under a command in flight):
a request never fails because of the client library, it misses."""
TIMEOUTS = (RedisTimeoutError, TimeoutError)
"""Failures after which the command may still have run."""
REASONS = ("budget", "unreached", "answered", "down")
"""Why a command failed its caller: past its budget, Redis not reached, an error Redis
answered with, or not sent because Redis is down."""


class RedisLink:
    """A redis-py client, the health of the Redis behind it, and the commands in flight."""

    def __init__(
        self,
        client: Any,
        *,
        mode: str = "standalone",
        where: str = "",
        clock: Clock = SYSTEM_CLOCK,
        retry_s: float = DEFAULT_RETRY_S,
        probe_timeout_s: float = 4 * SOCKET_TIMEOUT_S,
        closing: Any = None,
    ) -> None:
        self.client = client
        self.mode = mode
        self.where = where
        self.retry_s = retry_s
        self.probe_timeout_s = probe_timeout_s
        self.failures: Counter[str] = Counter({reason: 0 for reason in REASONS})
        self.last_failure = ""
        """The last command failure, as ``Type: message`` (for an operator reading ``repr``)."""
        self.health = Health(clock, self._moved)
        self.clock = clock
        self._closing = closing
        self._listeners: list[Callable[[bool], None]] = []
        self._retry_at = 0.0
        self._probe: asyncio.Task[bool] | None = None
        self._late: set[asyncio.Future[Any]] = set()
        self._warm: asyncio.Task[bool] | None = None
        self._confirming: asyncio.Task[None] | None = None
        self.forgiven = 0
        """Times timeouts would have taken Redis down and the confirming ``PING`` was
        answered: the event loop had stalled, not Redis."""

    @classmethod
    def connect(
        cls,
        settings: Redis,
        *,
        clock: Clock = SYSTEM_CLOCK,
        retry_s: float = DEFAULT_RETRY_S,
        socket_timeout_s: float = SOCKET_TIMEOUT_S,
    ) -> RedisLink:
        """A link on a new client for the policy's ``redis:`` settings (``connect.py``)."""
        client, closing = client_for(settings, socket_timeout_s)
        return cls(
            client,
            mode=settings.mode,
            where=settings.where(),
            clock=clock,
            retry_s=retry_s,
            probe_timeout_s=4 * socket_timeout_s,
            closing=closing,
        )

    @classmethod
    def patient(cls, settings: Redis, budget_s: float, **options: Any) -> RedisLink:
        """``connect`` with sockets that wait at least four ``budget_s`` (a caller given a
        generous budget, in tests and benches, gets a patient socket)."""
        timeout_s = max(SOCKET_TIMEOUT_S, 4 * budget_s)
        return cls.connect(settings, socket_timeout_s=timeout_s, **options)

    @property
    def up(self) -> bool:
        return self.health.up

    @property
    def errors(self) -> int:
        """Commands that failed, reaching Redis or not (not those refused while down)."""
        return self.failures["unreached"] + self.failures["answered"]

    def usable(self) -> bool:
        """Whether to ask Redis now; while it is down, False, and once ``retry_s`` has
        passed, one background probe is started."""
        if self.health.up:
            return True
        if self._probe is None and self.clock.now() >= self._retry_at:
            self._probe = asyncio.get_running_loop().create_task(self._background_probe())
        return False

    def start(self) -> None:
        """Open the way before the first request needs it (``Registry.start``, once): one
        probe, which on a Cluster also reads the slot map and the command table."""
        if self._warm is None:
            self._warm = asyncio.get_running_loop().create_task(self.ping())

    def subscribe(self, listener: Callable[[bool], None]) -> Callable[[], None]:
        """Call ``listener(up)`` on every transition; returns the unsubscribe."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    async def run(self, op: str, fn: Callable[[], Awaitable[T]], budget_s: float | None) -> T:
        """``fn()``'s result within ``budget_s`` (None: no budget, for an operator's purge);
        ``StoreTimeout`` past it or when the command timed out, ``StoreError`` otherwise."""
        if not self.usable():
            self.failures["down"] += 1
            raise StoreError(f"redis {op}: unavailable, retrying in the background")
        command = asyncio.ensure_future(fn())
        try:
            if budget_s is not None:
                done, _ = await asyncio.wait((command,), timeout=budget_s)
                if not done:
                    self._judge_later(command)
                    self.failures["budget"] += 1
                    raise StoreTimeout(
                        f"redis {op}: over its {budget_s * 1000:.0f} ms budget (the command "
                        "runs on and its outcome is what counts)"
                    )
            result = await command
        except asyncio.CancelledError:
            self._judge_later(command)  # the caller left; the command's outcome still counts
            raise
        except StoreError:  # past the budget, above
            raise
        except Exception as exc:  # FAILURES, or the client's own fault (see FAILURES)
            self._judge(exc)
            error = StoreTimeout if isinstance(exc, TIMEOUTS) else StoreError
            raise error(f"redis {op}: {type(exc).__name__}: {exc}") from exc
        self.health.succeeded()
        return result

    async def ping(self) -> bool:
        """Probe Redis (every master of a Cluster); up again when it answers."""
        failure = await self._reach()
        if failure is None:
            self.health.recovered()
            return True
        if self.health.up:
            self._judge(failure)
        else:
            self._retry_at = self.clock.now() + self.retry_s
        return False

    async def _reach(self) -> Exception | None:
        """``PING`` (every master of a Cluster) within the probe's timeout; the failure."""
        try:
            async with asyncio.timeout(self.probe_timeout_s):
                if isinstance(self.client, RedisCluster):
                    await self.client.ping(target_nodes=RedisCluster.PRIMARIES)
                else:
                    await self.client.ping()
        except Exception as exc:  # FAILURES, or the client's own fault
            return exc
        return None

    def figures(self) -> RedisFigures:
        return RedisFigures(
            self.mode, self.up, self.health.transitions, dict(self.failures), self.forgiven
        )

    async def aclose(self) -> None:
        for late in list(self._late):
            late.cancel()
        for task in (self._probe, self._warm, self._confirming):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._probe = None
        await self.client.aclose()
        if self._closing is not None:
            await self._closing.aclose()

    def _judge_later(self, command: asyncio.Future[Any]) -> None:
        self._late.add(command)

        def judged(done: asyncio.Future[Any]) -> None:
            self._late.discard(done)
            if done.cancelled():
                return
            exc = done.exception()
            if exc is None:
                self.health.succeeded()
            elif isinstance(exc, Exception):
                self._judge(exc)

        command.add_done_callback(judged)

    def _judge(self, exc: BaseException) -> None:
        """One command's failure: Redis answered (up) or could not be reached (evidence)."""
        self.last_failure = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, RedisError) and not isinstance(exc, UNREACHED):
            self.failures["answered"] += 1
            self.health.succeeded()  # Redis answered, if with an error: it is up
            return
        if not isinstance(exc, FAILURES):
            log.warning("redis %s: the client failed: %s", self.where, self.last_failure)
        self.failures["unreached"] += 1
        timed_out = isinstance(exc, TIMEOUTS)
        if self.health.failed(conclusive=not timed_out):
            if timed_out:
                self._confirm()
            else:
                self._retry_at = self.clock.now() + self.retry_s

    def _confirm(self) -> None:
        """Ask Redis once more before timeouts take it down (one question at a time)."""
        if self._confirming is None:
            loop = asyncio.get_running_loop()
            self._confirming = loop.create_task(self._confirm_by_ping())

    async def _confirm_by_ping(self) -> None:
        try:
            failure = await self._reach()
        finally:
            self._confirming = None
        if failure is None:
            self.forgiven += 1
            log.info("redis %s: commands timed out together, but a PING was answered", self.where)
            self.health.recovered()  # a clean slate: the timeouts were the loop's
        elif self.health.condemn():
            self.last_failure = f"{type(failure).__name__}: {failure}"
            self._retry_at = self.clock.now() + self.retry_s

    async def _background_probe(self) -> bool:
        try:
            return await self.ping()
        finally:
            self._probe = None

    def _moved(self, up: bool) -> None:
        if up:
            log.warning("redis %s (%s): up again", self.where, self.mode)
        else:
            log.warning(
                "redis %s (%s): down; shared state is skipped (cache misses, local rate "
                "limits) and Redis is probed every %.1f s",
                self.where,
                self.mode,
                self.retry_s,
            )
        for listener in list(self._listeners):
            listener(up)

    def __repr__(self) -> str:
        if self.health.up:
            state = "up"
        else:
            state = f"down retry_in={max(0.0, self._retry_at - self.clock.now()):.1f}s"
        return (
            f"<RedisLink {self.mode} {self.where} {state} errors={self.errors} "
            f"late={len(self._late)}>"
        )
