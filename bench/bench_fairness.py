"""A tenant flooding a backend's queue, and what another tenant gets: ``queue.fairness``.

    python -m bench.bench_fairness [--duration 5] [--rounds 3] [--flood 96] [--holders 8]

A backend that serves each call in ``SERVICE_MS`` and, behind the gateway, at most
``CONCURRENCY`` at once (``max_concurrency``; a queue of ``CAPACITY``).  Tenant ``acme``
floods it: ``--flood`` connections in a closed loop, each sending its next call as soon as
the last is answered (after a 503, after ``RETRY_MS``).  Tenant ``globex`` sends one call
at a time on one connection.  Measured for ``globex``: latency (p50, p99) and the share of
its calls refused; for ``acme``: answers a second.  The paths, taking turns in each round:

- direct: ``globex`` alone, straight to the backend (no queue at all);
- gateway, alone: ``globex`` alone through the gateway;
- gateway ``fifo``, flooded: first come, first served (the queue before this bench);
- gateway ``tenant``, flooded: the default, each waiting tenant in turn;
- the same with every call of acme's asking ``X-Priority: high``, which jumps the turns;
- the same with acme capped at ``normal`` (``tenants.keys[].max_priority``);
- gateway ``tenant``, both tenants flooding with half the connections each, then the same
  with acme weighted ``WEIGHT`` (``tenants.keys[].weight``): the backend's answers shared
  1:1, then 3:1;
- gateway ``tenant``, acme holding long calls (``--holders`` connections, each call taking
  ``LONG_MS``, as long streams do): the queue shares only the slots that come free;
- the same with acme's calls in flight capped below the backend's slots
  (``tenants.keys[].max_concurrency: CONCURRENCY - 1``).

The backend, the clients and this bench share one event loop; the gateway is its own
process (``gateway serve``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from bench.common import machine, update_section
from bench.plumbing import CHAT, gateway, pcts, serving

SERVICE_MS = 20.0
CONCURRENCY = 4
CAPACITY = 64
RETRY_MS = 50.0
LONG_MS = 500.0
"""A long call (a stream of a few hundred tokens): ``model: long``."""
LONG_MODEL = "long"
WEIGHT = 3
"""acme's weight in the weighted row: three calls a turn to globex's one."""
KEYS = {"acme": "acme-bench-key", "globex": "globex-bench-key"}


class Server:
    """Answers each call after ``SERVICE_MS``, as a model busy for that long would."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        long = (await request.json()).get("model") == LONG_MODEL
        await asyncio.sleep((LONG_MS if long else SERVICE_MS) / 1000)
        return web.json_response({"id": "c", "object": "chat.completion", "choices": []})


