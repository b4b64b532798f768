"""Where the processes run: why, on a small machine, a gateway doing less per call can answer
fewer calls a second than one doing more (the pattern under ``bench_rate_limits`` and
``bench_generation``).

    python -m bench.bench_placement [--duration 5] [--rounds 3] [--connections 8]

A backend answers each chat completion after ``SERVICE_MS``; two gateways run as processes
of their own, one without stages and one counting every call against a rate limit and a
token limit (``bench_rate_limits``' paths).  The bench process holds the client and the
backend, on one event loop.  Each gateway is loaded in turn, twice a round: with the
processes placed by the kernel, and pinned (the gateway's threads to one core, the bench
process to another).  Measured per answer, from ``/proc``: the gateway's CPU, the times it
blocked (voluntary context switches), and the bench process's CPU.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterator
from pathlib import Path

from bench.bench_rate_limits import ANSWER, RATES, SERVICE_MS, chat, policy
from bench.common import machine, update_section
from bench.plumbing import (
    ANSWERS_S,
    Answering,
    Runs,
    gateway,
    medians,
    rounds_command,
    run_rounds,
    serving,
)
from tests.redis_server import RedisServer

TICKS = os.sysconf("SC_CLK_TCK")


def pids_serving(port: int) -> list[int]:
    """The processes whose command line serves ``--port port``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--port" in args and args[args.index(b"--port") + 1] == str(port).encode():
            found.append(int(entry.name))
    return found


def threads(pids: list[int]) -> Iterator[Path]:
    for pid in pids:
        yield from Path(f"/proc/{pid}/task").iterdir()


def usage(pids: list[int]) -> tuple[float, float]:
    """The processes' CPU seconds and voluntary context switches so far."""
    cpu = switches = 0.0
    for task in threads(pids):
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        cpu += (int(fields[11]) + int(fields[12])) / TICKS
        for line in (task / "status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches"):
                switches += int(line.split()[1])
    return cpu, switches


def pin(pids: list[int] | None) -> None:
    """The gateway's threads on the last core and this process on the first; None: free."""
    cores = set(range(os.cpu_count() or 1))
    os.sched_setaffinity(0, {0} if pids is not None else cores)
    for task in threads(pids or []):
        os.sched_setaffinity(int(task.name), {max(cores)})


async def measured(
    url: str, pids: list[int], duration_s: float, connections: int
) -> dict[str, float]:
    cpu, switches = usage(pids)
    own = resource.getrusage(resource.RUSAGE_SELF)
    figures = await chat([url], duration_s, connections)
    cpu_after, switches_after = usage(pids)
    own_after = resource.getrusage(resource.RUSAGE_SELF)
    answers = max(1.0, figures["answers"])
    bench_cpu = own_after.ru_utime + own_after.ru_stime - own.ru_utime - own.ru_stime
    return {
        **figures,
        "cpu": 1e6 * (cpu_after - cpu) / answers,
        "blocked": (switches_after - switches) / answers,
        "bench_cpu": 1e6 * bench_cpu / answers,
    }


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    if (os.cpu_count() or 1) < 2:
        return ["(one core: nothing to place)"]
    server = Answering(SERVICE_MS, ANSWER)
    runs: Runs = {}
    with RedisServer() as store:
        async with serving(server.app()) as (url,):
            async with (
                gateway(policy(url, store.url, None)) as bare,
                gateway(policy(url, store.url, RATES)) as limited,
            ):
                gateways = {"no stages": bare, "rate and token limits": limited}
                for target in gateways.values():
                    await chat([target], 0.5, connections)
                everyone = [p for t in gateways.values() for p in pids_serving(port_of(t))]
                for _ in range(rounds):
                    for placed in ("placed by the kernel", "pinned"):
                        pin(everyone if placed == "pinned" else None)
                        for name, target in gateways.items():
                            pids = pids_serving(port_of(target))
                            figures = await measured(target, pids, duration_s, connections)
                            runs.setdefault(f"{name}, {placed}", []).append(figures)
                pin(None)
    return medians(runs, COLUMNS)


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


COLUMNS = (
    ANSWERS_S,
    ("p50 ms", "p50", ".2f"),
    ("gateway CPU us/answer", "cpu", ".0f"),
    ("gateway blocked /answer", "blocked", ".2f"),
    ("bench process CPU us/answer", "bench_cpu", ".0f"),
)


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 5.0, 8, main)
    update_section(
        "placement",
        "## Where the processes run (the bare gateway's lower rate, explained)\n\n"
        f"`{rounds_command('bench_placement', args)}` on {machine()}. A backend answering "
        f"each chat completion after {SERVICE_MS:g} ms; two gateways as processes of their "
        "own, one without stages and one with `bench_rate_limits`' rate and token limits; "
        "the client and the backend in the bench process, on one event loop; "
        f"{args.connections} connections each sending as fast as it is answered. Each "
        "gateway is loaded with the processes placed by the kernel, then pinned (the "
        "gateway's threads to the last core, the bench process to the first). Per answer, "
        "from `/proc`: the gateway's CPU, the times it blocked (voluntary context switches) "
        "and the bench process's CPU. Each figure is the median over the rounds.\n\n"
        + "\n".join(lines),
    )
