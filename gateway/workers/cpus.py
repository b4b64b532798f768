"""How many workers ``--workers auto`` starts: the CPUs the container may use.

That is the cgroup's CPU quota (cgroup v2 ``cpu.max``: ``"<quota> <period>"`` or ``"max
<period>"``; cgroup v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 for none) rounded
up, and at most the CPUs the process may run on (``os.sched_getaffinity``).  Kubernetes
sets the quota from the container's CPU limit; ``os.cpu_count`` would be the node's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")
"""Where cgroup v1 mounts the CPU controller, by distribution."""


def parse_workers(text: str, cgroup_root: Path = CGROUP_ROOT) -> int:
    """``--workers``: a count of at least 1, or ``auto``."""
    if text == "auto":
        return available_cpus(cgroup_root)
    try:
        count = int(text)
    except ValueError:
        raise ValueError(f"--workers takes a count or `auto`, not {text!r}") from None
    if count < 1:
        raise ValueError(f"--workers must be at least 1, not {count}")
    return count


def available_cpus(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may use: the CPU quota rounded up, capped by its affinity."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    cpus = affinity or os.cpu_count() or 1
    quota = cpu_quota(cgroup_root)
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return cpus


def cpu_quota(cgroup_root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup's CPU quota in CPUs (1.5 for 150 ms per 100 ms), None when unlimited or
    unknown."""
    v2 = _read(cgroup_root / "cpu.max")
    if v2 is not None:
        quota, _, period = v2.partition(" ")
        return _ratio(quota, period)
    for name in V1_DIRS:
        quota_us = _read(cgroup_root / name / "cpu.cfs_quota_us")
        if quota_us is not None:
            return _ratio(quota_us, _read(cgroup_root / name / "cpu.cfs_period_us") or "")
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None  # "max": no quota
    return q / p if q > 0 and p > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None
