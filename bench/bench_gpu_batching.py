"""Micro-batching in front of a real model on a real GPU: the case study's "16 requests
per call" measured on hardware instead of the sim's cost model.

    python -m bench.bench_gpu_batching [--duration 10] [--adaptive-duration 20]

The backend is ``bench.gpu_model`` (a MiniLM-sized encoder, one forward pass at a time, on
CUDA when there is one); 64 closed-loop clients send single-input ``/v1/embeddings`` calls
straight at it and through ``gateway serve`` (the clients and both servers each their own
process, as in ``bench.bench_batching``, whose load this reuses).  A sample of each phase's
answers (``--check``) is compared with the model's own answer for the same text, asked
alone: a batch computes in other kernel shapes and pads inputs to a common length, so
vectors agree to float rounding (cosine >= 0.999), not bit for bit.  Writes the
"gpu-batching" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
from typing import Any

import aiohttp

from bench.bench_batching import MODEL, Phase, call_latency_ms, gateway, load
from bench.common import free_port, machine, process, python, update_section

PROBE_SIZES = (1, 4, 16, 64)
SAME = 0.999
"""Cosine above which a vector counts as the caller's own (padding changes float rounding)."""


async def alone(url: str, texts: list[str]) -> dict[str, list[float]]:
    """The model's answer for each text asked alone: the reference every phase is held to."""
    out: dict[str, list[float]] = {}
    async with aiohttp.ClientSession() as session:
        for t in texts:
            async with session.post(url + "/v1/embeddings", json={"model": MODEL, "input": t}) as r:
                out[t] = (await r.json())["data"][0]["embedding"]
    return out


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    server = python("-m", "bench.gpu_model", str(port), "--layers", str(args.layers))
    phases: list[Phase] = []
    with process(server, port=port):
        url = f"http://127.0.0.1:{port}"
        latency = {n: await call_latency_ms(url, n, repeats=20) for n in PROBE_SIZES}
        warm = min(2.0, args.duration / 4)
        phases.append(await load(url, Phase("direct"), duration_s=args.duration, count_from_s=warm))
        for size in (16, 64):
            with gateway(url, f"{{max_size: {size}, max_wait_ms: 2}}") as (gw, admin):
                phase = Phase(f"max_size {size}")
                phases.append(
                    await load(
                        gw, phase, duration_s=args.duration, count_from_s=warm, admin_url=admin
                    )
                )
        adaptive = (
            f"{{max_size: 64, max_wait_ms: 2, adaptive: {{target_latency_ms: {args.target_ms:g}}}}}"
        )
        with gateway(url, adaptive) as (gw, admin):
            tail = args.adaptive_duration / 2
            phases.append(
                await load(
                    gw,
                    Phase("adaptive"),
                    duration_s=args.adaptive_duration,
                    count_from_s=args.adaptive_duration - tail,
                    admin_url=admin,
                )
            )
        picked = [sorted(p.answers)[:: max(1, len(p.answers) // args.check)] for p in phases]
        sample = sorted({t for texts in picked for t in texts})
        truth = await alone(url, sample)
        async with aiohttp.ClientSession() as session, session.get(url + "/stats") as r:
            device = (await r.json())["device"]
    rows = {}
    for p in phases:
        checked = [t for t in sample if t in p.answers]
        wrong = sum(1 for t in checked if cosine(p.answers[t], truth[t]) < SAME)
        lat = sorted(p.latencies_ms)
        rows[p.name] = {
            "rps": p.rps,
            "mean_batch": p.mean_batch,
            "p50_ms": statistics.median(lat) if lat else 0.0,
            "p99_ms": lat[int(0.99 * (len(lat) - 1))] if lat else 0.0,
            "checked": len(checked),
            "wrong": wrong + p.wrong_shape,
            "errors": p.errors,
        }
    return {"rows": rows, "latency": latency, "device": device}


def markdown(result: dict[str, Any], args: argparse.Namespace, device: str) -> str:
    rows, latency = result["rows"], result["latency"]
    direct = rows["direct"]["rps"] or 1.0
    command = "python -m bench.bench_gpu_batching"
    if args.duration != 10 or args.adaptive_duration != 20:
        command += f" --duration {args.duration:g} --adaptive-duration {args.adaptive_duration:g}"
    lines = [
        "## Micro-batching on a real GPU",
        "",
        f"`{command}`",
        "",
        f"Machine: {machine()}; model on {device}. `bench.gpu_model`: a {args.layers}-layer, "
        "384-wide transformer encoder (MiniLM-sized, random weights, fp16 on CUDA), one "
        "forward pass at a time. 64 closed-loop clients of single-input `/v1/embeddings`.",
        "",
        "One call straight at the idle model (median of 20): "
        + ", ".join(f"{n} input{'s' if n > 1 else ''} {ms:.1f} ms" for n, ms in latency.items())
        + ".",
        "",
        "| path | req/s | vs direct | mean batch | p50 ms | p99 ms | checked | wrong | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    labels = {
        "direct": "direct to the model",
        "max_size 16": "gateway, `max_size: 16, max_wait_ms: 2`",
        "max_size 64": "gateway, `max_size: 64, max_wait_ms: 2`",
        "adaptive": f"gateway, adaptive (`max_size: 64`, `target_latency_ms: {args.target_ms:g}`)",
    }
    for name, row in rows.items():
        mean = "1" if name == "direct" else f"{row['mean_batch']:.1f}"
        lines.append(
            f"| {labels[name]} | {row['rps']:.0f} | {row['rps'] / direct:.2f}x | {mean} | "
            f"{row['p50_ms']:.1f} | {row['p99_ms']:.1f} | {row['checked']} | {row['wrong']} | "
            f"{row['errors']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per fixed phase")
    parser.add_argument("--adaptive-duration", type=float, default=20.0)
    parser.add_argument("--target-ms", type=float, default=50.0, help="adaptive latency target")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--check", type=int, default=400, help="answers checked per phase")
    parser.add_argument("--markdown", help="also write the section to this file")
    parser.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    text = markdown(result, args, result["device"])
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if not args.no_write:
        update_section("gpu-batching", text)


if __name__ == "__main__":
    main()
