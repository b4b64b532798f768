"""Picking among a backend's endpoints: least request against round robin (issue 15).

    python -m bench.bench_pool [--duration 10] [--clients 12]

Three `gateway sim` instances of two slots each, one of them 4x slower (its `--base-ms` four
times the others'), behind one gateway backend with `endpoints:`; closed-loop clients (each
sends its next request when the last answered) post small chat requests for ``--duration``
seconds, once with `balance: round_robin` and once with `balance: least_request`, each in
its own gateway, in the same run.  Also the direct path to one fast instance, for scale.
Writes the table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import yaml

from bench.common import free_port, machine, process, python, update_section

BASE_MS = 40.0
SLOW = 4.0
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def closed_loop(
    url: str,
    clients: int,
    duration_s: float,
    body: Callable[[random.Random], dict] = lambda _: BODY,
    served: list[tuple[str, str]] | None = None,
) -> tuple[float, float, int]:
    """Requests per second, mean latency (ms) and failures over ``duration_s``; with
    ``served``, (system prompt, the instance that answered) of each answer."""
    latencies: list[float] = []
    failures = 0
    deadline = time.perf_counter() + duration_s
    rng = random.Random(11)

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            sent = body(rng)
            try:
                r = await http.post(url + "/v1/chat/completions", json=sent)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
                if served is not None:
                    system = sent["messages"][0]["content"] if len(sent["messages"]) > 1 else ""
                    served.append((system, r.json().get("system_fingerprint", "")))
            else:
                failures += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, 1000 * statistics.fmean(latencies), failures


AFFINITY_CLIENTS = 4
"""Fewer clients than the instances' six slots: affinity is asked of while none is saturated."""
PROMPTS = [f"You are assistant number {i}. " + "Answer briefly, politely. " * 20 for i in range(8)]


def prompted(rng: random.Random) -> dict:
    """A chat request under one of ``PROMPTS`` (a shared system prompt, its own question)."""
    system = rng.choice(PROMPTS)
    question = f"question {rng.randrange(10**9)}"
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {**BODY, "messages": messages}


@contextmanager
def sims(stack: ExitStack, count: int, base_ms: float) -> Iterator[list[str]]:
    urls = []
    for _ in range(count):
        port = free_port()
        args = python("-m", "gateway", "sim", "--port", str(port), "--slots", "2")
        args += ["--base-ms", str(base_ms), "--per-item-ms", "0", "--token-ms", "0"]
        stack.enter_context(process(args, port))
        urls.append(f"http://127.0.0.1:{port}")
    yield urls


@contextmanager
def gateway(tmp: Path, name: str, backend: dict) -> Iterator[str]:
    policy = tmp / f"{name}.yaml"
    policy.write_text(
        yaml.safe_dump({"backends": {"sim": backend}, "routes": [{"backend": "sim"}]})
    )
    port, admin = free_port(), free_port()
    args = python("-m", "gateway", "serve", "--policy", str(policy))
    args += ["--port", str(port), "--admin-port", str(admin)]
    with process(args, port):
        yield f"http://127.0.0.1:{port}"


def kv_share(tmp: Path, duration: float, clients: int) -> list[tuple[str, float, int]]:
    """kv_aware: the share of requests the instance reporting KV 0.95 gets, then after it
    clears (the sim's ``kv_reserved_ratio``: KV held by other work)."""
    rows = []
    with ExitStack() as stack, sims(stack, 3, BASE_MS) as urls:
        backend = {"endpoints": urls, "balance": "kv_aware", "telemetry": {"interval_ms": 200}}
        with gateway(tmp, "kv_aware", backend) as url:
            asyncio.run(closed_loop(url, clients, 1))
            for phase, reserved in (("saturated (KV 0.95)", 0.95), ("cleared (KV 0)", 0.0)):
                httpx.post(urls[2] + "/sim/config", json={"kv_reserved_ratio": reserved})
                time.sleep(0.6)  # three scrapes
                served: list[tuple[str, str]] = []
                asyncio.run(closed_loop(url, clients, duration, served=served))
                mine = sum(1 for _, fp in served if fp == "sim-" + urls[2].rsplit(":", 1)[1])
                rows.append((phase, mine / max(1, len(served)), len(served)))
    return rows


def affinity(tmp: Path, duration: float, clients: int) -> list[tuple[str, float, float]]:
    """prefix_affinity: per system prompt, the share of its requests on its busiest
    instance (mean and least over the prompts), with and without it."""
    rows = []
    with ExitStack() as stack, sims(stack, 3, BASE_MS) as urls:
        for on in (False, True):
            backend = {"endpoints": urls, "prefix_affinity": on}
            with gateway(tmp, f"affinity-{on}", backend) as url:
                asyncio.run(closed_loop(url, clients, 1, prompted))
                served: list[tuple[str, str]] = []
                asyncio.run(closed_loop(url, clients, duration, prompted, served))
            by_prompt: dict[str, collections.Counter[str]] = collections.defaultdict(
                collections.Counter
            )
            for system, fp in served:
                by_prompt[system][fp] += 1
            shares = [c.most_common(1)[0][1] / sum(c.values()) for c in by_prompt.values()]
            name = "least_request + prefix_affinity" if on else "least_request alone"
            rows.append((name, statistics.fmean(shares), min(shares)))
    return rows


