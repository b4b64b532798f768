"""``bench_proxy --workers N``: the gateway as N worker processes (``gateway serve --workers
N``) and nginx with ``worker_processes N``, measured in the same rounds as the rest, and
their target lines."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import rss_mb

MULTIPLE = 1.5
"""``--workers N`` must reach this many times the saturation throughput of one process."""
OF_NGINX = 0.30
RSS_MB = 100


def gateway_label(workers: int) -> str:
    return f"gateway --workers {workers}"


def nginx_label(workers: int) -> str:
    return f"nginx worker_processes {workers}"


def children(pid: int) -> list[int]:
    """The pids a process started (its workers), from /proc."""
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def rss_per_worker(supervisor_pid: int) -> tuple[float, float, list[float]]:
    """(every process's RSS summed / the workers, the supervisor's, each worker's) in MB."""
    own = rss_mb(supervisor_pid)
    each = [rss_mb(pid) for pid in children(supervisor_pid)]
    return (own + sum(each)) / max(len(each), 1), own, each


def target_lines(
    by: dict[str, dict[str, Any]],
    workers: int,
    rss: tuple[float, float, list[float]],
    met: Callable[[bool], str],
) -> list[str]:
    """The three targets of ``--workers N`` against the same run's other paths."""
    many, one = by[gateway_label(workers)], by["gateway"]
    scale = many["rps"] / one["rps"]
    scale_rounds = ", ".join(
        f"{a / b:.2f}x" for a, b in zip(many["rps_rounds"], one["rps_rounds"], strict=True)
    )
    lines = [
        f"| gateway --workers {workers} >= {MULTIPLE}x the saturation throughput of --workers 1 "
        f"| {scale:.2f}x (rounds: {scale_rounds}) | {met(scale >= MULTIPLE)} |",
    ]
    nginx = by.get(nginx_label(workers))
    if nginx is not None:
        ratio = many["rps"] / nginx["rps"]
        ratio_rounds = ", ".join(
            f"{a / b:.2f}x" for a, b in zip(many["rps_rounds"], nginx["rps_rounds"], strict=True)
        )
        lines.append(
            f"| gateway --workers {workers} >= {OF_NGINX:.2f}x nginx worker_processes {workers} "
            f"| {ratio:.2f}x (rounds: {ratio_rounds}) | {met(ratio >= OF_NGINX)} |"
        )
    per, own, each = rss
    shown = ", ".join(f"{mb:.0f}" for mb in each)
    lines.append(
        f"| RSS per worker <= {RSS_MB} MB under that load (--workers {workers}) | {per:.0f} MB: "
        f"the supervisor's {own:.0f} MB and the workers' ({shown} MB) over {len(each)} | "
        f"{met(per <= RSS_MB)} |"
    )
    return lines
