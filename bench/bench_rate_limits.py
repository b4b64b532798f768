"""Per-tenant rate limits and spend budgets (``rate_limit``): what counting costs a call, and
how closely a budget holds its tenant.

    python -m bench.bench_rate_limits [--duration 5] [--rounds 3] [--connections 8]

A backend answers each chat completion after ``SERVICE_MS`` with its ``usage`` (3 prompt
tokens, 10 generated), priced ``PRICE`` (so an answer costs ``ANSWER_COST``).  The gateways
run as processes of their own; the Redis ones share one local ``redis-server``.  The paths,
taking turns in each round, under limits no call reaches (so every call is counted and
none refused):

- direct: straight to the backend;
- the gateway without a limit;
- a rate limit of requests and tokens (``requests_per_s``, ``tokens_per_min``), in memory;
- a spend budget (``cost_per_day``) beside it, in memory;
- the same in Redis (``store: redis``: one script call to admit, one to settle);
- the same in memory on llama.cpp's own API (``/completion``: its bound ``n_predict``, its
  answer's counts ``tokens_evaluated`` and ``tokens_predicted``), and direct to it.

Then the budget's hold: tenants with a day's budget worth ``BUDGET_ANSWERS`` answers send
as fast as they are answered on ``--connections`` connections, and the answers they got
before the first 429 and in all are counted against that worth: on chat completions, and
on llama.cpp's own API.
"""

from __future__ import annotations

import asyncio
import statistics
import uuid
from typing import Any

import aiohttp

from bench.common import machine, update_section
from bench.plumbing import (
    ANSWERS_S,
    CHAT,
    Answering,
    chat_load,
    closed_loop,
    figures_of,
    gateway,
    medians,
    rounds_command,
    rounds_of,
    run_rounds,
    serving,
)
from tests.redis_server import RedisServer

SERVICE_MS = 2.0
PRICE = {"input_per_million": 1000.0, "output_per_million": 2000.0}
ANSWER_COST = (3 * 1000.0 + 10 * 2000.0) / 1e6
"""What one answer costs at ``PRICE``: 3 prompt tokens and 10 generated."""
BUDGET_ANSWERS = 400
"""The answers a budget of the hold test is worth, at ``ANSWER_COST`` each."""
ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13},
}
ASK = {**CHAT, "max_tokens": 10}
NATIVE = "/completion"
NATIVE_ASK = {"prompt": "Say hello", "n_predict": 10}


def policy(url: str, redis: str, limit: dict[str, Any] | None) -> dict[str, Any]:
    route: dict[str, Any] = {"match": {"path": "*"}, "backend": "main", "coalesce": False}
    if limit is not None:
        route["rate_limit"] = limit
    return {
        "backends": {"main": {"url": url, "price": PRICE}},
        "routes": [route],
        "redis": {"url": redis},
    }


RATES = {"requests_per_s": 1e6, "tokens_per_min": 1e9}
BUDGET = {**RATES, "cost_per_day": 1e9}


chat = chat_load(ASK)


async def native_load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
    """The closed-loop load posting ``NATIVE_ASK`` to llama.cpp's ``/completion``."""
    latencies, elapsed, failed = await closed_loop(
        urls, NATIVE, lambda: NATIVE_ASK, duration_s, connections
    )
    return {**figures_of(latencies, elapsed), "failed": float(failed)}


async def load(targets: list[str], duration_s: float, connections: int) -> dict[str, float]:
    """Each path's load: a path (``(url, NATIVE)``) to ``/completion`` gets the native one."""
    urls = [t.removesuffix(NATIVE) for t in targets]
    native = any(t.endswith(NATIVE) for t in targets)
    return await (native_load if native else chat)(urls, duration_s, connections)


