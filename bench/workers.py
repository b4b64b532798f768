"""``bench_proxy --workers N``: the gateway as N worker processes (``gateway serve --workers
N``) and nginx with ``worker_processes N``, measured in the same rounds as the rest, and
their target lines."""

from __future__ import annotations

import os
import statistics
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


def cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes ``pids`` have used (from /proc)."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def preemptions(pids: list[int]) -> int:
    """Times the processes ``pids`` were taken off a core they still wanted (involuntary
    context switches, from /proc)."""
    total = 0
    for pid in pids:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("nonvoluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy (every core; softirq included)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """Cores a path's gateway processes and the whole machine use during its saturation
    runs, and how often the gateway's processes were preempted (each a median over the
    rounds)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[tuple[float, float, float]]] = {}
        self._start: tuple[list[int], float, float, int, float] | None = None

    def begin(self, pids: list[int]) -> None:
        self._start = (pids, cpu_s(pids), machine_busy_s(), preemptions(pids), os.times().elapsed)

    def end(self, name: str) -> None:
        if self._start is None:
            return
        pids, own, busy, taken, at = self._start
        elapsed = os.times().elapsed - at
        sample = (
            (cpu_s(pids) - own) / elapsed,
            (machine_busy_s() - busy) / elapsed,
            (preemptions(pids) - taken) / elapsed,
        )
        self.samples.setdefault(name, []).append(sample)
        self._start = None

    def cores(self, name: str) -> tuple[float, float]:
        """(the gateway's cores, the machine's busy cores) for ``name``."""
        return self._median(name, 0), self._median(name, 1)

    def preempted_per_s(self, name: str) -> float:
        """How many times a second the gateway's processes were preempted for ``name``."""
        return self._median(name, 2)

    def _median(self, name: str, figure: int) -> float:
        got = self.samples.get(name)
        return statistics.median(s[figure] for s in got) if got else float("nan")


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


def cores_paragraph(by: dict[str, dict[str, Any]], workers: int, meter: CpuMeter) -> list[str]:
    """Where the cores went: the ceiling the machine put on the workers' scaling."""
    scale = by[gateway_label(workers)]["rps"] / by["gateway"]["rps"]
    one_g, one_m = meter.cores("gateway")
    many_g, many_m = meter.cores(gateway_label(workers))
    cores = os.cpu_count() or 0
    return [
        "",
        f"Where the cores went at saturation (CPU time over the wrk run, median of the "
        f"rounds; the machine has {cores}): one gateway process used {one_g:.2f} cores "
        f"while the machine was busy {one_m:.2f}; `--workers {workers}` used "
        f"{many_g:.2f} (supervisor and workers) while it was busy {many_m:.2f}. The rest is "
        "wrk, the backend and the kernel's loopback, which share the same cores: the "
        f"workers can only scale as far as {many_g:.2f} / {one_g:.2f} = "
        f"{many_g / one_g:.2f}x the cores of one process, and they reached {scale:.2f}x "
        "its requests. On a machine whose other cores carry the clients and the model "
        "server, that ceiling is the worker count.",
        "",
        *_preemption_lines(by, workers, meter),
    ]


def _preemption_lines(by: dict[str, dict[str, Any]], workers: int, meter: CpuMeter) -> list[str]:
    """Why the workers reach less than that ceiling: each request costs more CPU once
    the processes outnumber the cores."""
    many_name = gateway_label(workers)
    one_rps, many_rps = by["gateway"]["rps"], by[many_name]["rps"]
    one_us = meter.cores("gateway")[0] / one_rps * 1e6
    many_us = meter.cores(many_name)[0] / many_rps * 1e6
    one_pre = meter.preempted_per_s("gateway") / one_rps
    many_pre = meter.preempted_per_s(many_name) / many_rps
    return [
        f"Why they reach less than that ceiling: a request cost the gateway {one_us:.0f} us "
        f"of CPU with one process and {many_us:.0f} us with {workers} workers, and the "
        f"processes were preempted {one_pre:.2f} times per request against {many_pre:.2f} "
        "(involuntary context switches, /proc/PID/status). One busy process always has "
        f"another event ready and keeps its core; {workers} workers, wrk's threads and the "
        "backend are more runnable threads than cores, so each wake-up of the client or "
        "the backend takes a core from a worker in the middle of its work, and the worker "
        "pays the switch and its cold caches again. That cost comes from sharing the "
        f"cores, which a {os.cpu_count()}-core machine running the client and the backend "
        "too cannot avoid; a machine with a core for each worker is what would measure "
        "without it.",
    ]
