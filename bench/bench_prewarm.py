"""Predictive pre-warming against the cold start, at the onset of a daily peak (issue 15).

    python -m bench.bench_prewarm [--cold-start-ms 4000] [--peak-s 30]

A compressed-time diurnal replay.  The week before is history: six days of a daily shape
(a trough of ``TROUGH_RPS``, a three-hour peak of ``PEAK_RPS``, weekends at 60%) written
into a real ``redis-server`` as the per-minute counts other replicas would have recorded
(``gateway/pool/shared.py``: the fleet's history, the gateway reads it at start), with the
peak aligned to begin about half a minute after the replay starts.  Then the morning is
replayed live: the trough's rate until the onset, then the peak's, open-loop (Poisson
arrivals), for ``--peak-s`` seconds.

Three ``gateway sim`` instances of 2 slots each, each paying ``--cold-start-ms`` on its
first call (``--cold-start-ms``), behind one backend with ``pool: {core: 1, max: 3,
scale_up_inflight: 6}`` and a ``warmup`` request: the core instance is warmed at start; the
other two are standby (6 in flight, not the default 4, so that a Poisson burst of the
trough does not happen to bring one in early: a run then shows luck, not anticipation).  Two
runs on fresh instances, in one run of this script:

* **without pre-warming**: the standby instances are brought in by the load once the peak
  has arrived (``scale_up_inflight``), each after its cold start;
* **with pre-warming**: the route has ``prewarm``; the forecast (Holt-Winters over the
  history) sees the peak within its horizon and the standby instances are warmed before it.

p99 at the onset is over the first ``ONSET_S`` seconds of the peak; steady state over its
last ``STEADY_S`` seconds, when every instance has long been warm in both runs.  Writes the
table to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import redis
import yaml
from redis.typing import EncodableT, FieldT

from bench.common import free_port, machine, process, python, update_section

TROUGH_RPS = 12.0
PEAK_RPS = 110.0
LEAD_S = 35.0
"""Seconds from the start of the replay to the peak's onset (at least)."""
ONSET_S = 8.0
STEADY_S = 10.0
BASE_MS = 30.0
DAY_MIN = 24 * 60
PEAK_MIN = 180
BODY = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def seed(url: str, route: str, onset_minute: int, now_minute: int) -> int:
    """Six days of per-minute counts before ``now_minute``, peaking daily at the minute of
    day of ``onset_minute``; returns how many minutes were written."""
    client = redis.Redis.from_url(url)
    onset_of_day = onset_minute % DAY_MIN
    counts: dict[FieldT, EncodableT] = {}
    for minute in range(now_minute - 6 * DAY_MIN, now_minute):
        into_peak = (minute % DAY_MIN - onset_of_day) % DAY_MIN
        rps = PEAK_RPS if into_peak < PEAK_MIN and minute < onset_minute else TROUGH_RPS
        weekday = (minute // DAY_MIN + 3) % 7
        counts[str(minute)] = round(rps * 60 * (0.6 if weekday >= 5 else 1.0))
    key = f"gw:rate:{route}"
    client.delete(key)
    client.hset(key, mapping=counts)
    client.close()
    return len(counts)


async def replay(url: str, onset_wall: float, peak_s: float) -> list[tuple[float, float, bool]]:
    """Open-loop requests: the trough's rate until ``onset_wall``, then the peak's for
    ``peak_s``; (seconds after the onset it was sent, latency ms, ok) of each."""
    rng = random.Random(7)
    results: list[tuple[float, float, bool]] = []
    tasks: set[asyncio.Task[None]] = set()

    async def one(http: httpx.AsyncClient, sent: float) -> None:
        started = time.perf_counter()
        try:
            ok = (await http.post(url + "/v1/chat/completions", json=BODY)).status_code == 200
        except httpx.HTTPError:
            ok = False
        results.append((sent, 1000 * (time.perf_counter() - started), ok))

    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    async with httpx.AsyncClient(limits=limits, timeout=60) as http:
        end = onset_wall + peak_s
        while (now := time.time()) < end:
            rps = PEAK_RPS if now >= onset_wall else TROUGH_RPS
            task = asyncio.ensure_future(one(http, now - onset_wall))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(rps))
        await asyncio.gather(*tasks)
    return results


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)] if ordered else 0.0


