"""Bounds on what one call may generate (a route's ``generation``): what they cost a call,
and what they give the other clients of a model server when one client names no bound.

    python -m bench.bench_generation [--duration 5] [--rounds 3] [--connections 8]
                                     [--interactive 8]

1. **Cost.** A backend answering each chat completion after ``SERVICE_MS``; the paths take
   turns in each round: direct, the gateway without bounds, the gateway with bounds the
   calls are within (checked, sent as they came), and with bounds that clamp every call
   (its body written again).
2. **A client naming no bound, on a real model**: llama.cpp's server with Gemma 3 270M, one
   slot of ``CONTEXT`` tokens.  One client asks for long answers naming no ``max_tokens``
   (``ignore_eos``: each generates until the slot's context is full), one call after
   another; meanwhile an interactive client sends ``--interactive`` short calls
   (``max_tokens: 8``) one after another.  Directly, and through the gateway with
   ``generation: {default_max_tokens: DEFAULT_BOUND}``: the interactive calls' latency and
   the long calls' generated tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from typing import Any

import httpx

from bench.common import machine, update_section
from bench.llama_load import percentile
from bench.plumbing import (
    CHAT,
    Answering,
    chat_load,
    gateway,
    medians,
    rounds_of,
    serving,
)
from gateway.testing.llama import MODEL_ALIAS, LlamaOptions, start_servers, stop_all

SERVICE_MS = 2.0
CONTEXT = 256
"""Each llama.cpp slot's context: an unbounded call generates until it is full."""
DEFAULT_BOUND = 32
WITHIN = {"max_tokens": 64, "max_choices": 1}
CLAMPING = {"max_tokens": 4}
ASK = {**CHAT, "max_tokens": 16}


def policy(url: str, generation: dict[str, Any] | None) -> dict[str, Any]:
    route: dict[str, Any] = {"match": {"path": "/v1/*"}, "backend": "main", "coalesce": False}
    if generation is not None:
        route["generation"] = generation
    return {"backends": {"main": {"url": url}}, "routes": [route]}


load = chat_load(ASK)


async def cost(duration_s: float, rounds: int, connections: int) -> list[str]:
    server = Answering(SERVICE_MS)
    async with serving(server.app()) as (url,):
        async with (
            gateway(policy(url, None)) as plain,
            gateway(policy(url, WITHIN)) as within,
            gateway(policy(url, CLAMPING)) as clamping,
        ):
            paths = {
                "direct": [url],
                "gateway, no bounds": [plain],
                "gateway, calls within `max_tokens: 64, max_choices: 1`": [within],
                "gateway, every call clamped (`max_tokens: 4`)": [clamping],
            }
            for target in paths.values():  # connections made
                await load(target, 0.5, connections)
            runs = await rounds_of(
                paths, load, lambda: server.calls, duration_s, rounds, connections
            )
    columns = (
        ("answers/s", "rps", ".0f"),
        ("p50 ms", "p50", ".2f"),
        ("p99 ms", "p99", ".2f"),
        ("non-200", "failed", ".0f"),
    )
    return medians(runs, columns)


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL_ALIAS,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        **extra,
    }


async def hog_scene(url: str, interactive: int) -> dict[str, float]:
    """The interactive calls' latencies while a client naming no bound keeps the slot
    busy; the long calls' generated tokens."""
    long_tokens: list[int] = []
    latencies: list[float] = []
    done = asyncio.Event()

    async def hog(http: httpx.AsyncClient) -> None:
        body = chat("Write a very long story about the sea.", ignore_eos=True)
        while not done.is_set():
            answer = await http.post(url + "/v1/chat/completions", json=body)
            answer.raise_for_status()
            long_tokens.append(answer.json()["usage"]["completion_tokens"])

    async def user(http: httpx.AsyncClient) -> None:
        await asyncio.sleep(0.5)  # the first long call holds the slot
        for i in range(interactive):
            started = time.perf_counter()
            answer = await http.post(
                url + "/v1/chat/completions", json=chat(f"Say hello to {i}.", max_tokens=8)
            )
            answer.raise_for_status()
            latencies.append((time.perf_counter() - started) * 1000)
        done.set()

    async with httpx.AsyncClient(timeout=600) as http:
        hogging = asyncio.create_task(hog(http))
        await user(http)
        await hogging
    return {
        "p50": statistics.median(latencies),
        "p99": percentile(latencies, 0.99),
        "max": max(latencies),
        "long": statistics.median(long_tokens),
        "calls": float(len(long_tokens)),
    }


async def real_model(interactive: int) -> list[str]:
    options = LlamaOptions(slots=1, context_tokens_per_slot=CONTEXT, threads=1)
    servers = await asyncio.to_thread(start_servers, 1, options)
    try:
        url = servers[0].url
        bounded = policy(url, {"default_max_tokens": DEFAULT_BOUND})
        async with gateway(bounded) as via:
            direct = await hog_scene(url, interactive)
            through = await hog_scene(via, interactive)
    finally:
        with contextlib.suppress(Exception):
            stop_all(servers)
    rows = [
        ("direct (no bound)", direct),
        (f"gateway, `generation: {{default_max_tokens: {DEFAULT_BOUND}}}`", through),
    ]
    return [
        "| path | interactive p50 ms | p99 ms | max ms | tokens per long call (median) "
        "| long calls |",
        "|---|---|---|---|---|---|",
        *(
            f"| {name} | {f['p50']:.0f} | {f['p99']:.0f} | {f['max']:.0f} | {f['long']:.0f} "
            f"| {f['calls']:.0f} |"
            for name, f in rows
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--interactive", type=int, default=8)
    args = parser.parse_args()
    first = asyncio.run(cost(args.duration, args.rounds, args.connections))
    second = asyncio.run(real_model(args.interactive))
    print("\n".join([*first, "", *second]))
    command = (
        f"python -m bench.bench_generation --duration {args.duration:g} --rounds "
        f"{args.rounds} --connections {args.connections} --interactive {args.interactive}"
    )
    update_section(
        "generation",
        "## Bounds on what one call may generate (`generation`)\n\n"
        f"`{command}` on {machine()}.\n\n"
        f"What the bounds cost a call: a backend answering each chat completion after "
        f"{SERVICE_MS:g} ms; gateways as processes of their own; {args.connections} "
        "connections each sending as fast as it is answered; medians over the rounds, in "
        "which the paths take turns.\n\n" + "\n".join(first) + "\n\n"
        "What they give the other clients of a model server: llama.cpp's server with Gemma 3 "
        f"270M, one slot of {CONTEXT} tokens, one thread. One client asks for long answers "
        "naming no `max_tokens` (`ignore_eos`: each generates until the slot's context is "
        f"full), one after another; meanwhile another sends {args.interactive} short calls "
        "(`max_tokens: 8`) one after another, each waiting for the slot.\n\n" + "\n".join(second),
    )


if __name__ == "__main__":
    main()
