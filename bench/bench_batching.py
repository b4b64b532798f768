"""Micro-batching throughput: 64 clients of single-input embedding calls, direct and batched.

    python -m bench.bench_batching [--duration 10] [--adaptive-duration 30]

One run on one machine, against ``gateway sim`` (one slot, 46 ms + 4 ms per item) and
``gateway serve``, each a process of its own; the clients are closed-loop, each sending its
next request when its answer is in.  Measured:

- throughput straight at the sim, and through the gateway with ``max_size: 16`` (target:
  >= 6.0x; the ideal is 16 / (46 + 64) ms against 1 / 50 ms = 7.3x);
- that every client got exactly its own vector: every answer is compared with the sim's
  direct answer for the same text;
- ``adaptive`` (``target_latency_ms: 100``, ``max_size: 32``): the batch limit every second
  (``gateway_batch_limit``), the size it settles on within 30 s, and its throughput over the
  last third of the run against the best fixed size that meets the latency target, which is
  the largest size whose single call, timed straight at the idle sim, stays within 100 ms
  (target: within 10%);
- the gateway's own cost of merging 32 requests and splitting the answer (from
  ``bench/bench_batch_merge.py``; target <= 1 ms).

Writes the table, with this command, to the "batching" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.bench_batch_merge import answer as merge_answer
from bench.bench_batch_merge import bench_batcher, bench_merge_split, percentiles
from bench.common import free_port, machine, process, python, update_section

CLIENTS = 64
BASE_MS = 46.0
PER_ITEM_MS = 4.0
FIXED_SIZE = 16
TARGET_LATENCY_MS = 100.0
ADAPTIVE_MAX = 32
MODEL = "sim-model"
PROBE_SIZES = range(8, 21)

POLICY = """
backends:
  sim: {{url: "{url}", max_connections: 128}}
routes:
  - name: embeddings
    match: {{path: /v1/embeddings}}
    backend: sim
    batch: {batch}
"""


def text(client: int, n: int) -> str:
    """The n-th request of a client: the same text in every phase, so answers compare."""
    return f"client {client} asks about item {n} of the catalogue"


@dataclass
class Phase:
    """What one load phase measured."""

    name: str
    answers: dict[str, list[float]] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)
    counted: int = 0
    window_s: float = 0.0
    errors: int = 0
    wrong_shape: int = 0
    trace: list[tuple[float, int]] = field(default_factory=list)
    mean_batch: float = 0.0

    @property
    def rps(self) -> float:
        return self.counted / self.window_s if self.window_s else 0.0


async def load(
    url: str,
    phase: Phase,
    *,
    duration_s: float,
    count_from_s: float,
    admin_url: str | None = None,
    trace: bool = False,
) -> Phase:
    """Closed-loop clients for ``duration_s``; requests answered after ``count_from_s`` count."""
    connector = aiohttp.TCPConnector(limit=CLIENTS + 4)
    timeout = aiohttp.ClientTimeout(total=60)
    started = time.perf_counter()
    stop = started + duration_s
    count_from = started + count_from_s

    async def client(session: aiohttp.ClientSession, c: int) -> None:
        n = 0
        while time.perf_counter() < stop:
            t = text(c, n)
            n += 1
            sent = time.perf_counter()
            body = {"model": MODEL, "input": t}
            try:
                async with session.post(url + "/v1/embeddings", json=body) as resp:
                    raw = await resp.read()
                    ok = resp.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            done = time.perf_counter()
            if not ok:
                phase.errors += 1
                continue
            data = json.loads(raw)["data"]
            if len(data) != 1 or data[0]["index"] != 0:
                phase.wrong_shape += 1
            phase.answers[t] = data[0]["embedding"]
            if count_from <= done <= stop:
                phase.counted += 1
                phase.latencies_ms.append((done - sent) * 1000)

    async def watch(session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop:
            await asyncio.sleep(1.0)
            phase.trace.append((time.perf_counter() - started, await batch_limit(session)))

    async def batch_limit(session: aiohttp.ClientSession) -> int:
        return int((await series(session)).get("gateway_batch_limit", 0))

    async def mean_batch(session: aiohttp.ClientSession) -> float:
        found = await series(session)
        count = found.get("gateway_batch_size_count", 0)
        return found.get("gateway_batch_size_sum", 0) / count if count else 0.0

    async def series(session: aiohttp.ClientSession) -> dict[str, float]:
        """The embeddings route's batch series, by name."""
        found = {}
        async with session.get(f"{admin_url}/metrics") as resp:
            for line in (await resp.text()).splitlines():
                name, _, rest = line.partition('{route="embeddings"}')
                if rest:
                    found[name] = float(rest.split()[0])
        return found

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.create_task(client(session, c)) for c in range(CLIENTS)]
        if trace:
            tasks.append(asyncio.create_task(watch(session)))
        # Answers that arrive past the end are checked but not counted.
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=duration_s + 30)
        if admin_url is not None:
            phase.mean_batch = await mean_batch(session)
    phase.window_s = duration_s - count_from_s
    return phase


