"""Hit latency on a standalone Redis and on a Redis Cluster, in one run (issue 27).

    nice -n 10 .venv/bin/python -m bench.bench_redis_modes [--duration 5] [--rounds 3]

One ``redis-server`` and a three-master Cluster (``tests/redis_cluster.py`` sets it up:
``CLUSTER ADDSLOTSRANGE``, ``MEET``), all on loopback, share the machine with the fast
backend (``bench/backend.py``), ``gateway serve`` and wrk:

1. HTTP, one connection, wrk: an exact hit and a near-duplicate hit (SimHash and guard) of a
   caching route whose store is Redis, through one gateway per mode (a ``redis:`` section
   of ``mode: standalone`` or ``mode: cluster``), the pass-through of the same gateway as
   the baseline; the modes take turns on each path, ``--rounds`` times, and each figure is
   the median of the rounds, so that a busy machine's drift falls on both alike.
2. In-process, the cache's own lookup (``ResponseCache.lookup`` over a ``RedisStore``) of an
   exact and a near-duplicate key, ``--lookups`` times each: what the Redis client costs
   without HTTP.

Writes the "redis-modes" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bench_cache import CACHED, NEAR_TEXT, PLAIN_BODY, STORED_TEXT, post, post_script
from bench.bench_cache import POLICY as CACHE_POLICY
from bench.common import ROOT, free_port, machine, process, python, update_section, wait_port, wrk
from gateway.policy.redis import Redis
from gateway.policy.show import to_data
from tests.redis_cluster import Cluster
from tests.redis_server import RedisServer

POLICY = CACHE_POLICY.replace("routes:", "cache: {{store: redis}}\nredis: {redis}\nroutes:", 1)
"""``bench_cache``'s routes, the cache in the Redis of the ``redis:`` section."""
ROWS = ("pass-through", "exact hit", "near-duplicate hit")


def serve_args(redis: Redis, backend_port: int, tmp: Path) -> tuple[list[str], int, int]:
    """``gateway serve`` of the bench's policy on ``redis``; its command and ports."""
    gateway_port, admin_port = free_port(), free_port()
    section = {k: v for k, v in to_data(redis, redact=False).items() if v not in (None, [], False)}
    policy = tmp / f"{redis.mode}.yaml"
    policy.write_text(POLICY.format(backend=backend_port, redis=json.dumps(section)))
    serve = python("-m", "gateway", "--log-level", "warning", "serve", "--policy", str(policy))
    serve += ["--port", str(gateway_port), "--admin-port", str(admin_port)]
    return serve, gateway_port, admin_port


def http_rows(
    modes: dict[str, Redis], backend_port: int, duration: int, rounds: int, tmp: Path
) -> dict[str, dict[str, dict[str, float]]]:
    """wrk through a gateway per mode, both running, the modes taking turns on each path
    (so that the machine's drift falls on both alike), ``rounds`` times: the medians."""
    scripts = {
        "pass-through": post_script(tmp / "plain.lua", PLAIN_BODY),
        "exact hit": post_script(tmp / "hit.lua", CACHED % STORED_TEXT),
        "near-duplicate hit": post_script(tmp / "near.lua", CACHED % NEAR_TEXT),
    }
    launched = {mode: serve_args(settings, backend_port, tmp) for mode, settings in modes.items()}
    rows: dict[str, dict[str, dict[str, float]]] = {mode: {} for mode in modes}
    with contextlib.ExitStack() as stack:
        urls = {}
        for mode, (serve, port, admin) in launched.items():
            stack.enter_context(process(serve, port, cwd=ROOT))
            wait_port(admin)
            urls[mode] = url = f"http://127.0.0.1:{port}/v1/chat/completions"
            post(url, CACHED % STORED_TEXT)  # stored (or already there from a previous run)
            for name in ("exact hit", "near-duplicate hit"):
                body = CACHED % (STORED_TEXT if name == "exact hit" else NEAR_TEXT)
                if post(url, body)[0] != "hit":
                    raise RuntimeError(f"{mode}: the {name} request was not a hit")
        runs: dict[tuple[str, str], list[dict[str, float]]] = {}
        for _ in range(rounds):
            for name, script in scripts.items():
                for mode, url in urls.items():
                    wrk(url, connections=1, duration_s=1, script=script)  # warm up
                    run = wrk(url, connections=1, duration_s=duration, script=script)
                    runs.setdefault((mode, name), []).append(run)
    for (mode, name), results in runs.items():
        rows[mode][name] = {k: statistics.median(r[k] for r in results) for k in results[0]}
        rows[mode][name]["errors"] = sum(r["errors"] for r in results)
        rows[mode][name]["p50_low"] = min(r["p50_ms"] for r in results)
        rows[mode][name]["p50_high"] = max(r["p50_ms"] for r in results)
    return rows


