"""Garbage-collector pauses: a served gateway with its heap frozen once ready (the default,
``gateway.serve.settle_heap``) against one without (``GATEWAY_GC_FREEZE=0``), under cache
misses, each on a fresh process, and the backend directly.

    .venv/bin/python -m bench.bench_gc [--seconds 90]

Every request is a new prompt on a caching route (lookup, forward, store: the path whose
garbage sets the collector off), one connection, wrk.  The first minute is the heap as
the first freeze left it (before what the first requests import); the rest after the second
freeze.  Each window's full collections and their mean pause come from the gateway's own
``gateway_gc_pause_seconds{generation="2"}``; wrk's latency is its own (with its
correction for the requests a stall held back, so a 50 ms pause shows in its tail).

Writes the "gc" section of docs/benchmarks.md with the command that produced it.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import urllib.request
from pathlib import Path

from bench.bench_cache import CACHED, MISS_SCRIPT, POLICY, post_script
from bench.common import ROOT, free_port, machine, process, python, update_section, wait_port, wrk

FIRST_WINDOW_S = 60
"""The first freeze's window: until ``HEAP_SETTLED_S``'s second freeze."""


def full_collections(admin: str) -> tuple[float, float]:
    """(count, sum of seconds) of the gateway's full collections so far."""
    text = urllib.request.urlopen(f"{admin}/metrics", timeout=5).read().decode()
    found = {"count": 0.0, "sum": 0.0}
    for line in text.splitlines():
        for kind in found:
            if line.startswith(f'gateway_gc_pause_seconds_{kind}{{generation="2"}}'):
                found[kind] = float(line.rsplit(" ", 1)[1])
    return found["count"], found["sum"]


def run(frozen: bool, seconds: int, tmp: Path) -> list[dict[str, float]]:
    backend_port, gateway_port, admin_port = (free_port() for _ in range(3))
    policy = tmp / "policy.yaml"
    policy.write_text(POLICY.format(backend=backend_port))
    serve = [
        *python("-m", "gateway", "--log-level", "warning", "serve", "--policy", str(policy)),
        *("--port", str(gateway_port), "--admin-port", str(admin_port)),
    ]
    env = {**os.environ, "GATEWAY_GC_FREEZE": "1" if frozen else "0"}
    url = f"http://127.0.0.1:{gateway_port}/v1/chat/completions"
    admin = f"http://127.0.0.1:{admin_port}"
    rows = []
    with (
        process(python("-m", "bench.backend", str(backend_port)), backend_port),
        process(serve, gateway_port, cwd=ROOT, env=env),
    ):
        wait_port(admin_port)
        for window, length in (("first", FIRST_WINDOW_S), ("after", seconds - FIRST_WINDOW_S)):
            script = tmp / f"{window}.lua"
            script.write_text(MISS_SCRIPT % (CACHED % f"%s {window} {frozen}"))
            before = full_collections(admin)
            result = wrk(url, connections=1, duration_s=length, script=script)
            after = full_collections(admin)
            count = after[0] - before[0]
            mean_ms = (after[1] - before[1]) / count * 1000 if count else 0.0
            rows.append({**result, "collections": count, "mean_pause_ms": mean_ms})
    return rows


def direct(tmp: Path) -> dict[str, float]:
    port = free_port()
    with process(python("-m", "bench.backend", str(port)), port):
        wait_port(port)
        body = post_script(tmp / "direct.lua", CACHED % "direct")
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        return wrk(url, connections=1, duration_s=10, script=body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=90)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        base = direct(tmp)
        results = {frozen: run(frozen, args.seconds, tmp) for frozen in (False, True)}
    lines = [
        "## Garbage-collector pauses (settle_heap)",
        "",
        f"`.venv/bin/python -m bench.bench_gc --seconds {args.seconds}` on {machine()}; the "
        "fast backend, the gateway (memory store) and wrk share the machine. One connection, "
        f"every request a new prompt on a caching route (a miss: lookup, forward, store); the "
        f"first {FIRST_WINDOW_S} s, then the rest after the heap's second freeze. Full "
        "collections from the gateway's `gateway_gc_pause_seconds{generation=\"2\"}`; wrk's "
        "p99 counts the requests a pause held back.",
        "",
        "| path | window | full collections | mean full-collection pause ms | p50 ms | p99 ms "
        "| req/s |",
        "|---|---|---|---|---|---|---|",
        f"| direct | - | - | - | {base['p50_ms']:.3f} | {base['p99_ms']:.3f} | {base['rps']:.0f} |",
    ]
    for frozen, rows in results.items():
        name = "gateway, heap frozen (default)" if frozen else "gateway, `GATEWAY_GC_FREEZE=0`"
        for window, row in zip(("first minute", "after"), rows, strict=True):
            lines.append(
                f"| {name} | {window} | {row['collections']:.0f} | {row['mean_pause_ms']:.1f} | "
                f"{row['p50_ms']:.3f} | {row['p99_ms']:.3f} | {row['rps']:.0f} |"
            )
    markdown = "\n".join(lines) + "\n"
    print(markdown)
    if not args.no_write:
        update_section("gc", markdown)


if __name__ == "__main__":
    main()
