"""One model list over several backends (a route's ``merge_models``): what it costs.

    python -m bench.bench_model_lists [--duration 5] [--rounds 3]

Two model servers (``gateway sim``, one listing chat models, the other embedders) and the
gateway before them, on one machine.  ``GET /v1/models`` is asked by wrk on three paths that
take turns in each round: one server directly, the gateway passing one server's list
through (a route without ``merge_models``), and the gateway merging both lists.  Latency at
1 connection, requests/s at 16; each figure the median over the rounds.  A merged list
costs the gateway two upstream calls, two JSON reads and one JSON write where the
pass-through costs one call and no parse.  Writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

from bench.common import free_port, have, machine, process, python, update_section, wrk

CHAT_MODELS = "llama-3.1-8b,llama-3.1-70b,qwen2.5-7b"
EMBEDDER_MODELS = "bge-small-en,e5-large"


def sim(stack: ExitStack, models: str) -> str:
    port = free_port()
    stack.enter_context(
        process(python("-m", "gateway", "sim", "--port", str(port), "--models", models), port)
    )
    return f"http://127.0.0.1:{port}"


def gateway(stack: ExitStack, tmp: Path, backends: dict[str, str], merge: list[str]) -> str:
    route: dict[str, object] = {"match": {"path": "/v1/models*"}, "backend": "chat"}
    if merge:
        route["merge_models"] = merge
    policy = {"backends": {k: {"url": v} for k, v in backends.items()}, "routes": [route]}
    path = tmp / f"policy-{len(merge)}.yaml"
    path.write_text(yaml.safe_dump(policy, sort_keys=False))
    port, admin = free_port(), free_port()
    args = python("-m", "gateway", "serve", "--policy", str(path))
    args += ["--port", str(port), "--admin-port", str(admin)]
    stack.enter_context(process(args, port))
    return f"http://127.0.0.1:{port}/v1/models"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the paths taking turns")
    args = parser.parse_args()
    if not have("wrk"):
        sys.exit("wrk is not installed (apt-get install wrk)")
    runs: dict[str, list[dict[str, float]]] = {}
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        backends = {"chat": sim(stack, CHAT_MODELS), "embedder": sim(stack, EMBEDDER_MODELS)}
        paths = {
            "direct (one server)": backends["chat"] + "/v1/models",
            "gateway, one server's list": gateway(stack, Path(tmp), backends, []),
            "gateway, two lists merged": gateway(stack, Path(tmp), backends, ["embedder"]),
        }
        merged = httpx.get(paths["gateway, two lists merged"]).json()["data"]
        assert len(merged) == 5, merged
        for url in paths.values():  # warm: pools, imports
            wrk(url, connections=4, duration_s=1)
        for _ in range(args.rounds):
            for name, url in paths.items():
                one = wrk(url, connections=1, duration_s=args.duration)
                many = wrk(url, connections=16, duration_s=args.duration)
                runs.setdefault(name, []).append(
                    {
                        "p50": one["p50_ms"],
                        "p99": one["p99_ms"],
                        "rps": many["rps"],
                        "errors": one["errors"] + many["errors"],
                    }
                )
    update_section("model_lists", report(runs, args))


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> str:
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    lines = [
        "## One model list over several backends (`merge_models`)",
        "",
        f"`python -m bench.bench_model_lists --duration {args.duration} --rounds "
        f"{args.rounds}` on {machine()}. Two `gateway sim` servers (3 chat models, 2 "
        "embedders), the gateway and wrk share the machine; `GET /v1/models` at 1 connection "
        "(latency) and 16 (throughput), medians over the rounds, the paths taking turns.",
        "",
        "| path | p50 ms (1 conn) | p99 ms (1 conn) | req/s (16 conn) | non-2xx |",
        "|---|---|---|---|---|",
    ]
    for name in runs:
        lines.append(
            f"| {name} | {median(name, 'p50'):.3f} | {median(name, 'p99'):.3f} | "
            f"{median(name, 'rps'):.0f} | {sum(r['errors'] for r in runs[name]):.0f} |"
        )
    one, merged = "gateway, one server's list", "gateway, two lists merged"
    lines += [
        "",
        f"Merging adds {median(merged, 'p50') - median(one, 'p50'):.3f} ms at p50 to the "
        f"gateway's pass-through of one list (the two servers are asked at once), and "
        f"serves {median(merged, 'rps') / median(one, 'rps'):.2f}x its requests per second "
        "at 16 connections (two upstream calls and their JSON per request).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
