"""A replica joining through discovery, warmed before it takes calls
(``transport.joining``): what a scale-up costs the calls around it.

    python -m bench.bench_discovery_warmup [--rounds 3] [--cold-start-ms 1500]

Two ``gateway sim`` instances on two loopback addresses and one port, each paying
``--cold-start-ms`` on its first call after ``COLD_IDLE_S`` idle (its calls meanwhile wait
for it), as a model server whose weights or kernels are cold does.  ``CONNECTIONS``
clients send chat completions, each answered before the next; ``SCALE_AT_S`` into each run
the second instance appears (the replica an autoscaler started), and the run goes on for
``AFTER_S``.  Before each run both instances are left to go cold and the first is warmed.
The paths, taking turns in each round:

- direct: from the scale-up on, the connections alternate over the two instances (a
  Service's round robin);
- the gateway's endpoint set (its transport, in this process) over ``discovery`` of a name
  that answers the second address from the scale-up on (an injected resolver), without
  ``warmup`` requests;
- the same with a ``warmup`` request: the new endpoint is warmed before it takes calls.

The figures are over the calls that started after the scale-up: how many waited for a cold
start (took more than half of it), their p99 and the longest, and the share the new
replica served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack

import aiohttp

from bench.common import free_port, machine, process, python, update_section
from gateway.metrics import Metrics
from gateway.policy.backend import WarmupRequest
from gateway.policy.model import Backend, Discovery
from gateway.testing import FakeResolver
from gateway.transport.endpoints import EndpointSet

HOSTS = ("127.0.0.2", "127.0.0.3")
CONNECTIONS = 4
COLD_IDLE_S = 2.0
SCALE_AT_S = 1.0
AFTER_S = 4.0
ASK = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BODY = json.dumps(ASK).encode()


def sim(host: str, port: int, cold_start_ms: float) -> list[str]:
    return python(
        "-m", "gateway", "sim", "--host", host, "--port", str(port), "--slots", "4",
        "--base-ms", "5", "--token-ms", "0.5", "--cold-start-ms", f"{cold_start_ms:g}",
        "--cold-idle-s", f"{COLD_IDLE_S:g}",
    )  # fmt: skip


async def listening(host: str, port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)
        else:
            writer.close()
            return


Send = Callable[[int, bool], Awaitable[str]]
"""One call on connection ``i``, ``scaled`` or not: the host that answered it."""


async def run(
    send: Send, started: float, scale: Callable[[], None], cold_ms: float
) -> dict[str, float]:
    """``CONNECTIONS`` clients until ``SCALE_AT_S + AFTER_S``; the scale-up at
    ``SCALE_AT_S``: the figures of the calls that began after it."""
    after: list[tuple[float, str]] = []
    scaled = False
    stop = started + SCALE_AT_S + AFTER_S

    async def client(i: int) -> None:
        while time.perf_counter() < stop:
            began = time.perf_counter()
            was_scaled = scaled
            host = await send(i, was_scaled)
            if was_scaled:
                after.append(((time.perf_counter() - began) * 1000, host))

    async def scaler() -> None:
        nonlocal scaled
        await asyncio.sleep(max(0.0, started + SCALE_AT_S - time.perf_counter()))
        scale()
        scaled = True

    await asyncio.gather(scaler(), *(client(i) for i in range(CONNECTIONS)))
    latencies = sorted(ms for ms, _ in after)
    return {
        "calls": len(latencies),
        "cold": sum(1 for ms in latencies if ms >= cold_ms / 2),
        "p99": latencies[int(0.99 * (len(latencies) - 1))],
        "max": latencies[-1],
        "new": 100 * sum(1 for _, host in after if host == HOSTS[1]) / len(after),
    }


async def direct(port: int, cold_ms: float) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:

        async def send(i: int, scaled: bool) -> str:
            host = HOSTS[i % 2] if scaled else HOSTS[0]
            async with session.post(f"http://{host}:{port}/v1/chat/completions", json=ASK) as r:
                await r.read()
            return host

        return await run(send, time.perf_counter(), lambda: None, cold_ms)


async def through_gateway(port: int, warmup: bool, cold_ms: float) -> dict[str, float]:
    resolver = FakeResolver({"bench.svc": [HOSTS[0]]})
    backend = Backend(
        "sim",
        discovery=Discovery("bench.svc", port, interval_s=0.05),
        warmup=(WarmupRequest("/v1/chat/completions", body=ASK),) if warmup else (),
        warmup_timeout_s=30.0,
    )
    endpoints = EndpointSet(backend, Metrics())
    endpoints.follow(resolver)
    await endpoints.resolved.wait()
    headers = [("Content-Type", "application/json")]

    async def send(i: int, scaled: bool) -> str:
        reply = await endpoints.send(
            backend, "POST", "/v1/chat/completions", headers, BODY, streaming=False
        )
        return next(h for h in HOSTS if h in reply.endpoint)

    try:
        await asyncio.sleep(0.2)  # the first endpoint's own warm-up (it is warm already)
        scale = lambda: resolver.set("bench.svc", list(HOSTS))  # noqa: E731
        return await run(send, time.perf_counter(), scale, cold_ms)
    finally:
        await endpoints.aclose()


async def main(rounds: int, cold_start_ms: float) -> list[str]:
    port = free_port()
    with ExitStack() as stack:
        for host in HOSTS:
            stack.enter_context(process(sim(host, port, cold_start_ms)))
        for host in HOSTS:
            await listening(host, port)
        paths: dict[str, Callable[[], Awaitable[dict[str, float]]]] = {
            "direct, a Service's round robin after the scale-up": lambda: direct(
                port, cold_start_ms
            ),
            "gateway, `discovery` without `warmup`": lambda: through_gateway(
                port, False, cold_start_ms
            ),
            "gateway, `discovery` with a `warmup` request": lambda: through_gateway(
                port, True, cold_start_ms
            ),
        }
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in paths}
        async with aiohttp.ClientSession() as session:
            for _ in range(rounds):
                for name, path in paths.items():
                    await asyncio.sleep(COLD_IDLE_S + 0.5)  # both instances go cold
                    url = f"http://{HOSTS[0]}:{port}/v1/chat/completions"
                    async with session.post(url, json=ASK) as r:  # the first is warmed
                        await r.read()
                    runs[name].append(await path())
    return table(runs, cold_start_ms)


def table(runs: dict[str, list[dict[str, float]]], cold_start_ms: float) -> list[str]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    return [
        f"| path | calls after the scale-up | waited for a cold start (>= {cold_start_ms / 2:g} "
        "ms) | p99 ms | longest ms | served by the new replica |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {med(name, 'calls'):.0f} | {med(name, 'cold'):.0f} | "
            f"{med(name, 'p99'):.0f} | {med(name, 'max'):.0f} | {med(name, 'new'):.0f}% |"
            for name in runs
        ),
    ]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cold-start-ms", type=float, default=1500.0)
    args = parser.parse_args()
    lines = asyncio.run(main(args.rounds, args.cold_start_ms))
    print("\n".join(lines))
    command = (
        f"python -m bench.bench_discovery_warmup --rounds {args.rounds} "
        f"--cold-start-ms {args.cold_start_ms:g}"
    )
    update_section(
        "discovery_warmup",
        "## A replica joining through discovery, warmed first (`warmup`)\n\n"
        f"`{command}` on {machine()}. Two `gateway sim` instances on two loopback "
        f"addresses, each paying {args.cold_start_ms:g} ms on its first call after "
        f"{COLD_IDLE_S:g} s idle; {CONNECTIONS} connections send chat completions, each "
        f"answered before the next; {SCALE_AT_S:g} s into each run the second instance "
        f"appears, and the run goes on for {AFTER_S:g} s. Both instances go cold before "
        "each run and the first is warmed. The gateway's endpoint set runs in this process "
        "with an injected resolver. The figures are over the calls that started after the "
        "scale-up; each is the median over the rounds, in which the paths take "
        "turns.\n\n" + "\n".join(lines),
    )
