"""A real GPU under the gateway's ``nvml`` telemetry: what NVML reads there, what a reading
costs, and throttle rules firing on real VRAM and real heat.

    python -m bench.bench_gpu_device [--interval-ms 200] [--heat-s 45] [--cool-s 30]

Needs an NVIDIA GPU, NVML and PyTorch with CUDA (the load runs in child processes).  The
gateway runs as its own process (``gateway serve``) with a ``main`` backend whose telemetry
is ``source: nvml`` and a ``spare`` it reroutes to; both backends live in this process.  A
client sends a request every ``--gap-ms`` throughout and records who answered.

1. NVML itself: the first read (``nvmlInit`` and the device handle) and steady reads, each
   the whole sample the gateway takes, in the calling thread.
2. VRAM (the case study's "VRAM > 90%" breaker): a child allocates the GPU to 93% with
   ``cudaMalloc``; the rule ``vram-high`` (above 0.90, clear below 0.85) must reroute
   ``main``'s traffic to ``spare`` and hand it back once the memory is freed.
3. Heat (the case study's overheated GPU): a child runs bf16 matrix products for
   ``--heat-s``; the rule ``gpu-hot`` fires at the idle temperature plus ``--hot-delta``
   (a real GPU does not reach 85 C in a minute), clears 3 C lower, and the gauges are
   sampled from the admin port's ``/metrics`` as a dashboard would read them.

Reaction times are measured from the moment the load is in place (the child says so) to
the first answer the client got from ``spare``, and back.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.common import free_port, machine, update_section
from bench.plumbing import ANSWER, gateway, serving
from gateway.telemetry.nvml import NvmlSource
from gateway.telemetry.signals import SIGNALS

VRAM_TARGET = 0.93
GAUGES = {
    "gateway_gpu_temperature_celsius": "temp_c",
    "gateway_gpu_memory_used_ratio": "vram",
    "gateway_gpu_utilization_ratio": "util",
    "gateway_gpu_power_ratio": "power",
    "gateway_telemetry_age_seconds": "age_s",
}

# -- the load, in a child process ---------------------------------------------------------

VRAM_CHILD = """
import sys, torch
free, total = torch.cuda.mem_get_info()
want = int(total * {target}) - (total - free)
block = torch.empty(max(want, 0), dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", want, flush=True)
sys.stdin.read()
"""

HEAT_CHILD = """
import time, torch
a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    for _ in range(20):
        c = a @ b
    torch.cuda.synchronize()
print("done", flush=True)
"""


async def child(code: str) -> asyncio.subprocess.Process:
    """Start ``code`` in a fresh Python and wait for its ``ready`` line."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 120)
    if not line.startswith(b"ready"):
        raise RuntimeError(f"load process failed to start: {line!r}")
    return proc


async def stop(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdin is not None
    proc.stdin.close()
    with contextlib.suppress(ProcessLookupError):
        await asyncio.wait_for(proc.wait(), 30)


# -- 1. NVML read cost --------------------------------------------------------------------


def nvml_cost(reads: int) -> dict[str, Any]:
    source = NvmlSource(0)
    start = time.perf_counter()
    first = source._read()  # the gateway's own sample, as its worker thread takes it
    first_ms = (time.perf_counter() - start) * 1000
    times = []
    for _ in range(reads):
        t = time.perf_counter()
        source._read()
        times.append((time.perf_counter() - t) * 1e6)
    asyncio.run(source.aclose())
    times.sort()
    return {
        "name": source.name,
        "sample": first,
        "first_ms": first_ms,
        "p50_us": statistics.median(times),
        "p99_us": times[int(0.99 * (len(times) - 1))],
    }


# -- 2 and 3: the gateway under load ------------------------------------------------------


class Watch:
    """The client (one request every ``gap`` seconds) and the admin-port sampler."""

    def __init__(self, url: str, admin: str, gap_s: float, interval_s: float) -> None:
        self.url, self.admin, self.gap_s, self.interval_s = url, admin, gap_s, interval_s
        self.answers: list[tuple[float, int, str]] = []  # (time, status, backend)
        self.samples: list[dict[str, float]] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Watch:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._tasks = [asyncio.create_task(self._client()), asyncio.create_task(self._sampler())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.session.close()

    async def _client(self) -> None:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        while True:
            try:
                async with self.session.post(self.url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                    backend = r.headers.get("X-Gateway-Backend", "?")
                    self.answers.append((time.perf_counter(), r.status, backend))
            except aiohttp.ClientError as exc:
                self.answers.append((time.perf_counter(), 0, type(exc).__name__))
            await asyncio.sleep(self.gap_s)

    async def _sampler(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError):
                async with self.session.get(self.admin + "/metrics") as r:
                    self.samples.append(parse(await r.text()))
            await asyncio.sleep(self.interval_s)

    async def first_answer(self, backend: str, since: float, timeout_s: float) -> float | None:
        """Seconds from ``since`` to the first answer served by ``backend`` after it."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            for at, status, by in self.answers:
                if at > since and status == 200 and by == backend:
                    return at - since
            await asyncio.sleep(0.01)
        return None


def parse(text: str) -> dict[str, float]:
    out: dict[str, float] = {"at": time.perf_counter()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("backend") not in (None, "main"):
                continue
            if s.name in GAUGES:
                out[GAUGES[s.name]] = s.value
            elif s.name == "gateway_throttle_active" and s.value:
                out["rule:" + s.labels.get("rule", "?")] = s.value
    return out


def policy(main: str, spare: str, interval_ms: int, hot_c: float) -> dict[str, Any]:
    def rule(name: str, signal: str, above: float, clear: float) -> dict[str, Any]:
        when = {"signal": signal, "above": above, "clear_below": clear}
        return {"name": name, "backend": "main", "when": when, "action": "reroute"}

    return {
        "backends": {
            "main": {
                "url": main,
                "telemetry": {"source": "nvml", "index": 0, "interval_ms": interval_ms},
            },
            "spare": {"url": spare},
        },
        "routes": [{"match": {"path": "/v1/*"}, "backend": "main", "fallback": ["spare"]}],
        "throttle": [
            rule("vram-high", "gpu_memory_used_ratio", 0.90, 0.85),
            rule("gpu-hot", "gpu_temperature_c", hot_c, hot_c - 3),
        ],
    }


async def scenes(args: argparse.Namespace, idle_c: float, out: dict[str, Any]) -> None:
    """Runs scenes 2 and 3, filling ``out`` as it goes (so a failure keeps what was seen)."""
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(ANSWER)

    apps = []
    for _ in range(2):
        app = web.Application()
        app.router.add_post("/{tail:.*}", answer)
        apps.append(app)
    hot_c = idle_c + args.hot_delta
    interval_s = args.interval_ms / 1000
    out["hot_c"] = hot_c
    admin_port = free_port()
    async with (
        serving(*apps) as (main, spare),
        gateway(policy(main, spare, args.interval_ms, hot_c), admin_port=admin_port) as url,
        Watch(url, f"http://127.0.0.1:{admin_port}", args.gap_ms / 1000, interval_s) as watch,
    ):
        out["answers"], out["samples"] = watch.answers, watch.samples
        await asyncio.sleep(max(1.0, 5 * interval_s))  # telemetry flowing, rules quiet
        out["baseline_backend"] = watch.answers[-1][2] if watch.answers else None
        out["baseline"] = dict(watch.samples[-1]) if watch.samples else {}

        vram = await child(VRAM_CHILD.format(target=VRAM_TARGET))
        loaded = time.perf_counter()
        out["vram_fire_s"] = await watch.first_answer("spare", loaded, 10)
        await asyncio.sleep(2 * interval_s)
        out["vram_peak"] = max((x.get("vram", 0) for x in watch.samples), default=None)
        await stop(vram)
        freed = time.perf_counter()
        out["vram_clear_s"] = await watch.first_answer("main", freed, 10)

        await asyncio.sleep(2)
        heat = await child(HEAT_CHILD.format(seconds=args.heat_s))
        heating = time.perf_counter()
        out["heat_start"] = heating
        out["heat_fire_s"] = await watch.first_answer("spare", heating, args.heat_s)
        assert heat.stdout is not None
        await asyncio.wait_for(heat.stdout.readline(), args.heat_s + 60)  # "done"
        await heat.wait()
        cooling = time.perf_counter()
        out["heat_end"] = cooling
        out["heat_clear_s"] = await watch.first_answer("main", cooling, args.cool_s)
        await asyncio.sleep(1)


# -- report --------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ".2f", missing: str = "-") -> str:
    return missing if value is None else f"{value:{spec}}"


def report(args: argparse.Namespace, cost: dict[str, Any], run: dict[str, Any]) -> str:
    sample = cost["sample"]
    interval_s = args.interval_ms / 1000
    answers = run.get("answers", [])
    errors = sum(1 for _, status, _ in answers if status != 200)
    by = {b: sum(1 for _, s, x in answers if x == b and s == 200) for b in ("main", "spare")}

    def reaction(key: str) -> str:
        s = run.get(key)
        return "not reached" if s is None else f"{s * 1000:.0f} ms ({s / interval_s:.1f} intervals)"

    samples = run.get("samples", [])
    temps = [s["temp_c"] for s in samples if "temp_c" in s]
    hot_c, start = run.get("hot_c", 0.0), run.get("heat_start")
    crossed = next(
        (s["at"] - start for s in samples if start and s.get("temp_c", 0) >= hot_c), None
    )
    lines = [
        f"Device: {cost['name']}; this host: {machine()}.",
        f"Command: `python -m bench.bench_gpu_device --interval-ms {args.interval_ms} "
        f"--heat-s {args.heat_s} --hot-delta {args.hot_delta}`",
        "",
        "What NVML read there (the gateway's own sample):",
        "",
        "| signal | value |",
        "| --- | --- |",
    ]
    gpu = [name for name in SIGNALS if name.startswith("gpu_")]
    for name in [*gpu, "gpu_slowdown_temperature_c", "gpu_shutdown_temperature_c"]:
        value = getattr(sample, name)
        lines.append(f"| `{name}` | {'unsupported' if value is None else f'{value:g}'} |")
    lines += [
        "",
        "| measurement | result |",
        "| --- | --- |",
        f"| first NVML sample (init + handle + read) | {cost['first_ms']:.1f} ms |",
        f"| one NVML sample, steady ({args.reads} reads) | p50 {cost['p50_us']:.0f} us, "
        f"p99 {cost['p99_us']:.0f} us |",
        f"| `vram-high` fires after VRAM filled to {VRAM_TARGET:.0%} "
        f"(peak read {fmt(run.get('vram_peak'), '.3f')}) | {reaction('vram_fire_s')} |",
        f"| `vram-high` clears after the memory is freed | {reaction('vram_clear_s')} |",
        f"| `gpu-hot` at {run.get('hot_c', 0):.0f} C (idle "
        f"{fmt(run.get('baseline', {}).get('temp_c'), '.0f')} C + {args.hot_delta:g}) "
        f"fires: the gauge first read >= {hot_c:.0f} C, and the first rerouted answer, "
        f"after the bf16 load started | {fmt(crossed, '.1f', 'never')} s; "
        f"{fmt(run.get('heat_fire_s'), '.1f', 'never')} s |",
        f"| `gpu-hot` clears after the load stops (cool-down, within {args.cool_s} s) "
        f"| {reaction('heat_clear_s')} |",
        f"| peak temperature read through the gateway | {fmt(max(temps, default=None), '.0f')} C |",
        f"| peak utilisation / power ratio | "
        f"{fmt(max((s.get('util', 0) for s in samples), default=None))} / "
        f"{fmt(max((s.get('power', 0) for s in samples), default=None))} |",
        f"| answers: main / spare / errors | {by['main']} / {by['spare']} / {errors} |",
    ]
    if start is not None and samples:
        lines += [
            "",
            "Heat scene, from the admin port's gauges (every ~3 s; t = 0 when the load started):",
            "",
        ]
        lines += [
            "| t (s) | temp C | util | power | rules firing |",
            "| --- | --- | --- | --- | --- |",
        ]
        next_t = -2.0
        for s in samples:
            t = s["at"] - start
            if t < next_t:
                continue
            next_t = t + 3
            rules = ", ".join(k[5:] for k in s if k.startswith("rule:")) or "-"
            lines.append(
                f"| {t:.1f} | {fmt(s.get('temp_c'), '.0f')} | {fmt(s.get('util'))} | "
                f"{fmt(s.get('power'))} | {rules} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interval-ms", type=int, default=200)
    parser.add_argument("--heat-s", type=float, default=45)
    parser.add_argument("--cool-s", type=float, default=30)
    parser.add_argument("--hot-delta", type=float, default=8, help="C above idle for gpu-hot")
    parser.add_argument("--gap-ms", type=float, default=20, help="between client requests")
    parser.add_argument("--reads", type=int, default=1000, help="NVML reads timed")
    parser.add_argument("--markdown", type=Path, help="also write the section here")
    parser.add_argument("--no-doc", action="store_true", help="leave docs/benchmarks.md alone")
    args = parser.parse_args()
    cost = nvml_cost(args.reads)
    print(f"{cost['name']}: {cost['sample']}", flush=True)
    idle_c = cost["sample"].gpu_temperature_c or 40.0
    run: dict[str, Any] = {}
    try:
        asyncio.run(scenes(args, idle_c, run))
    except Exception:  # report what was measured before it broke
        traceback.print_exc()
    text = report(args, cost, run)
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    if not args.no_doc:
        update_section("gpu-device", "## GPU telemetry on a real device\n\n" + text)


if __name__ == "__main__":
    main()