def one_run(tmp: Path, redis_url: str, prewarm: bool, cold_ms: float, peak_s: float) -> dict:
    with ExitStack() as stack:
        urls = []
        for _ in range(3):
            port = free_port()
            args = python("-m", "gateway", "sim", "--port", str(port), "--slots", "2")
            args += ["--base-ms", str(BASE_MS), "--per-item-ms", "0", "--token-ms", "0"]
            args += ["--cold-start-ms", str(cold_ms), "--cold-idle-s", "3600"]
            stack.enter_context(process(args, port))
            urls.append(f"http://127.0.0.1:{port}")
        route: dict = {"name": "chat", "match": {"path": "/v1/chat/completions"}, "backend": "sim"}
        if prewarm:
            route["prewarm"] = {"horizon_s": 600, "headroom": 1.2}
        backend = {
            "endpoints": urls,
            "pool": {"core": 1, "max": 3, "idle_timeout_s": 3600, "scale_up_inflight": 6},
            "warmup": [{"path": "/v1/chat/completions", "body": BODY}],
            "timeout_s": 60,
        }
        policy = tmp / f"prewarm-{prewarm}.yaml"
        policy.write_text(
            yaml.safe_dump(
                {
                    "cache": {"store": "redis", "redis_url": redis_url},
                    "backends": {"sim": backend},
                    "routes": [route],
                }
            )
        )
        now = time.time()
        onset_minute = math.ceil((now + LEAD_S) / 60)
        seed(redis_url, "chat", onset_minute, int(now // 60))
        port, admin = free_port(), free_port()
        args = python("-m", "gateway", "serve", "--policy", str(policy))
        args += ["--port", str(port), "--admin-port", str(admin)]
        stack.enter_context(process(args, port))
        deadline = time.time() + 30  # readiness: the core instance's warm-up answered
        while httpx.get(f"http://127.0.0.1:{admin}/readyz").status_code != 200:
            if time.time() > deadline:
                raise RuntimeError("the gateway did not become ready")
            time.sleep(0.2)
        results = asyncio.run(replay(f"http://127.0.0.1:{port}", onset_minute * 60.0, peak_s))
        exposition = httpx.get(f"http://127.0.0.1:{admin}/metrics").text
    lines = exposition.splitlines()
    desired = next((x.split()[-1] for x in lines if x.startswith("gateway_desired")), "-")
    onset = [ms for sent, ms, ok in results if 0 <= sent < ONSET_S]
    steady = [ms for sent, ms, ok in results if sent >= peak_s - STEADY_S]
    trough = [ms for sent, ms, ok in results if sent < 0]
    return {
        "trough_p99": p99(trough),
        "onset_p99": p99(onset),
        "steady_p99": p99(steady),
        "failed": sum(1 for *_, ok in results if not ok),
        "requests": len(results),
        "desired": desired,
    }


def run(cold_ms: float, peak_s: float) -> str:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prewarm-"))
    rport = free_port()
    redis_url = f"redis://127.0.0.1:{rport}/0"
    rows = {}
    with process(
        ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", ""], rport
    ):
        for prewarm in (False, True):
            rows[prewarm] = one_run(tmp, redis_url, prewarm, cold_ms, peak_s)
    command = f"python -m bench.bench_prewarm --cold-start-ms {cold_ms:g} --peak-s {peak_s:g}"
    ratio = {k: r["onset_p99"] / max(r["steady_p99"], 1e-9) for k, r in rows.items()}
    lines = [
        "## Pre-warming at the onset of a peak (issue 15)",
        "",
        f"`{command}` on {machine()}: three `gateway sim` instances (2 slots, "
        f"{BASE_MS:g} ms per call, a {cold_ms / 1000:g} s cold start on the first call) "
        "behind `pool: {core: 1, max: 3}` with a warm-up request; six days of history "
        f"(trough {TROUGH_RPS:g} req/s, a daily three-hour peak of {PEAK_RPS:g} req/s) in "
        "Redis as the fleet's counts; the morning replayed live, open loop, the peak's onset "
        f"about {LEAD_S:g} s in. Onset: the first {ONSET_S:g} s of the peak; steady: its last "
        f"{STEADY_S:g} s.",
        "",
        "| run | trough p99 ms | onset p99 ms | steady p99 ms | onset / steady | requests "
        "| failed | desired endpoints |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for prewarm, r in rows.items():
        name = "with `prewarm`" if prewarm else "without pre-warming"
        lines.append(
            f"| {name} | {r['trough_p99']:.0f} | {r['onset_p99']:.0f} | {r['steady_p99']:.0f} "
            f"| {ratio[prewarm]:.2f}x | {r['requests']} | {r['failed']} | {r['desired']} |"
        )
    met = "met" if ratio[True] <= 1.5 else "**missed**"
    lines += [
        "",
        "| target | measured | |",
        "|---|---|---|",
        f"| with pre-warming, onset p99 <= 1.5x steady p99 | {ratio[True]:.2f}x | {met} |",
        f"| without, report the ratio (expect well above 3x) | {ratio[False]:.2f}x | |",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cold-start-ms", type=float, default=4000.0)
    parser.add_argument("--peak-s", type=float, default=30.0)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    table = run(args.cold_start_ms, args.peak_s)
    print(table)
    if not args.no_write:
        update_section("prewarm", table)


if __name__ == "__main__":
    main()