async def lookup_rows(
    modes: dict[str, Redis], lookups: int, batch: int = 100
) -> dict[str, dict[str, tuple[float, float]]]:
    """p50 and p99 ms of ``ResponseCache.lookup`` of an exact and a near-duplicate key on
    each mode, the modes taking turns every ``batch`` lookups."""
    from gateway.cache import CachedResponse, ResponseCache, request_key
    from gateway.cache.stores import RedisStore

    where: dict[str, Any] = {
        "route": "r",
        "backend": "b",
        "model_version": "v",
        "path": "/v1/chat/completions",
    }

    def key(text: str) -> Any:
        return request_key(json.loads(CACHED % text), scope="s", **where)

    stores = {
        m: RedisStore.connect(r, prefix="bench-modes:", budget_s=1.0) for m, r in modes.items()
    }
    caches = {mode: ResponseCache(store) for mode, store in stores.items()}
    entry = CachedResponse(200, (), b'{"ok":true}', None, 1.0, "b", "v", "r", "s")
    queries = {"exact hit": key(STORED_TEXT), "near-duplicate hit": key(NEAR_TEXT)}
    times: dict[tuple[str, str], list[float]] = {}
    try:
        for cache in caches.values():
            await cache.put(key(STORED_TEXT), entry, 3600)
        for _ in range(0, lookups, batch):
            for name, wanted in queries.items():
                for mode, cache in caches.items():
                    for _ in range(batch):
                        started = time.perf_counter()
                        found = await cache.lookup(wanted)
                        times.setdefault((mode, name), []).append(
                            (time.perf_counter() - started) * 1000
                        )
                        assert found is not None, f"{mode}: {name} missed"
    finally:
        for store in stores.values():
            await store.purge()
            await store.close()
    out: dict[str, dict[str, tuple[float, float]]] = {mode: {} for mode in modes}
    for (mode, name), measured in times.items():
        out[mode][name] = (statistics.median(measured), statistics.quantiles(measured, n=100)[98])
    return out


def run(duration: int, rounds: int, lookups: int) -> tuple[dict[str, Any], dict[str, Any]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench-redis-modes-"))
    standalone, cluster = RedisServer(), Cluster()
    backend_port = free_port()
    http: dict[str, Any] = {}
    inproc: dict[str, Any] = {}
    try:
        standalone.start()
        cluster.start()
        modes = {"standalone": Redis(url=standalone.url), "cluster": cluster.settings}
        with process(python("-m", "bench.backend", str(backend_port)), backend_port):
            http = http_rows(modes, backend_port, duration, rounds, tmp)
        inproc = asyncio.run(lookup_rows(modes, lookups))
    finally:
        standalone.close()
        cluster.close()
    return http, inproc


def report(http: dict[str, Any], inproc: dict[str, Any], argv: str) -> str:
    lines = [
        "## Redis modes: standalone and Cluster (issue 27)",
        "",
        f"`{argv}` on {machine()}. One redis-server and a three-master Redis Cluster on "
        "loopback, the fast backend, `gateway serve` (`cache: {store: redis}` and a `redis:` "
        "section of each mode, both running) and wrk share the machine; one connection, small "
        "chat bodies; the modes take turns on each path, and each figure is the median of "
        "the rounds.",
        "",
        "| Redis | path | p50 ms | p50 over the rounds | p99 ms | req/s (1 conn) | non-2xx |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in ROWS:
        for mode, rows in http.items():
            r = rows[name]
            lines.append(
                f"| {mode} | {name} | {r['p50_ms']:.3f} | {r['p50_low']:.3f}-"
                f"{r['p50_high']:.3f} | {r['p99_ms']:.3f} | {r['rps']:.0f} | {r['errors']:.0f} |"
            )
    lines += [
        "",
        "The cache's own lookup in process (`ResponseCache.lookup` over a `RedisStore`, keys "
        "computed included; the modes take turns every 100 lookups):",
        "",
        "| Redis | lookup | p50 ms | p99 ms |",
        "|---|---|---|---|",
    ]
    for mode, rows in inproc.items():
        for name, (p50, p99) in rows.items():
            lines.append(f"| {mode} | {name} | {p50:.3f} | {p99:.3f} |")
    exact, near = (
        http["cluster"][name]["p50_ms"] - http["standalone"][name]["p50_ms"]
        for name in ("exact hit", "near-duplicate hit")
    )
    lines += [
        "",
        f"Cluster minus standalone, p50 through the gateway: {exact:+.3f} ms for an exact "
        f"hit, {near:+.3f} ms for a "
        "near-duplicate hit (compare with the spread of each over the rounds). Both make the "
        "same round trips in either mode: an exact hit one `GET`; a near-duplicate hit a "
        "`GET` that misses, the context's band buckets (one hash tag: one master, one "
        "pipeline) and the entry's `GET`; the Cluster client adds the slot lookup and its "
        "master's pool in Python to each command.",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="wrk runs per path and mode")
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    http, inproc = run(args.duration, args.rounds, args.lookups)
    argv = "python -m bench.bench_redis_modes " + " ".join(sys.argv[1:])
    table = report(http, inproc, argv.strip())
    print(table)
    if not args.no_write:
        update_section("redis-modes", table)


if __name__ == "__main__":
    main()
