"""Hedged requests (``backends.<name>.hedge``): what a second endpoint asked after the usual
answer time saves the tail of a fleet whose instances stall now and then.

    python -m bench.bench_hedge [--duration 10] [--rounds 3] [--connections 8]

Three embedding servers (TEI, or vLLM's ``/v1/embeddings``): an answer takes
``SERVICE_MS``, and each server now and then stalls for ``STALL_MS`` (a garbage collection,
a noisy neighbour, a GPU throttling its clocks), holding every request it has meanwhile: a
stall starts on a request with probability ``STALL_P`` when none is running.  Clients send
single-input embedding calls over keep-alive connections, each answered before the next.
The paths, taking turns in each round:

- direct: each client connection to one server, in turn (what a Service's round robin
  does);
- the gateway (a process of its own) over the three as endpoints, ``least_request``;
- the same with ``hedge: {}`` (after the 95th percentile of recent answer times, at most
  5% more calls);
- the same with ``hedge: {after_ms: HEDGE_MS, max_ratio: 0.1}``.

Each row gives answers a second, their latency (p50, p99, p99.9), and upstream calls per
100 answers (the hedges' extra load).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from typing import Any

from aiohttp import web

from bench.common import machine, update_section
from bench.plumbing import Runs, closed_loop, gateway, medians, rounds_args, rounds_command, serving

SERVICE_MS = 4.0
STALL_MS = 50.0
STALL_P = 0.008
HEDGE_MS = 15
EMBEDDING = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [1.0]}]}


class StallingServer:
    """An embedding server that answers in ``SERVICE_MS`` and now and then stalls."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._stalled_until = 0.0
        self.calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.embed)
        return app

    async def embed(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        now = time.perf_counter()
        if now >= self._stalled_until and self._rng.random() < STALL_P:
            self._stalled_until = now + STALL_MS / 1000
        await asyncio.sleep(max(0.0, self._stalled_until - now) + SERVICE_MS / 1000)
        return web.json_response(EMBEDDING)


def policy(urls: list[str], hedge: dict[str, Any] | None) -> dict[str, Any]:
    backend: dict[str, Any] = {"endpoints": urls}
    if hedge is not None:
        backend["hedge"] = hedge
    return {
        "backends": {"fleet": backend},
        "routes": [{"match": {"path": "/v1/*"}, "backend": "fleet"}],
    }


async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
    """Single-input embedding calls on ``connections`` connections."""
    body = {"model": "embedder", "input": "hello"}
    latencies, elapsed, _ = await closed_loop(
        urls, "/v1/embeddings", lambda: body, duration_s, connections
    )
    s = sorted(latencies)
    return {
        "answers": len(s),
        "rps": len(s) / elapsed,
        "p50": statistics.median(s),
        "p99": s[int(0.99 * (len(s) - 1))],
        "p999": s[int(0.999 * (len(s) - 1))],
    }


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    servers = [StallingServer(seed) for seed in range(3)]
    async with serving(*(s.app() for s in servers)) as urls:
        async with (
            gateway(policy(urls, None)) as plain,
            gateway(policy(urls, {})) as adaptive,
            gateway(policy(urls, {"after_ms": HEDGE_MS, "max_ratio": 0.1})) as fixed,
        ):
            paths = {
                "direct, each connection to one server": urls,
                "gateway, no hedge": [plain],
                "gateway, `hedge: {}` (p95 of recent answers, at most 5% more calls)": [adaptive],
                f"gateway, `hedge: {{after_ms: {HEDGE_MS}, max_ratio: 0.1}}`": [fixed],
            }
            runs: Runs = {name: [] for name in paths}
            for target in (plain, adaptive, fixed):  # connections made, answer times learned
                await load([target], 1.0, connections)
            for _ in range(rounds):
                for name, targets in paths.items():
                    calls = sum(s.calls for s in servers)
                    figures = await load(targets, duration_s, connections)
                    calls = sum(s.calls for s in servers) - calls
                    figures["calls"] = 100 * calls / max(1, figures["answers"])
                    runs[name].append(figures)
    return medians(runs, COLUMNS)


COLUMNS = (
    ("answers/s", "rps", ".0f"),
    ("p50 ms", "p50", ".1f"),
    ("p99 ms", "p99", ".1f"),
    ("p99.9 ms", "p999", ".1f"),
    ("upstream calls per 100 answers", "calls", ".1f"),
)


if __name__ == "__main__":
    args = rounds_args(__doc__, 10.0, 8)
    lines = asyncio.run(main(args.duration, args.rounds, args.connections))
    print("\n".join(lines))
    command = rounds_command("bench_hedge", args)
    update_section(
        "hedge",
        "## Hedged requests (`backends.<name>.hedge`)\n\n"
        f"`{command}` on {machine()}. Three embedding servers answer in {SERVICE_MS:g} ms; "
        f"each stalls now and then for {STALL_MS:g} ms, holding every request it has "
        f"meanwhile (a stall starts on {STALL_P:.0%} of the requests arriving while none "
        f"runs). {args.connections} connections send single-input embedding calls, each "
        "answered before the next; the gateway runs as a process of its own. Each figure is "
        "the median over the rounds, in which the paths take turns.\n\n" + "\n".join(lines),
    )
