"""A tenant's calls in flight capped across gateways: ``tenants.concurrency_store``.

    python -m bench.bench_tenant_caps [--duration 5] [--rounds 3] [--holders 8]

A backend answers each call after ``SERVICE_MS`` (``LONG_MS`` for ``model: long``) and
records the most calls it held at once.  In front of it, gateways (``gateway serve``, each
a process of its own, as replicas are) with tenant acme's calls in flight capped at ``CAP``
(``tenants.keys[].max_concurrency``), counted in each process (``concurrency_store:
memory``) or once, in one ``redis-server`` (``redis``).  The paths, taking turns in each
round:

- direct: acme one call at a time on one connection, straight to the backend; then the same
  through one gateway with no cap, with the cap counted in memory, and counted in Redis:
  what the count costs a call (in Redis, one script call to take a place and a ``ZREM`` to
  give it back, the second after the answer has left);
- two gateways, acme holding long calls on ``--holders`` connections spread over both:
  the most of them the backend held at once, acme's answers and refusals a second.  Counted
  in memory, each gateway admits ``CAP``; in Redis, both together do.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bench.bench_fairness import KEYS, LONG_MODEL, Client
from bench.common import machine, update_section
from bench.plumbing import gateway, pcts, serving
from tests.redis_server import RedisServer

SERVICE_MS = 2.0
LONG_MS = 500.0
CAP = 3


class Server:
    """Answers after ``SERVICE_MS`` (``LONG_MS`` for a long call); ``most`` is the most
    calls it held at once since ``reset``."""

    def __init__(self) -> None:
        self.active = 0
        self.most = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    def reset(self) -> None:
        self.most = self.active

    async def chat(self, request: web.Request) -> web.Response:
        long = (await request.json()).get("model") == LONG_MODEL
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            await asyncio.sleep((LONG_MS if long else SERVICE_MS) / 1000)
        finally:
            self.active -= 1
        return web.json_response({"id": "c", "object": "chat.completion", "choices": []})


def policy(url: str, store: str | None, redis: str) -> dict[str, Any]:
    """acme capped at ``CAP`` counted in ``store`` (None: no cap); globex uncapped."""
    keys: list[dict[str, Any]] = [
        {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
        for name, key in KEYS.items()
    ]
    tenants: dict[str, Any] = {"keys": keys}
    if store is not None:
        keys[0]["max_concurrency"] = CAP
        tenants["concurrency_store"] = store
    return {
        "backends": {"main": {"url": url}},
        "routes": [{"match": {"path": "/v1/*"}, "backend": "main"}],
        "tenants": tenants,
        "redis": {"url": redis},
    }


async def one_at_a_time(url: str, duration_s: float) -> dict[str, float]:
    """acme's calls one at a time on one connection: their latency."""
    latencies: list[float] = []
    stop = time.perf_counter() + duration_s
    async with Client(url, "acme") as client:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            if await client.post() == 200:
                latencies.append((time.perf_counter() - started) * 1000)
    p50, p99, _ = pcts(latencies)
    return {"p50": p50, "p99": p99, "calls": float(len(latencies))}


async def holding(
    urls: list[str], server: Server, duration_s: float, holders: int
) -> dict[str, float]:
    """acme's long calls on ``holders`` connections spread over ``urls``, each retrying a
    refusal after ``LONG_MS / 10``: the most the backend held at once, answers and refusals
    a second."""
    server.reset()
    counts = {"answered": 0, "refused": 0}
    stop = time.perf_counter() + duration_s

    async def holder(url: str) -> None:
        async with Client(url, "acme", long=True) as client:
            while time.perf_counter() < stop:
                if await client.post() == 200:
                    counts["answered"] += 1
                else:
                    counts["refused"] += 1
                    await asyncio.sleep(LONG_MS / 10_000)

    began = time.perf_counter()
    await asyncio.gather(*(holder(urls[n % len(urls)]) for n in range(holders)))
    elapsed = time.perf_counter() - began
    return {
        "most": float(server.most),
        "answered": counts["answered"] / elapsed,
        "refused": counts["refused"] / elapsed,
    }


