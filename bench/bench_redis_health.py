"""Redis health by evidence (issue 12): does a healthy Redis stay up under load on a busy
machine, and is a real outage still seen at once?

    python -m bench.bench_redis_health [--minutes 10] [--clients 16] [--freezes 30]

A redis-server of its own, the fast backend (``bench/backend.py``) and ``gateway serve``
(a caching route on the Redis store, default 50 ms budget) run as processes on this
machine; ``clients`` closed-loop clients send chat requests (a mix of repeats, which hit,
and fresh prompts, which miss and store), all sharing the machine's cores.  Counted from
the gateway's own metrics: down transitions of ``gateway_cache_store_up`` over the run
(target 0); then, under the same load, the gateway itself frozen ``--freezes`` times for
0.35 s each (``SIGSTOP``, as a CPU-throttled container is: every Redis command in flight
times out in the same turn when it wakes; target 0 down transitions); then the time from
freezing Redis (``SIGSTOP``: no answer, no refusal) and from stopping it to the gateway
reporting it down (target <= 1 s each).  Writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import free_port, machine, process, python, update_section, wait_port

POLL_S = 0.01
FREEZE_S = 0.35
"""Past the 0.2 s socket timeout: every command in flight times out when the gateway wakes."""


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


async def down_after(session: aiohttp.ClientSession, admin: int, since: float) -> float:
    """Seconds from ``since`` until the gateway reports its store down (NaN past 5 s)."""
    while time.perf_counter() < since + 5:
        if await metric(session, admin, "gateway_cache_store_up") == 0:
            return time.perf_counter() - since
        await asyncio.sleep(POLL_S)
    return float("nan")


async def back_up(session: aiohttp.ClientSession, admin: int) -> None:
    """Until the gateway reports its store up again (its probe runs every second)."""
    deadline = time.perf_counter() + 10
    while time.perf_counter() < deadline:
        if await metric(session, admin, "gateway_cache_store_up") == 1:
            return
        await asyncio.sleep(POLL_S)
    raise RuntimeError("the gateway did not take Redis for up again")


async def run(minutes: float, clients: int, freezes: int) -> dict[str, float]:
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
            ) as gateway,
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
                # The rest runs under the same load, until the last verdict is in.
                load_stop = time.perf_counter() + freezes * 2 + 30
                loaders = [
                    asyncio.create_task(client(port, load_stop, random.Random(i), {}))
                    for i in range(clients)
                ]
                await asyncio.sleep(0.5)
                # The gateway frozen past the socket timeout, as a throttled container is.
                for _ in range(freezes):
                    os.killpg(gateway.pid, signal.SIGSTOP)
                    await asyncio.sleep(FREEZE_S)
                    os.killpg(gateway.pid, signal.SIGCONT)
                    await asyncio.sleep(1.5)  # the confirming PING, and a down's retry window
                frozen_downs = (
                    await metric(session, admin, 'gateway_cache_store_transitions_total{to="down"}')
                    - downs
                )
                forgiven = await metric(
                    session, admin, 'gateway_redis_timeouts_forgiven_total{mode="standalone"}'
                )
                timed_out = await metric(
                    session,
                    admin,
                    'gateway_redis_command_failures_total{mode="standalone",reason="unreached"}',
                )
                await back_up(session, admin)
                # Redis frozen: it neither answers nor refuses; only timeouts tell.
                os.kill(redis.pid, signal.SIGSTOP)
                stalled = await down_after(session, admin, time.perf_counter())
                os.kill(redis.pid, signal.SIGCONT)
                await back_up(session, admin)
                # Redis stopped: connections are refused.
                redis.terminate()
                redis.wait()
                detected = await down_after(session, admin, time.perf_counter())
                for task in loaders:
                    task.cancel()
                await asyncio.gather(*loaders, return_exceptions=True)
    finally:
        if redis.poll() is None:
            os.kill(redis.pid, signal.SIGCONT)  # a frozen Redis would not see its SIGTERM
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
        "detected_s": detected,
        "freezes": freezes,
        "frozen_downs": frozen_downs,
        "forgiven": forgiven,
        "timed_out": timed_out,
        "stalled_s": stalled,
    }


def report(r: dict[str, float], argv: str) -> str:
    ok = lambda flag: "met" if flag else "**missed**"  # noqa: E731
    detected, stalled = r["detected_s"], r["stalled_s"]
    return "\n".join(
        [
            "## Redis health by evidence (issue 12)",
            "",
            f"`{argv}` on {machine()}. A redis-server, the fast backend, `gateway serve` (a "
            "caching route on the Redis store, 50 ms budget) and the clients all share the "
            f"machine: {r['clients']} closed-loop clients, 80% repeated prompts, for "
            f"{r['minutes']:g} minutes; then, under the same load, the gateway is frozen "
            f"{r['freezes']} times for {FREEZE_S * 1000:.0f} ms (`SIGSTOP`, as a CPU-throttled "
            "container is), Redis is frozen (`SIGSTOP`: no answer, no refusal) and, once "
            "back, stopped.",
            "",
            "| measurement | result | target | |",
            "|---|---|---|---|",
            f"| down transitions of a healthy Redis ({r['requests']:.0f} requests, "
            f"{r['rps']:.0f} req/s, {r['hits']:.0f} hits) | {r['downs']:.0f} | 0 | "
            f"{ok(r['downs'] == 0)} |",
            f"| ... store errors meanwhile (commands over their budget, each a miss) | "
            f"{r['errors']:.0f} | | |",
            f"| down transitions over {r['freezes']} gateway freezes of "
            f"{FREEZE_S * 1000:.0f} ms ({r['timed_out']:.0f} commands timed "
            f"out; forgiven after a PING: {r['forgiven']:.0f} times) | "
            f"{r['frozen_downs']:.0f} | 0 | "
            f"{ok(r['frozen_downs'] == 0)} |",
            f"| a frozen Redis (`SIGSTOP`) seen as down after | {stalled * 1000:.0f} ms | "
            f"<= 1 s | {ok(stalled <= 1.0)} |",
            f"| a real outage (Redis stopped) seen as down after | {detected * 1000:.0f} ms | "
            f"<= 1 s | {ok(detected <= 1.0)} |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--freezes", type=int, default=30)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(run(args.minutes, args.clients, args.freezes))
    table = report(result, ("python -m bench.bench_redis_health " + " ".join(sys.argv[1:])).strip())
    print(table)
    if not args.no_write:
        update_section("redis-health", table)


if __name__ == "__main__":
    main()
