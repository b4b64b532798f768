"""Greedy questions to TGI's and SGLang's own APIs, cached by the gateway
(``cache.own_apis``).

    python -m bench.bench_tgi [--duration 10] [--rounds 3] [--connections 16]

The sim speaks TGI's and SGLang's ``/generate`` (``gateway/sim/tgi_api.py``,
``sglang_api.py``): a model on one GPU slot, ``BASE_MS`` a call plus ``TOKEN_MS`` a token,
answering ``NEW_TOKENS`` tokens.  Clients ask it greedy questions as each server's clients
do (TGI's ``{"inputs": ..., "parameters": {...}}``, no parameter that samples; SGLang's
``{"text": ..., "sampling_params": {"temperature": 0, ...}}``), drawn from ``QUESTIONS`` by
popularity (Zipf, s = 1, a fixed seed), over keep-alive connections, each answered before
the next.  For each API in turn, the paths, taking turns in each round:

- direct: to the sim;
- the gateway (a process of its own) without a cache;
- the gateway caching the route (``cache: {ttl_s: 600}``; its ``own_apis`` on, the
  default), its cache warmed by nothing but the rounds before.

Each row gives answers a second, latency and model calls per 100 answers.
"""

from __future__ import annotations

import random
from typing import Any

from bench.common import machine, update_section
from bench.plumbing import (
    ANSWERS_S,
    CALLS_PER_100,
    P50_MS,
    P99_MS,
    Runs,
    closed_loop,
    figures_of,
    gateway,
    medians,
    rounds_command,
    rounds_of,
    run_rounds,
    serving,
)
from gateway.sim import SimConfig
from gateway.sim.openai_api import ENGINE
from gateway.sim.server import build_app

BASE_MS = 5.0
TOKEN_MS = 1.0
NEW_TOKENS = 16
QUESTIONS = 2_000
PATH = "/generate"


def requests(api: str, seed: int = 7) -> Any:
    """Each call's body: one question, drawn by Zipf popularity, asked greedy of ``api``."""
    draw = random.Random(seed)
    weights = [1 / rank for rank in range(1, QUESTIONS + 1)]
    numbers = list(range(QUESTIONS))

    def body() -> dict[str, Any]:
        question = f"Which of our jackets suits customer {draw.choices(numbers, weights)[0]}?"
        if api == "SGLang":
            sampling = {"temperature": 0, "max_new_tokens": NEW_TOKENS}
            return {"text": question, "sampling_params": sampling}
        return {"inputs": question, "parameters": {"max_new_tokens": NEW_TOKENS, "details": True}}

    return body


def policy(url: str, cache: bool) -> dict[str, Any]:
    route: dict[str, Any] = {"match": {"path": "*"}, "backend": "tgi"}
    if cache:
        route["cache"] = {"ttl_s": 600}
    return {"backends": {"tgi": {"url": url, "model_version": "tgi@1"}}, "routes": [route]}


APIS = ("TGI", "SGLang")


def loading(api: str) -> Any:
    """The load of ``api``'s clients: its greedy questions."""
    body = requests(api)

    async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
        latencies, elapsed, failed = await closed_loop(urls, PATH, body, duration_s, connections)
        if failed:
            raise RuntimeError(f"{failed} calls failed")
        return figures_of(latencies, elapsed)

    return load


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    config = SimConfig(base_ms=BASE_MS, token_ms=TOKEN_MS, answer_tokens=NEW_TOKENS)
    app = build_app(config)
    engine = app[ENGINE]
    async with serving(app) as (url,):
        async with gateway(policy(url, False)) as plain, gateway(policy(url, True)) as cached:
            runs: Runs = {}
            for api in APIS:
                paths = {
                    f"{api}: direct, the model server": [url],
                    f"{api}: gateway, no cache": [plain],
                    f"{api}: gateway, `cache: {{ttl_s: 600}}` (`own_apis`)": [cached],
                }
                runs |= await rounds_of(
                    paths,
                    loading(api),
                    lambda: engine.counters.requests,
                    duration_s,
                    rounds,
                    connections,
                )
    return medians(runs, (ANSWERS_S, P50_MS, P99_MS, CALLS_PER_100))


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 10.0, 16, main)
    update_section(
        "tgi",
        "## Greedy questions to TGI's and SGLang's own APIs, cached (`cache.own_apis`)\n\n"
        f"`{rounds_command('bench_tgi', args)}` on {machine()}. The sim speaks TGI's and "
        f"SGLang's `/generate` on one GPU slot, {BASE_MS:g} ms a call and {TOKEN_MS:g} ms a "
        f"token, {NEW_TOKENS} tokens an answer; {args.connections} connections ask it greedy "
        "questions as each server's clients do (TGI's: no parameter that samples, `details` "
        "asked; SGLang's: `sampling_params.temperature` 0), drawn "
        f"from {QUESTIONS:,} by Zipf popularity (s = 1, a fixed seed), each answered before "
        "the next; the gateway runs as a process of its own. Each figure is the median over "
        "the rounds, in which the paths take turns (one API, then the other); the cached "
        "path's entries persist from round to round. Before each server's generations were "
        "read for greediness, its last row was its second: every call to TGI's or SGLang's "
        "own API passed a caching route uncached.\n\n" + "\n".join(lines),
    )