async def direct_answers(url: str, texts: list[str]) -> dict[str, list[float]]:
    """The sim's own answers for ``texts``, asked straight, many inputs per call."""
    out: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        for at in range(0, len(texts), 256):
            part = texts[at : at + 256]
            async with session.post(
                url + "/v1/embeddings", json={"model": MODEL, "input": part}
            ) as resp:
                data = (await resp.json())["data"]
            for entry in data:
                out[part[entry["index"]]] = entry["embedding"]
    return out


async def call_latency_ms(url: str, size: int, repeats: int = 5) -> float:
    """The median of ``repeats`` calls of ``size`` inputs straight at the idle sim."""
    times = []
    async with aiohttp.ClientSession() as session:
        for r in range(repeats):
            body = {"model": MODEL, "input": [f"probe {r} {i}" for i in range(size)]}
            t0 = time.perf_counter()
            async with session.post(url + "/v1/embeddings", json=body) as resp:
                await resp.read()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


@contextmanager
def gateway(sim_url: str, batch: str) -> Iterator[tuple[str, str]]:
    """``gateway serve`` with the embeddings route batched as ``batch`` (YAML flow)."""
    port, admin = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        policy = Path(tmp) / "policy.yaml"
        policy.write_text(POLICY.format(url=sim_url, batch=batch))
        args = python("-m", "gateway", "--log-level", "error", "serve", "--policy", str(policy))
        args += ["--port", str(port), "--admin-port", str(admin)]
        with process(args, port=port):
            yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}"


def settled(trace: list[tuple[float, int]], tail_s: float) -> tuple[int, int, float | None]:
    """The band (min, max) of the limit over the last ``tail_s`` seconds of ``trace``, and the
    first time from which the limit never left that band."""
    end = trace[-1][0]
    band = [limit for t, limit in trace if t >= end - tail_s]
    low, high = min(band), max(band)
    since = None
    for t, limit in trace:
        if low <= limit <= high:
            since = t if since is None else since
        else:
            since = None
    return low, high, since


