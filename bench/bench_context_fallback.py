"""A call too long for its model's context, sent to one with a longer context
(``routes[].context_fallback``), on two real llama.cpp servers.

    python -m bench.bench_context_fallback [--calls 20]

Gemma 3 270M behind two llama.cpp servers of one slot each: ``short`` with a context of
``SHORT_CONTEXT`` tokens, ``long`` with ``LONG_CONTEXT``.  Calls alternate between a short
prompt (fits both) and a long one (about ``LONG_WORDS`` tokens: fits only ``long``), each
generating ``MAX_TOKENS`` tokens, one after another.  The paths:

- direct, the client falling back itself: to ``short``, and on its 400 to ``long`` (what a
  client must do without the gateway);
- direct to ``long`` for every call (no fallback needed: the ceiling);
- through the gateway: to ``short`` with ``context_fallback: [long]``.

Each path's latency per kind of call and its errors.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx

from bench.common import machine, update_section
from bench.llama_load import chat, percentile
from bench.plumbing import gateway
from gateway.testing.llama import LlamaOptions, start_servers, stop_all

SHORT_CONTEXT = 256
LONG_CONTEXT = 1024
LONG_WORDS = 400
MAX_TOKENS = 4
CHAT = "/v1/chat/completions"


def body(long: bool, i: int) -> dict[str, Any]:
    text = ("word " * LONG_WORDS if long else "") + f"Say hello to {i}."
    return chat(None, text, MAX_TOKENS) | {"cache_prompt": False}


async def run(urls: list[str], calls: int) -> dict[str, list[float] | int]:
    """``calls`` calls alternating short and long, each to ``urls[0]`` and, on a 400, to
    the next: the latencies of each kind and the answers other than 200."""
    short: list[float] = []
    long: list[float] = []
    errors = 0
    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(calls):
            is_long = i % 2 == 1
            started = time.perf_counter()
            for url in urls:
                answer = await http.post(url + CHAT, json=body(is_long, i))
                if answer.status_code != 400:
                    break
            if answer.status_code != 200:
                errors += 1
                continue
            (long if is_long else short).append((time.perf_counter() - started) * 1000)
    return {"short": short, "long": long, "errors": errors}


async def main(calls: int) -> list[str]:
    options = [
        LlamaOptions(slots=1, context_tokens_per_slot=context, threads=1)
        for context in (SHORT_CONTEXT, LONG_CONTEXT)
    ]
    servers = await asyncio.gather(
        *(asyncio.to_thread(start_servers, 1, option) for option in options)
    )
    short, long = servers[0][0].url, servers[1][0].url
    try:
        policy = {
            "backends": {"short": {"url": short}, "long": {"url": long}},
            "routes": [{"backend": "short", "context_fallback": ["long"]}],
        }
        async with gateway(policy) as via:
            await run([via], 4)  # connections made, prompts' first run
            paths = {
                "direct, the client falling back itself (short, then long on a 400)": [
                    short,
                    long,
                ],
                "direct to long for every call (the ceiling)": [long],
                "gateway to short with `context_fallback: [long]`": [via],
            }
            results = {name: await run(targets, calls) for name, targets in paths.items()}
    finally:
        for started in servers:
            stop_all(started)
    lines = [
        "| path | short prompt p50 ms | p99 ms | long prompt p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        s, lg = result["short"], result["long"]
        assert isinstance(s, list) and isinstance(lg, list)
        lines.append(
            f"| {name} | {statistics.median(s):.1f} | {percentile(s, 0.99):.1f} | "
            f"{statistics.median(lg):.1f} | {percentile(lg, 0.99):.1f} | {result['errors']} |"
        )
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    lines = asyncio.run(main(args.calls))
    print("\n".join(lines))
    update_section(
        "context_fallback",
        "## A call too long for its model's context (`context_fallback`)\n\n"
        f"`python -m bench.bench_context_fallback --calls {args.calls}` on {machine()}. "
        "Gemma 3 270M behind two llama.cpp servers of one slot and one thread each, with "
        f"contexts of {SHORT_CONTEXT} and {LONG_CONTEXT} tokens. {args.calls} calls one after "
        "another, alternating a short prompt (fits both) and a long one (about "
        f"{LONG_WORDS} tokens: only the longer context holds it), each generating "
        f"{MAX_TOKENS} tokens. Without the gateway, a client must catch the 400 and ask "
        "the other server itself; through the gateway it asks once.\n\n" + "\n".join(lines),
    )
