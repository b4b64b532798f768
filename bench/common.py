"""Shared benchmark plumbing: processes on free ports, wrk, and docs/benchmarks.md."""

from __future__ import annotations

import contextlib
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.02)
    raise RuntimeError(f"nothing listens on {port}")


@contextlib.contextmanager
def process(
    args: list[str], port: int | None = None, **kwargs: object
) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, **kwargs
    )  # type: ignore[call-overload]
    try:
        if port is not None:
            wait_port(port)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _UNITS[m.group(2)]


def wrk(
    url: str, *, connections: int, duration_s: int, script: Path | None = None, threads: int = 1
) -> dict[str, float]:
    """Run wrk; returns requests/s and latency percentiles in ms."""
    args = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s}s", "--latency"]
    if script is not None:
        args += ["-s", str(script)]
    out = subprocess.run([*args, url], capture_output=True, text=True, check=True).stdout
    result = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))}  # type: ignore[union-attr]
    for pct in ("50", "90", "99"):
        m = re.search(rf"^\s+{pct}%\s+(\S+)", out, re.M)
        if m:
            result[f"p{pct}_ms"] = _ms(m.group(1))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    result["errors"] = float(errors.group(1)) if errors else 0.0
    return result


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def machine() -> str:
    cpu = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}"


def have(binary: str) -> bool:
    return shutil.which(binary) is not None


def update_section(name: str, markdown: str) -> None:
    """Replace this benchmark's section of docs/benchmarks.md (others are kept)."""
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = (
        DOC.read_text()
        if DOC.exists()
        else "# Benchmarks\n\n"
        "Every table below was written by the command shown above it, on the machine named.\n\n"
    )
    block = f"{start}\n{markdown.rstrip()}\n{end}"
    if start in text:
        text = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    DOC.write_text(text)