async def run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {}
    sim_port = free_port()
    sim_args = python("-m", "gateway", "--log-level", "error", "sim", "--port", str(sim_port))
    sim_args += ["--base-ms", str(BASE_MS), "--per-item-ms", str(PER_ITEM_MS), "--slots", "1"]
    with process(sim_args, port=sim_port):
        sim = f"http://127.0.0.1:{sim_port}"
        warm = min(2.0, args.duration / 4)
        phases: list[Phase] = []

        direct = await load(sim, Phase("direct"), duration_s=args.duration, count_from_s=warm)
        phases.append(direct)

        fixed_batch = f"{{max_size: {FIXED_SIZE}, max_wait_ms: 5}}"
        with gateway(sim, fixed_batch) as (url, admin):
            fixed = await load(
                url,
                Phase(f"max_size {FIXED_SIZE}"),
                duration_s=args.duration,
                count_from_s=warm,
                admin_url=admin,
            )
        phases.append(fixed)

        latency = {n: await call_latency_ms(sim, n) for n in PROBE_SIZES}
        meeting = [n for n, ms in latency.items() if ms <= TARGET_LATENCY_MS]
        best = max(meeting) if meeting else 1
        with gateway(sim, f"{{max_size: {best}, max_wait_ms: 5}}") as (url, admin):
            best_fixed = await load(
                url,
                Phase(f"max_size {best}"),
                duration_s=args.duration,
                count_from_s=warm,
                admin_url=admin,
            )
        phases.append(best_fixed)

        adaptive_batch = (
            f"{{max_size: {ADAPTIVE_MAX}, max_wait_ms: 5, "
            f"adaptive: {{target_latency_ms: {TARGET_LATENCY_MS:g}}}}}"
        )
        tail = args.adaptive_duration / 3
        with gateway(sim, adaptive_batch) as (url, admin):
            adaptive = await load(
                url,
                Phase("adaptive"),
                duration_s=args.adaptive_duration,
                count_from_s=args.adaptive_duration - tail,
                admin_url=admin,
                trace=True,
            )
        phases.append(adaptive)

        texts = sorted({t for p in phases for t in p.answers})
        truth = await direct_answers(sim, texts)

    for p in phases:
        wrong = sum(1 for t, v in p.answers.items() if truth.get(t) != v)
        lat = sorted(p.latencies_ms)
        result[p.name] = {
            "rps": round(p.rps, 1),
            "answers_checked": len(p.answers),
            "wrong_vectors": wrong + p.wrong_shape,
            "errors": p.errors,
            "p50_ms": round(statistics.median(lat), 1) if lat else 0.0,
            "p99_ms": round(lat[int(0.99 * (len(lat) - 1))], 1) if lat else 0.0,
            "mean_batch": round(p.mean_batch, 1),
        }
    low, high, since = settled(adaptive.trace, tail)
    result["adaptive_trace"] = [(round(t, 1), limit) for t, limit in adaptive.trace]
    result["adaptive_band"] = (low, high, round(since, 1) if since is not None else None)
    result["best_fixed"] = best
    result["call_latency_ms"] = {n: round(ms, 1) for n, ms in latency.items()}

    raw = merge_answer(384)
    bench_merge_split(raw, 50, "gateway")
    merge = percentiles(bench_merge_split(raw, args.rounds, "gateway"))
    batcher = percentiles(await bench_batcher(raw, args.rounds))
    result["merge_split_ms"] = [round(x * 1000, 3) for x in merge]
    result["batcher_ms"] = [round(x * 1000, 3) for x in batcher]
    return result


