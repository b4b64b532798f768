"""Redis health by evidence (issue 12): does a healthy Redis stay up under load on a busy
machine, and is a real outage still seen at once?

    python -m bench.bench_redis_health [--minutes 10] [--clients 16]

A redis-server of its own, the fast backend (``bench/backend.py``) and ``gateway serve``
(a caching route on the Redis store, default 50 ms budget) run as processes on this
machine; ``clients`` closed-loop clients send chat requests (a mix of repeats, which hit,
and fresh prompts, which miss and store), all sharing the machine's cores.  Counted from
the gateway's own metrics: down transitions of ``gateway_cache_store_up`` over the run
(target 0), then the time from stopping Redis to the gateway reporting it down (target
<= 1 s).  Writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import free_port, machine, process, python, update_section, wait_port

POLL_S = 0.01


def redis_process(port: int, workdir: str) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("this bench needs redis-server")
    return subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


async def metric(session: aiohttp.ClientSession, admin: int, name: str) -> float:
    async with session.get(f"http://127.0.0.1:{admin}/metrics") as r:
        text = await r.text()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


async def client(port: int, stop: float, rng: random.Random, counts: dict[str, int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.perf_counter() < stop:
            prompt = (
                f"question {rng.randrange(200)}" if rng.random() < 0.8 else f"fresh {rng.random()}"
            )
            body = json.dumps(
                {
                    "model": "bench",
                    "messages": [{"role": "user", "content": prompt}],
                    "temperature": 0,
                }
            ).encode()
            writer.write(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: b\r\n"
                b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                % (len(body), body)
            )
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
            await reader.readexactly(length)
            cache = re.search(rb"(?i)x-gateway-cache: (\w+)", head)
            key = cache.group(1).decode() if cache else "none"
            counts[key] = counts.get(key, 0) + 1
    finally:
        writer.close()


async def run(minutes: float, clients: int) -> dict[str, float]:
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    redis_port, backend_port, port, admin = (free_port() for _ in range(4))
    redis = redis_process(redis_port, workdir)
    policy = Path(workdir) / "policy.yaml"
    policy.write_text(
        f'backends: {{main: {{url: "http://127.0.0.1:{backend_port}"}}}}\n'
        "routes: [{backend: main, cache: {ttl_s: 300}}]\n"
        f'cache: {{store: redis, redis_url: "redis://127.0.0.1:{redis_port}/0"}}\n'
    )
    counts: dict[str, int] = {}
    try:
        await asyncio.to_thread(wait_port, redis_port)
        with (
            process(python("-m", "bench.backend", str(backend_port)), backend_port),
            process(
                [
                    sys.executable,
                    "-m",
                    "gateway",
                    "--log-level",
                    "error",
                    "serve",
                    "--policy",
                    str(policy),
                    "--port",
                    str(port),
                    "--admin-port",
                    str(admin),
                ],
                port,
            ),
        ):
            await asyncio.to_thread(wait_port, admin)
            rng = random.Random(12)
            started = time.perf_counter()
            stop = started + minutes * 60
            await asyncio.gather(
                *(client(port, stop, random.Random(rng.random()), counts) for _ in range(clients))
            )
            elapsed = time.perf_counter() - started
            async with aiohttp.ClientSession() as session:
                downs = await metric(
                    session, admin, 'gateway_cache_store_transitions_total{to="down"}'
                )
                errors = await metric(session, admin, "gateway_cache_store_errors_total")
                # A real outage: stop Redis and time the gateway's own verdict, under load.
                load_stop = time.perf_counter() + 5
                loaders = [
                    asyncio.create_task(client(port, load_stop, random.Random(i), {}))
                    for i in range(clients)
                ]
                await asyncio.sleep(0.5)
                redis.terminate()
                redis.wait()
                gone = time.perf_counter()
                detected = None
                while time.perf_counter() < gone + 5:
                    if await metric(session, admin, "gateway_cache_store_up") == 0:
                        detected = time.perf_counter() - gone
                        break
                    await asyncio.sleep(POLL_S)
                for task in loaders:
                    with contextlib.suppress(Exception):
                        await task
    finally:
        if redis.poll() is None:
            redis.terminate()
            redis.wait()
        shutil.rmtree(workdir, ignore_errors=True)
    requests = sum(counts.values())
    return {
        "minutes": minutes,
        "clients": clients,
        "requests": requests,
        "rps": requests / elapsed,
        "hits": counts.get("hit", 0),
        "downs": downs,
        "errors": errors,
        "detected_s": float("nan") if detected is None else detected,
    }


def report(r: dict[str, float], argv: str) -> str:
    ok = lambda flag: "met" if flag else "**missed**"  # noqa: E731
    detected = r["detected_s"]
    return "\n".join(
        [
            "## Redis health by evidence (issue 12)",
            "",
            f"`{argv}` on {machine()}. A redis-server, the fast backend, `gateway serve` (a "
            "caching route on the Redis store, 50 ms budget) and the clients all share the "
            f"machine: {r['clients']} closed-loop clients, 80% repeated prompts, for "
            f"{r['minutes']:g} minutes; then Redis is stopped under the same load.",
            "",
            "| measurement | result | target | |",
            "|---|---|---|---|",
            f"| down transitions of a healthy Redis ({r['requests']:.0f} requests, "
            f"{r['rps']:.0f} req/s, {r['hits']:.0f} hits) | {r['downs']:.0f} | 0 | "
            f"{ok(r['downs'] == 0)} |",
            f"| ... store errors meanwhile (commands over their budget, each a miss) | "
            f"{r['errors']:.0f} | | |",
            f"| a real outage (Redis stopped) seen as down after | {detected * 1000:.0f} ms | "
            f"<= 1 s | {ok(detected <= 1.0)} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.minutes, args.clients))
    table = report(result, ("python -m bench.bench_redis_health " + " ".join(sys.argv[1:])).strip())
    print(table)
    if not args.no_write:
        update_section("redis-health", table)


if __name__ == "__main__":
    main()
