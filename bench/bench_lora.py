"""LoRA affinity (``balance: kv_aware``): what sending an adapter's requests to the servers
already serving it saves a fleet that must swap adapters in and out of GPU memory.

    python -m bench.bench_lora [--duration 10] [--rounds 3] [--connections 12]

Three model servers, each as vLLM serves LoRA adapters: at most ``MAX_LORA`` adapters in
GPU memory, the least recently used evicted to load another, which stalls the server's
whole batch for ``LOAD_MS``; a request itself takes ``SERVICE_MS``.  Each exports vLLM's
``vllm:lora_requests_info`` (the adapters of its running and waiting requests, and
``max_lora``) and its queue.  Clients ask for ``ADAPTERS`` adapters, each request one of
them at random.  The paths, taking turns in each round:

- direct: each client connection to one server, in turn (what a Service's round robin
  does);
- the gateway (a process of its own) over the three as endpoints, ``least_request``:
  blind to adapters;
- the same with ``kv_aware``, its servers scraped every 100 ms: LoRA affinity.

Each row gives answers a second, their latency, and the adapter loads per 100 requests.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, OrderedDict
from typing import Any

from aiohttp import web

from bench.common import machine, update_section
from bench.plumbing import (
    ANSWER,
    ANSWERS_S,
    P50_MS,
    P99_MS,
    Runs,
    closed_loop,
    gateway,
    medians,
    pcts,
    rounds_command,
    run_rounds,
    serving,
)

MAX_LORA = 2
LOAD_MS = 40.0
SERVICE_MS = 5.0
ADAPTERS = 6
SCRAPE_MS = 100


class LoraServer:
    """One model server holding at most ``MAX_LORA`` adapters; a load stalls every request."""

    def __init__(self) -> None:
        self.loaded: OrderedDict[str, None] = OrderedDict()
        self.active: Counter[str] = Counter()
        self.loads = 0
        self.served = 0
        self._gpu = asyncio.Lock()  # a load stalls the batch

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def metrics(self, _: web.Request) -> web.Response:
        running = ",".join(a for a, n in self.active.items() if n > 0)
        waiting = sum(self.active.values())
        return web.Response(
            text=f'vllm:num_requests_waiting{{model_name="base"}} {max(0, waiting - 8)}\n'
            f'vllm:kv_cache_usage_perc{{model_name="base"}} 0.1\n'
            f'vllm:lora_requests_info{{max_lora="{MAX_LORA}",running_lora_adapters='
            f'"{running}",waiting_lora_adapters=""}} {time.time()}\n'
        )

    async def complete(self, request: web.Request) -> web.Response:
        adapter = (await request.json())["model"]
        self.active[adapter] += 1
        try:
            async with self._gpu:
                if adapter in self.loaded:
                    self.loaded.move_to_end(adapter)
                else:
                    if len(self.loaded) >= MAX_LORA:
                        self.loaded.popitem(last=False)
                    self.loads += 1
                    await asyncio.sleep(LOAD_MS / 1000)
                    self.loaded[adapter] = None
            await asyncio.sleep(SERVICE_MS / 1000)
            self.served += 1
            return web.json_response(ANSWER)
        finally:
            self.active[adapter] -= 1


def policy(urls: list[str], balance: str) -> dict[str, Any]:
    backend = {"endpoints": urls, "balance": balance, "telemetry": {"interval_ms": SCRAPE_MS}}
    return {
        "backends": {"fleet": backend},
        "routes": [{"match": {"path": "/v1/*"}, "backend": "fleet"}],
    }


async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
    """Completions, each for one of ``ADAPTERS`` adapters at random."""
    rng = random.Random(26)

    def body() -> dict[str, str]:
        return {"model": f"adapter-{rng.randrange(ADAPTERS)}", "prompt": "hi"}

    latencies, elapsed, _ = await closed_loop(
        urls, "/v1/completions", body, duration_s, connections
    )
    p50, p99, _ = pcts(latencies)
    return {"rps": len(latencies) / elapsed, "p50": p50, "p99": p99}


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    servers = [LoraServer() for _ in range(3)]
    async with serving(*(s.app() for s in servers)) as urls:
        async with (
            gateway(policy(urls, "least_request")) as blind,
            gateway(policy(urls, "kv_aware")) as affine,
        ):
            paths = {
                "direct, each connection to one server": urls,
                "gateway, `least_request`": [blind],
                "gateway, `kv_aware` (LoRA affinity)": [affine],
            }
            runs: Runs = {name: [] for name in paths}
            await load([affine], 1.0, connections)  # the gateways' first scrapes
            for _ in range(rounds):
                for name, targets in paths.items():
                    loads = sum(s.loads for s in servers)
                    served = sum(s.served for s in servers)
                    figures = await load(targets, duration_s, connections)
                    served = sum(s.served for s in servers) - served
                    figures["loads"] = 100 * (sum(s.loads for s in servers) - loads) / served
                    runs[name].append(figures)
    return medians(runs, COLUMNS)


COLUMNS = (
    ANSWERS_S,
    P50_MS,
    P99_MS,
    ("adapter loads per 100 requests", "loads", ".1f"),
)


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 10.0, 12, main)
    command = rounds_command("bench_lora", args)
    update_section(
        "lora",
        "## LoRA affinity (`balance: kv_aware`)\n\n"
        f"`{command}` on {machine()}. Three model servers as vLLM serves LoRA adapters: at "
        f"most {MAX_LORA} in GPU memory each, loading another evicts the least recently used "
        f"and stalls the server for {LOAD_MS:g} ms; a request takes {SERVICE_MS:g} ms. Each "
        "exports `vllm:lora_requests_info` (the adapters of its requests in flight). "
        f"{args.connections} connections ask for {ADAPTERS} adapters at random; the gateway "
        f"runs as a process of its own, its servers scraped every {SCRAPE_MS} ms. Each "
        "figure is the median over the rounds, in which the paths take turns.\n\n"
        + "\n".join(lines),
    )