def run(duration: float, clients: int) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="bench-pool-"))
    rows = []
    with ExitStack() as stack:
        urls = []
        for i in range(3):
            port = free_port()
            base = BASE_MS * (SLOW if i == 2 else 1)
            args = python("-m", "gateway", "sim", "--port", str(port), "--slots", "2")
            args += ["--base-ms", str(base), "--per-item-ms", "0", "--token-ms", "0"]
            stack.enter_context(process(args, port))
            urls.append(f"http://127.0.0.1:{port}")
        rows.append(("direct (one fast instance)", *asyncio.run(closed_loop(urls[0], 4, 3))))
        for balance in ("round_robin", "least_request"):
            policy = tmp / f"{balance}.yaml"
            policy.write_text(
                yaml.safe_dump(
                    {
                        "backends": {"sim": {"endpoints": urls, "balance": balance}},
                        "routes": [{"backend": "sim"}],
                    }
                )
            )
            port, admin = free_port(), free_port()
            args = python("-m", "gateway", "serve", "--policy", str(policy))
            args += ["--port", str(port), "--admin-port", str(admin)]
            with process(args, port):
                url = f"http://127.0.0.1:{port}"
                asyncio.run(closed_loop(url, clients, 1))  # warm the pools
                measured = asyncio.run(closed_loop(url, clients, duration))
                rows.append((f"gateway, {balance}", *measured))
    kv = kv_share(tmp, duration, clients)
    prefix = affinity(tmp, duration, AFFINITY_CLIENTS)
    by = {name: (rps, mean) for name, rps, mean, _ in rows}
    rr, lr = by["gateway, round_robin"], by["gateway, least_request"]
    command = f"python -m bench.bench_pool --duration {duration:g} --clients {clients}"
    lines = [
        "## Endpoint picking (issue 15)",
        "",
        f"`{command}` on {machine()}: three `gateway sim` instances of 2 slots each "
        f"({BASE_MS:g} ms per call; the third {SLOW:g}x slower), {clients} closed-loop "
        "clients posting small chat requests, one gateway per `balance`, in one run.",
        "",
        "| path | req/s | mean latency ms | failed |",
        "|---|---|---|---|",
        *(f"| {n} | {rps:.1f} | {mean:.1f} | {f} |" for n, rps, mean, f in rows),
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| least_request >= 1.5x the throughput of round_robin | {lr[0] / rr[0]:.2f}x | "
        f"{'met' if lr[0] >= 1.5 * rr[0] else '**missed**'} |",
        f"| at <= 0.6x its mean latency | {lr[1] / rr[1]:.2f}x | "
        f"{'met' if lr[1] <= 0.6 * rr[1] else '**missed**'} |",
        "",
        f"`balance: kv_aware`, three equal instances ({BASE_MS:g} ms), the third reporting its "
        "KV cache 95% full (`gateway sim --kv-reserved-ratio`, KV held by other work), then "
        f"clear; {clients} closed-loop clients, {duration:g} s each:",
        "",
        "| the third instance | its share of requests | requests |",
        "|---|---|---|",
        *(f"| {phase} | {share:.1%} | {n} |" for phase, share, n in kv),
        "",
        f"`prefix_affinity`: 8 system prompts (about 120 tokens each) over three instances, "
        "each request a random prompt and its own question; "
        f"{AFFINITY_CLIENTS} closed-loop clients (none saturated: 6 slots in all):",
        "",
        "| picking | a prompt's requests on its busiest instance, mean | least |",
        "|---|---|---|",
        *(f"| {name} | {mean:.1%} | {least:.1%} |" for name, mean, least in prefix),
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| kv_aware: the saturated instance gets <= 5% | {kv[0][1]:.1%} | "
        f"{'met' if kv[0][1] <= 0.05 else '**missed**'} |",
        f"| and its share returns once it clears | {kv[1][1]:.1%} | "
        f"{'met' if kv[1][1] >= 0.2 else '**missed**'} |",
        f"| prefix_affinity: >= 90% of a prefix's requests on one instance | "
        f"{prefix[1][2]:.1%} (least) | {'met' if prefix[1][2] >= 0.9 else '**missed**'} |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    table = run(args.duration, args.clients)
    print(table)
    if not args.no_write:
        update_section("pool", table)


if __name__ == "__main__":
    main()
