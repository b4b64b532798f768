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
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

from bench.common import free_port, machine, process, python, update_section

BASE_MS = 40.0
SLOW = 4.0
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def closed_loop(url: str, clients: int, duration_s: float) -> tuple[float, float, int]:
    """Requests per second, mean latency (ms) and failures over ``duration_s``."""
    latencies: list[float] = []
    failures = 0
    deadline = time.perf_counter() + duration_s

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal failures
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            try:
                r = await http.post(url + "/v1/chat/completions", json=BODY)
                ok = r.status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - started)
            else:
                failures += 1

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=30) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        elapsed = time.perf_counter() - started
    return len(latencies) / elapsed, 1000 * statistics.fmean(latencies), failures


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