def markdown(result: dict[str, Any], command: str) -> str:
    best = result["best_fixed"]
    names = ("direct", f"max_size {FIXED_SIZE}", f"max_size {best}", "adaptive")
    direct = result["direct"]["rps"]
    fixed, best_row, adaptive = (result[n] for n in names[1:])
    low, high, since = result["adaptive_band"]
    ratio = fixed["rps"] / direct if direct else 0.0
    versus = adaptive["rps"] / best_row["rps"] if best_row["rps"] else 0.0
    ideal = (FIXED_SIZE / (BASE_MS + PER_ITEM_MS * FIXED_SIZE)) / (1 / (BASE_MS + PER_ITEM_MS))
    merge_p50, merge_p99 = result["merge_split_ms"]
    batcher_p50, batcher_p99 = result["batcher_ms"]
    wrong = sum(result[n]["wrong_vectors"] for n in names)
    checked = sum(result[n]["answers_checked"] for n in names)
    errors = sum(result[n]["errors"] for n in names)
    labels = {
        "direct": "direct to the sim",
        names[1]: f"gateway, `max_size: {FIXED_SIZE}, max_wait_ms: 5`",
        names[2]: f"gateway, `max_size: {best}, max_wait_ms: 5`",
        "adaptive": f"gateway, adaptive (`max_size: {ADAPTIVE_MAX}`, "
        f"`target_latency_ms: {TARGET_LATENCY_MS:g}`)",
    }
    lines = [
        "## Micro-batching",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine()}. {CLIENTS} closed-loop clients, each sending single-input "
        f"`/v1/embeddings` calls to `gateway sim` (1 slot, {BASE_MS:g} ms + {PER_ITEM_MS:g} ms "
        "per item), straight and through `gateway serve`, each its own process. Every answer "
        "was compared with the sim's direct answer for the same text.",
        "",
        "| path | req/s | vs direct | mean batch | p50 ms | p99 ms | answers checked | wrong |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in names:
        row = result[name]
        mean = f"{row['mean_batch']:.1f}" if name != "direct" else "1"
        lines.append(
            f"| {labels[name]} | {row['rps']:.1f} | {row['rps'] / direct:.2f}x | {mean} | "
            f"{row['p50_ms']:.0f} | {row['p99_ms']:.0f} | {row['answers_checked']} | "
            f"{row['wrong_vectors']} |"
        )
    settle = f"from {since:.0f} s on" if since is not None else "never settled"
    merge = f"p50 {merge_p50:.3f} ms, p99 {merge_p99:.3f} ms"
    scheduled = f"p50 {batcher_p50:.3f} ms, p99 {batcher_p99:.3f} ms"
    lines += [
        "",
        "| target | measured | met |",
        "|---|---|---|",
        f"| `max_size: {FIXED_SIZE}`: >= 6.0x direct (ideal {ideal:.1f}x) | {ratio:.2f}x | "
        f"{_yes(ratio >= 6.0)} |",
        f"| every client gets exactly its own vector | {wrong} wrong of {checked}, "
        f"{errors} errors | {_yes(wrong == 0 and errors == 0)} |",
        f"| adaptive settles within 30 s | limit {low}-{high} {settle} | "
        f"{_yes(since is not None and since <= 30)} |",
        f"| adaptive within 10% of the best fixed size meeting the target "
        f"(`max_size: {best}`) | {versus:.2f}x | {_yes(versus >= 0.9)} |",
        f"| merge + split of a batch of 32 <= 1 ms (p50) | {merge}; with the batcher's "
        f"scheduling, futures and timers: {scheduled} | {_yes(merge_p50 <= 1.0)} |",
        "",
        "Adaptive limit, once a second: "
        + ", ".join(str(limit) for _, limit in result["adaptive_trace"])
        + ". Its throughput is measured over the last third of its run.",
        "",
        "Best fixed size meeting the target: the largest whose call, timed straight at the "
        f"idle sim (median of 5), took <= {TARGET_LATENCY_MS:g} ms ("
        + ", ".join(
            f"{n}: {ms:.0f} ms"
            for n, ms in result["call_latency_ms"].items()
            if best - 2 <= int(n) <= best + 2
        )
        + "). Through the gateway a fixed size lets one batch queue at the backend behind "
        "the running one, so its clients see more than that; adaptive keeps none queued.",
    ]
    return "\n".join(lines)


def _yes(ok: bool) -> str:
    return "yes" if ok else "**no**"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per fixed phase")
    parser.add_argument("--adaptive-duration", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=1000, help="merge+split rounds")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    command = "python -m bench.bench_batching"
    if args.duration != 10.0 or args.adaptive_duration != 30.0:
        command += f" --duration {args.duration:g} --adaptive-duration {args.adaptive_duration:g}"
    text_md = markdown(result, command)
    print(text_md)
    print(json.dumps(result))
    if not args.no_write:
        update_section("batching", text_md)


if __name__ == "__main__":
    main()
