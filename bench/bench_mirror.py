"""Shadow traffic (``routes[].mirror``): what copying each call to another backend costs the
calls the clients wait for.

    python -m bench.bench_mirror [--duration 5] [--rounds 3] [--connections 8]

A primary backend answers each call after ``SERVICE_MS``; a shadow answers its copies
after ``SERVICE_MS`` too, or holds each for ``SLOW_MS`` (a shadow far slower than the
primary: a new model version that is not ready).  The gateways run as processes of their
own.  The paths, taking turns in each round:

- direct: straight to the primary;
- the gateway without a mirror;
- the gateway copying every call (``fraction: 1``) to the quick shadow;
- the gateway copying every call to the slow shadow, ``max_in_flight: 16``: the copies past
  16 are not sent (``shed``).

Each path is measured twice: one call at a time on one connection (latency p50 / p99), and
``--connections`` connections sending as fast as they are answered (answers a second, and
their p99).  The shadow's share is counted by the shadow itself.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.common import machine, update_section
from bench.plumbing import Answering, RawClient, gateway, pcts, serving

SERVICE_MS = 2.0
SLOW_MS = 500.0
MAX_IN_FLIGHT = 16


def policy(primary: str, shadow: str | None) -> dict[str, Any]:
    backends: dict[str, Any] = {"main": {"url": primary}}
    route: dict[str, Any] = {"match": {"path": "/v1/*"}, "backend": "main"}
    if shadow is not None:
        backends["shadow"] = {"url": shadow}
        route["mirror"] = {"backend": "shadow", "max_in_flight": MAX_IN_FLIGHT}
    return {"backends": backends, "routes": [route]}


async def send_until(url: str, stop: float, latencies: list[float]) -> None:
    """Calls one after another on one connection until ``stop``; each answer's latency."""
    async with RawClient(url) as client:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            status, _ = await client.post()
            if status == 200:
                latencies.append((time.perf_counter() - started) * 1000)


async def one_at_a_time(url: str, duration_s: float) -> dict[str, float]:
    latencies: list[float] = []
    await send_until(url, time.perf_counter() + duration_s, latencies)
    p50, p99, _ = pcts(latencies)
    return {"p50": p50, "p99": p99}


async def loaded(url: str, duration_s: float, connections: int) -> dict[str, float]:
    latencies: list[float] = []
    began = time.perf_counter()
    stop = began + duration_s
    await asyncio.gather(*(send_until(url, stop, latencies) for _ in range(connections)))
    elapsed = time.perf_counter() - began
    _, p99, _ = pcts(latencies)
    return {"rps": len(latencies) / elapsed, "load_p99": p99}


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    primary, quick, slow = Answering(SERVICE_MS), Answering(SERVICE_MS), Answering(SLOW_MS)
    async with serving(primary.app(), quick.app(), slow.app()) as (main_url, quick_url, slow_url):
        async with (
            gateway(policy(main_url, None)) as plain,
            gateway(policy(main_url, quick_url)) as to_quick,
            gateway(policy(main_url, slow_url)) as to_slow,
        ):
            paths: list[tuple[str, str, Answering | None]] = [
                ("direct", main_url, None),
                ("gateway, no mirror", plain, None),
                (f"gateway, mirror answering in {SERVICE_MS:g} ms", to_quick, quick),
                (f"gateway, mirror holding each copy {SLOW_MS:g} ms", to_slow, slow),
            ]
            runs: dict[str, list[dict[str, float]]] = {name: [] for name, _, _ in paths}
            for _ in range(rounds):
                for name, url, shadow in paths:
                    runs[name].append(await measure(url, primary, shadow, duration_s, connections))
                    await asyncio.sleep(SLOW_MS / 1000)  # the slow shadow's copies end
    return table(runs, connections)


async def measure(
    url: str, primary: Answering, shadow: Answering | None, duration_s: float, connections: int
) -> dict[str, float]:
    asked, copied = primary.calls, shadow.calls if shadow is not None else 0
    steps: list[Callable[[], Awaitable[dict[str, float]]]] = [
        lambda: one_at_a_time(url, duration_s),
        lambda: loaded(url, duration_s, connections),
    ]
    figures: dict[str, float] = {}
    for step in steps:
        figures.update(await step())
    asked = primary.calls - asked
    copied = (shadow.calls - copied) if shadow is not None else 0
    figures["copied"] = 100 * copied / asked if asked else 0.0
    return figures


def table(runs: dict[str, list[dict[str, float]]], connections: int) -> list[str]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    def copied(name: str) -> str:
        return (
            f"{med(name, 'copied'):.0f}%"
            if "mirror answering" in name or "holding" in name
            else "-"
        )

    return [
        "| path | one at a time: p50 ms | p99 ms | "
        f"{connections} connections: answers/s | p99 ms | calls copied to the mirror |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {med(name, 'p50'):.2f} | {med(name, 'p99'):.2f} | "
            f"{med(name, 'rps'):.0f} | {med(name, 'load_p99'):.2f} | "
            f"{copied(name)} |"
            for name in runs
        ),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    args = parser.parse_args()
    lines = asyncio.run(main(args.duration, args.rounds, args.connections))
    print("\n".join(lines))
    command = (
        f"python -m bench.bench_mirror --duration {args.duration:g} --rounds {args.rounds} "
        f"--connections {args.connections}"
    )
    update_section(
        "mirror",
        "## Shadow traffic (`routes[].mirror`)\n\n"
        f"`{command}` on {machine()}. A primary backend answering each call after "
        f"{SERVICE_MS:g} ms; gateways as processes of their own, copying every call to a "
        f"shadow that answers in {SERVICE_MS:g} ms or holds each copy {SLOW_MS:g} ms "
        f"(`max_in_flight: {MAX_IN_FLIGHT}`: the copies past it are shed). First one call at "
        f"a time on one connection, then {args.connections} connections sending as fast "
        "as they are answered; the last column is the share of the primary's calls the "
        "shadow got. Each figure is the median over the rounds, in which the paths take "
        "turns.\n\n" + "\n".join(lines),
    )