async def main(duration_s: float, rounds: int, holders: int) -> list[str]:
    server = Server()
    with RedisServer() as store:
        async with serving(server.app()) as (backend,):
            return await measured(backend, store.url, server, duration_s, rounds, holders)


async def measured(
    backend: str, redis: str, server: Server, duration_s: float, rounds: int, holders: int
) -> list[str]:
    """Every path over ``rounds``, through gateways on ``backend`` sharing ``redis``."""
    latency: dict[str, list[dict[str, float]]] = {}
    held: dict[str, list[dict[str, float]]] = {}
    async with (
        gateway(policy(backend, None, redis)) as plain,
        gateway(policy(backend, "memory", redis)) as memory_a,
        gateway(policy(backend, "memory", redis)) as memory_b,
        gateway(policy(backend, "redis", redis)) as redis_a,
        gateway(policy(backend, "redis", redis)) as redis_b,
    ):
        calls: list[tuple[str, Callable[[], Awaitable[dict[str, float]]]]] = [
            ("direct", lambda: one_at_a_time(backend, duration_s)),
            ("gateway, no cap", lambda: one_at_a_time(plain, duration_s)),
            ("gateway, cap counted in memory", lambda: one_at_a_time(memory_a, duration_s)),
            ("gateway, cap counted in Redis", lambda: one_at_a_time(redis_a, duration_s)),
        ]
        holds: list[tuple[str, Callable[[], Awaitable[dict[str, float]]]]] = [
            (
                "two gateways, `concurrency_store: memory`",
                lambda: holding([memory_a, memory_b], server, duration_s, holders),
            ),
            (
                "two gateways, `concurrency_store: redis`",
                lambda: holding([redis_a, redis_b], server, duration_s, holders),
            ),
        ]
        for _ in range(rounds):
            for name, measure in calls:
                latency.setdefault(name, []).append(await measure())
            for name, measure in holds:
                held.setdefault(name, []).append(await measure())
                await asyncio.sleep(LONG_MS / 1000)  # the last long calls end
    return table(latency, held, holders)


def table(
    latency: dict[str, list[dict[str, float]]],
    held: dict[str, list[dict[str, float]]],
    holders: int,
) -> list[str]:
    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    lines = [
        "| path | acme p50 ms | acme p99 ms | calls |",
        "|---|---|---|---|",
        *(
            f"| {name} | {med(runs, 'p50'):.2f} | {med(runs, 'p99'):.2f} | "
            f"{med(runs, 'calls'):.0f} |"
            for name, runs in latency.items()
        ),
        "",
        f"| acme holding {LONG_MS:g} ms calls on {holders} connections, cap {CAP} | "
        "most held by the backend at once | acme answers/s | acme refused/s |",
        "|---|---|---|---|",
        *(
            f"| {name} | {med(runs, 'most'):.0f} | {med(runs, 'answered'):.1f} | "
            f"{med(runs, 'refused'):.0f} |"
            for name, runs in held.items()
        ),
    ]
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--holders", type=int, default=8)
    args = parser.parse_args()
    lines = asyncio.run(main(args.duration, args.rounds, args.holders))
    print("\n".join(lines))
    command = (
        f"python -m bench.bench_tenant_caps --duration {args.duration:g} "
        f"--rounds {args.rounds} --holders {args.holders}"
    )
    update_section(
        "tenant-caps",
        "## A tenant's calls in flight capped across gateways (`tenants.concurrency_store`)\n\n"
        f"`{command}` on {machine()}. A backend answering each call after {SERVICE_MS:g} ms "
        f"(a long call after {LONG_MS:g} ms); gateways as processes of their own, tenant "
        f"acme capped at {CAP} calls in flight, counted in each process or in one local "
        "redis-server. First acme's calls one at a time on one connection (what the count "
        "costs a call), then its long calls on connections spread over two gateways, each "
        f"refused call retried after {LONG_MS / 10:g} ms. Each figure is the median over the "
        "rounds, in which the paths take turns.\n\n" + "\n".join(lines),
    )
