"""The demo's cold-start scene: two replicas of a model that goes cold when idle.

Each simulated instance pays ``cold_start_ms`` on its first call after ``cold_idle_s``
without one (``gateway sim --cold-start-ms``), as a real model server whose weights or
kernels went cold does.  Both sides serve a short burst, sit idle long enough for the models
to go cold, then take a second burst:

* without the pool: a backend of two endpoints, round robin, no warm-up: the second burst's
  first requests wait for the cold starts;
* with the pool (``pool: {core: 1}`` and a ``warmup`` request): the core endpoint is kept
  warm while idle (a warm-up request every half ``idle_timeout_s``), and the standby one is
  warmed off the request path before it takes any request, so no user request pays.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.app import Gateway
from gateway.policy.load import parse_policy_text
from gateway.policy.watch import PolicySource
from gateway.sim import SimConfig, start_sim
from gateway.transport.warmup import warm_up

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass(frozen=True, slots=True)
class ColdStartOptions:
    """How cold the model gets and how the scene's traffic runs."""

    cold_start_ms: float = 1500.0
    cold_idle_s: float = 2.0
    idle_s: float = 3.0
    burst_s: float = 1.5
    clients: int = 4


def scene_policy(urls: list[str], pooled: bool, options: ColdStartOptions) -> str:
    """One backend of two endpoints; ``pooled``: a pool of one core and a warm-up request."""
    extra = ""
    if pooled:
        # keep-warm ticks every half of it, on an endpoint idle that long: the longest gap
        # between two calls is then under 0.6 x cold_idle_s, well before the model is cold
        keep_s = 0.6 * options.cold_idle_s
        extra = (
            f", pool: {{core: 1, idle_timeout_s: {keep_s:g}, scale_up_inflight: 2}}, "
            "warmup: [{path: /v1/chat/completions, "
            "body: {model: sim-model, messages: [{role: user, content: warm}], max_tokens: 1}}]"
        )
    return (
        f"backends: {{main: {{endpoints: [{', '.join(urls)}], balance: round_robin{extra}}}}}\n"
        "routes: [{backend: main}]\n"
    )


async def _burst(url: str, clients: int, duration_s: float) -> list[float]:
    """Closed-loop clients for ``duration_s``; each answer's latency in ms."""
    latencies: list[float] = []
    deadline = time.perf_counter() + duration_s

    async def client(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
            latencies.append((time.perf_counter() - started) * 1000)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return latencies


async def run_coldstart(options: ColdStartOptions = ColdStartOptions()) -> dict[str, Any]:
    """Run the scene; the second burst's latencies on each side."""
    config = SimConfig(
        port=0,
        slots=2,
        token_ms=1.0,
        cold_start_ms=options.cold_start_ms,
        cold_idle_s=options.cold_idle_s,
    )
    sims = [await start_sim(config) for _ in range(4)]
    gateways: list[Gateway] = []
    try:
        urls = []
        for pooled, pair in ((False, sims[:2]), (True, sims[2:])):
            text = scene_policy([s.url for s in pair], pooled, options)
            gateway = Gateway(PolicySource(fixed=parse_policy_text(text)))
            gateways.append(gateway)
            url, _ = await gateway.start("127.0.0.1", 0, "127.0.0.1", 0, warmup=False)
            if pooled:  # as `gateway serve` does before it reports ready
                await warm_up(gateway.transport, gateway.snapshot.policy.backends)
            urls.append(url)
        await asyncio.gather(*(_burst(u, options.clients, options.burst_s) for u in urls))
        await asyncio.sleep(options.idle_s)  # the models go cold here
        without, with_pool = await asyncio.gather(
            *(_burst(u, options.clients, options.burst_s) for u in urls)
        )
    finally:
        for gateway in gateways:
            await gateway.shutdown(1.0)
        for sim in sims:
            await sim.close()

    def summary(latencies: list[float]) -> dict[str, float]:
        ordered = sorted(latencies) or [0.0]
        p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
        slow = sum(1 for v in ordered if v >= options.cold_start_ms * 0.5)
        return {
            "requests": len(latencies),
            "p99_ms": round(p99, 1),
            "max_ms": round(ordered[-1], 1),
            "cold_waits": slow,
        }

    return {
        "options": dataclasses.asdict(options),
        "without": summary(without),
        "with": summary(with_pool),
    }


def format_coldstart(result: dict[str, Any]) -> str:
    o, a, b = result["options"], result["without"], result["with"]
    return "\n".join(
        [
            f"cold-start scene: two replicas that go cold after {o['cold_idle_s']:g} s idle "
            f"({o['cold_start_ms']:g} ms to warm); a burst, {o['idle_s']:g} s idle, a burst",
            f"{'second burst':34}{'no pool':>10}{'pool + warm-up':>16}",
            f"{'requests answered':34}{a['requests']:>10}{b['requests']:>16}",
            f"{'p99 latency (ms)':34}{a['p99_ms']:>10.1f}{b['p99_ms']:>16.1f}",
            f"{'max latency (ms)':34}{a['max_ms']:>10.1f}{b['max_ms']:>16.1f}",
            f"{'requests that paid a cold start':34}{a['cold_waits']:>10}{b['cold_waits']:>16}",
        ]
    )