async def hold(url: str, connections: int, path: str = "/v1/chat/completions") -> dict[str, float]:
    """A fresh tenant with a day's budget worth ``BUDGET_ANSWERS`` answers, sending on
    ``connections`` connections until refused ten times each: its answers before the first
    429, and in all."""
    headers = {"Authorization": f"Bearer {uuid.uuid4()}"}
    answered, first_refusal = 0, None

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal answered, first_refusal
        refused = 0
        while refused < 10:
            body = NATIVE_ASK if path == NATIVE else ASK
            async with session.post(url + path, json=body) as answer:
                await answer.read()
                if answer.status == 200:
                    answered += 1
                else:
                    refused += 1
                    first_refusal = answered if first_refusal is None else first_refusal

    async with aiohttp.ClientSession(headers=headers) as session:
        await asyncio.gather(*(client(session) for _ in range(connections)))
    return {"before": float(first_refusal or answered), "answered": float(answered)}


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    server = Answering(SERVICE_MS, ANSWER)
    budget = {"cost_per_day": BUDGET_ANSWERS * ANSWER_COST}
    with RedisServer() as store:
        async with serving(server.app()) as (url,):
            async with (
                gateway(policy(url, store.url, None)) as plain,
                gateway(policy(url, store.url, RATES)) as rates,
                gateway(policy(url, store.url, BUDGET)) as spend,
                gateway(policy(url, store.url, {**BUDGET, "store": "redis"})) as shared,
                gateway(policy(url, store.url, budget)) as held,
                gateway(policy(url, store.url, {**budget, "store": "redis"})) as held_shared,
            ):
                paths = {
                    "direct": [url],
                    "gateway, no limit": [plain],
                    "gateway, `requests_per_s` and `tokens_per_min` in memory": [rates],
                    "gateway, the same and `cost_per_day` in memory": [spend],
                    "gateway, the same in Redis (`store: redis`)": [shared],
                    "direct, llama.cpp's own `/completion`": [url + NATIVE],
                    "gateway, `cost_per_day` in memory, on llama.cpp's own `/completion`": [
                        spend + NATIVE
                    ],
                }
                for target in paths.values():  # connections made, Redis scripts loaded
                    await load(target, 0.5, connections)
                runs = await rounds_of(
                    paths, load, lambda: server.calls, duration_s, rounds, connections
                )
                held_runs = {
                    "in memory": [await hold(held, connections) for _ in range(rounds)],
                    "in Redis": [await hold(held_shared, connections) for _ in range(rounds)],
                    "in memory, on llama.cpp's own `/completion`": [
                        await hold(held, connections, NATIVE) for _ in range(rounds)
                    ],
                }
    return [*medians(runs, COLUMNS), "", *hold_table(held_runs, connections)]


COLUMNS = (
    ANSWERS_S,
    ("p50 ms", "p50", ".2f"),
    ("p99 ms", "p99", ".2f"),
    ("refused", "failed", ".0f"),
)


def hold_table(runs: dict[str, list[dict[str, float]]], connections: int) -> list[str]:
    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    return [
        f"| `cost_per_day` worth {BUDGET_ANSWERS} answers, {connections} connections | "
        "answers before the first 429 | answers in all |",
        "|---|---|---|",
        *(f"| {name} | {med(name, 'before'):.0f} | {med(name, 'answered'):.0f} |" for name in runs),
    ]


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 5.0, 8, main)
    update_section(
        "rate_limits",
        "## Rate limits and spend budgets (`rate_limit`)\n\n"
        f"`{rounds_command('bench_rate_limits', args)}` on {machine()}. A backend answering "
        f"each chat completion after {SERVICE_MS:g} ms with its usage (3 prompt tokens, 10 "
        f"generated: {ANSWER_COST:g} at its price); gateways as processes of their own, the "
        "Redis one on a local redis-server. First every path under limits no call reaches "
        f"(each call counted, none refused), {args.connections} connections each sending as "
        "fast as it is answered; then tenants with a day's budget worth "
        f"{BUDGET_ANSWERS} answers sending on {args.connections} connections until "
        "refused. Each figure is the median over the rounds, in which the paths take "
        "turns.\n\n" + "\n".join(lines),
    )