class Client:
    """One keep-alive connection of one tenant, with next to no cost of its own."""

    def __init__(self, url: str, tenant: str, high: bool = False, long: bool = False) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        body = json.dumps({**CHAT, "model": LONG_MODEL} if long else CHAT).encode()
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n%s"
            b"Authorization: Bearer %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s"
            % (b"X-Priority: high\r\n" if high else b"", KEYS[tenant].encode(), len(body), body)
        )

    async def __aenter__(self) -> Client:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def post(self) -> int:
        self.writer.write(self.request)
        head = (await self.reader.readuntil(b"\r\n\r\n")).decode("latin-1")
        length = 0
        for line in head.split("\r\n")[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        await self.reader.readexactly(length)
        return int(head.split()[1])


def policy(
    url: str,
    fairness: str,
    acme_cap: str = "high",
    acme_concurrency: int | None = None,
    acme_weight: int = 1,
) -> dict[str, Any]:
    keys: list[dict[str, Any]] = [
        {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
        for name, key in KEYS.items()
    ]
    keys[0]["max_priority"] = acme_cap
    keys[0]["weight"] = acme_weight
    if acme_concurrency is not None:
        keys[0]["max_concurrency"] = acme_concurrency
    queue = {"capacity": CAPACITY, "timeout_ms": 10_000, "fairness": fairness}
    return {
        "backends": {"main": {"url": url, "max_concurrency": CONCURRENCY, "queue": queue}},
        "routes": [{"match": {"path": "/v1/*"}, "backend": "main"}],
        "tenants": {"keys": keys},
    }


async def run(
    url: str,
    duration_s: float,
    flood: int,
    high: bool = False,
    long: bool = False,
    globex_conns: int = 1,
) -> dict[str, float]:
    """``globex`` one call at a time on each of ``globex_conns`` connections for
    ``duration_s`` while ``flood`` connections of ``acme`` (none: alone; ``high``: each call
    with ``X-Priority: high``; ``long``: each call a long one) keep the backend busy."""
    stop = time.perf_counter() + duration_s
    latencies: list[float] = []
    refused = 0
    flooded = {"answered": 0, "refused": 0}

    async def acme() -> None:
        async with Client(url, "acme", high, long) as client:
            while time.perf_counter() < stop:
                if await client.post() == 200:
                    flooded["answered"] += 1
                else:
                    flooded["refused"] += 1
                    await asyncio.sleep(RETRY_MS / 1000)

    async def globex() -> None:
        nonlocal refused
        await asyncio.sleep(0.5 if flood else 0)  # the flood fills the queue first
        async with Client(url, "globex") as client:
            while time.perf_counter() < stop:
                started = time.perf_counter()
                status = await client.post()
                if status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    refused += 1
                    await asyncio.sleep(RETRY_MS / 1000)

    began = time.perf_counter()
    await asyncio.gather(*(globex() for _ in range(globex_conns)), *(acme() for _ in range(flood)))
    elapsed = time.perf_counter() - began
    p50, p99, _ = pcts(latencies) if latencies else (float("nan"),) * 3
    asked = len(latencies) + refused
    return {
        "p50": p50,
        "p99": p99,
        "calls": float(len(latencies)),
        "refused": 100.0 * refused / asked if asked else 0.0,
        "acme_rps": flooded["answered"] / elapsed,
        "acme_refused": flooded["refused"] / elapsed,
    }


async def main(duration_s: float, rounds: int, flood: int, holders: int) -> list[str]:
    results: dict[str, list[dict[str, float]]] = {}
    async with serving(Server().app()) as (backend,):
        async with (
            gateway(policy(backend, "fifo")) as fifo,
            gateway(policy(backend, "tenant")) as fair,
            gateway(policy(backend, "tenant", acme_cap="normal")) as capped,
            gateway(policy(backend, "tenant", acme_concurrency=CONCURRENCY - 1)) as held,
            gateway(policy(backend, "tenant", acme_weight=WEIGHT)) as weighted,
        ):
            flooding = f"acme flooding ({flood} conn)"
            holding = f"acme holding {LONG_MS:g} ms calls ({holders} conn)"
            paths: list[tuple[str, Callable[[], Awaitable[dict[str, float]]]]] = [
                ("direct, globex alone", lambda: run(backend, duration_s, 0)),
                ("gateway, globex alone", lambda: run(fair, duration_s, 0)),
                (f"gateway `fifo`, {flooding}", lambda: run(fifo, duration_s, flood)),
                (f"gateway `tenant`, {flooding}", lambda: run(fair, duration_s, flood)),
                (
                    f"gateway `tenant`, {flooding} with `X-Priority: high`",
                    lambda: run(fair, duration_s, flood, high=True),
                ),
                (
                    "the same, acme's `max_priority: normal`",
                    lambda: run(capped, duration_s, flood, high=True),
                ),
                (
                    f"gateway `tenant`, both flooding ({flood // 2} conn each)",
                    lambda: run(fair, duration_s, flood // 2, globex_conns=flood // 2),
                ),
                (
                    f"the same, acme's `weight: {WEIGHT}`",
                    lambda: run(weighted, duration_s, flood // 2, globex_conns=flood // 2),
                ),
                (
                    f"gateway `tenant`, {holding}",
                    lambda: run(fair, duration_s, holders, long=True),
                ),
                (
                    f"the same, acme's `max_concurrency: {CONCURRENCY - 1}`",
                    lambda: run(held, duration_s, holders, long=True),
                ),
            ]
            for _ in range(rounds):
                for name, measure in paths:
                    results.setdefault(name, []).append(await measure())
                    await asyncio.sleep(0.5)  # the gateway's queue empties between paths
    lines = [
        "| path | globex p50 ms | globex p99 ms | globex calls answered | globex refused | "
        "acme answers/s | acme refused/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, runs in results.items():

        def med(key: str, runs: list[dict[str, float]] = runs) -> float:
            return statistics.median(r[key] for r in runs)

        def ms(key: str, runs: list[dict[str, float]] = runs) -> str:
            answered = [r[key] for r in runs if r["calls"]]  # none answered: no latency
            return f"{statistics.median(answered):.1f}" if answered else "-"

        lines.append(
            f"| {name} | {ms('p50')} | {ms('p99')} | {med('calls'):.0f} | "
            f"{med('refused'):.1f}% | {med('acme_rps'):.0f} | {med('acme_refused'):.0f} |"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flood", type=int, default=96)
    parser.add_argument("--holders", type=int, default=8)
    args = parser.parse_args()
    table = asyncio.run(main(args.duration, args.rounds, args.flood, args.holders))
    print("\n".join(table))
    command = (
        f"python -m bench.bench_fairness --duration {args.duration:g} --rounds {args.rounds} "
        f"--flood {args.flood} --holders {args.holders}"
    )
    update_section(
        "fairness",
        "## Fair queuing between tenants (`queue.fairness`)\n\n"
        f"`{command}` on {machine()}. A backend serving each call in {SERVICE_MS:g} ms, at most "
        f"{CONCURRENCY} at once behind the gateway (`max_concurrency: {CONCURRENCY}`, a queue "
        f"of {CAPACITY}); tenant acme floods it ({args.flood} connections in a closed loop, "
        f"each refused call retried after {RETRY_MS:g} ms); tenant globex sends one call at a "
        "time on one connection, except in the two rows where both flood (globex's calls "
        "answered are then over all its connections). In the last two rows acme's "
        f"{args.holders} connections "
        f"send long calls instead ({LONG_MS:g} ms each, as long streams are). Each figure "
        "is the median over the rounds, in which the "
        "paths take turns; latency is over globex's answered calls.\n\n" + "\n".join(table),
    )
