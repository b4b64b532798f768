"""The fault experiments of issue 24, re-run on the final code: the drain under load, a
policy reloaded under load, one caller's malformed row under a default breaker, broken
streams that must open the breaker.

    python -m bench.bench_faults [--quick] [--no-write]

Each experiment runs a fresh ``gateway serve`` process on a policy file this bench writes;
the backends and the clients share this process's event loop, all on 127.0.0.1.  The
clients speak raw HTTP/1.1 (``bench/rawhttp.py``), so every answer is seen as it came
(status, framing, a stream's last event) and so is its absence.  The experiments are
``bench/faults_drain.py``, ``faults_reload.py`` and ``faults_breaker.py``; this module runs
them and writes the table.

1. Drain: closed-loop clients (streams and whole answers, 0.2-6 s each; a kept-alive
   connection reused unless the gateway closed it, as pooled clients check) against a backend
   behind ``max_concurrency`` and a queue, and pipelined pairs on a few connections; SIGTERM
   mid-load with ``shutdown_grace_s: 2``.  Targets: the process exits within the grace + 1 s;
   no request is left without an answer (a whole one, a 503, or a stream ended by an error
   event), and none the gateway read (its access log and the backend say which it read);
   nothing pipelined behind a closing answer reaches the backend.
2. Reload under load: clients on the embeddings route while the policy file is renamed into
   place a few times, then rewritten in place (same inode) by a writer that pauses 2 s and
   5 s mid-file, each pause leaving a valid policy without the embeddings route.  Targets:
   no answer but 200; the whole file live within ``reload_settle_s`` + one poll of its last
   write, and nothing before it; a renamed file live at the next poll.
3. One caller's bad input: a KServe V2 model server that answers a whole batch 500 for one
   malformed row (as MLServer does), a batching route and ``circuit_breaker: {}``; rounds of
   fifteen rows, one malformed.  Targets: every good row answered 200 with its own sum, the
   breaker never opens.
4. Broken streams: a primary whose streamed 200s end in an error event, without ``[DONE]``
   and ``finish_reason``, or with a line that is not JSON, a healthy fallback,
   ``consecutive_failures: 5``.  Target: broken streams seen by clients at most
   ``consecutive_failures`` plus those in flight, then the fallback serves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from bench.common import machine, update_section
from bench.faults_breaker import CONSECUTIVE, bench_bad_input, bench_broken_streams
from bench.faults_drain import CUT_RACE, GRACE_S, MAX_STEPS, STEP_S, drain_run
from bench.faults_reload import bench_reload
from bench.rawhttp import POLL_S
from gateway.policy.model import DEFAULT_RELOAD_INTERVAL_S, DEFAULT_RELOAD_SETTLE_S

SLACK_S = 0.1
"""Beyond its interval, what a poll takes (reading the file off the loop, building the
generation) and the bench's own reading of the generation, every ``POLL_S``."""


def report(
    drains: list[dict[str, Any]],
    reload: dict[str, Any],
    bad: dict[str, Any],
    broken: dict[str, Any],
    command: str,
    clients: int,
    others: float,
) -> str:
    shared = ", a host shared with other work" if others >= 0.05 else ""
    return "\n".join(
        [
            "## Faults: drain, reload, bad input, broken streams (issue 24)",
            "",
            f"`{command}` on {machine()}{shared}: other processes used {others:.0%} of its "
            "CPU time during the run. Each experiment runs a fresh `gateway serve` process; "
            "backends and raw HTTP/1.1 clients share the bench's event loop, all on "
            "127.0.0.1.",
            "",
            "| experiment | measured | target | |",
            "|---|---|---|---|",
            *drain_rows(drains, clients),
            *reload_rows(reload),
            *bad_input_rows(bad),
            *broken_rows(broken),
            "",
            *notes(drains, reload, bad, broken),
        ]
    )


def verdict(met: bool) -> str:
    return "met" if met else "**missed**"


def tally(counts: dict[str, int] | Counter[str]) -> str:
    return ", ".join(f"{k}: {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def drain_rows(drains: list[dict[str, Any]], clients: int) -> list[str]:
    exits = [d["exit_s"] for d in drains]
    outcomes: Counter[str] = sum((d["outcomes"] for d in drains), Counter())
    on: Counter[str] = sum((d["unanswered_on"] for d in drains), Counter())
    unanswered = sum(on.values())
    read = sum(len(d["unanswered_read"]) for d in drains)
    wrong = unanswered + sum(n for k, n in outcomes.items() if "cut" in k and "503" not in k)
    pairs = [p for d in drains for p in d["pairs"]]
    seconds = sum(d["seconds_dispatched"] for d in drains)
    firsts = Counter(p.get("first", "") for p in pairs)
    spanned = sum(d["firsts_after_signal"] for d in drains)
    runs = f"{len(drains)} run{'s' * (len(drains) > 1)}"
    return [
        f"| drain ({runs}, {clients} closed-loop clients, half of them streaming, answers "
        f"0.2-{MAX_STEPS * STEP_S:g} s; `shutdown_grace_s: {GRACE_S:g}`): SIGTERM to exit "
        f"| {' / '.join(f'{s:.2f}' for s in exits)} s | <= grace + 1 s ({GRACE_S + 1:g} s) "
        f"| {verdict(max(exits) <= GRACE_S + 1)} |",
        f"| ... requests in flight at SIGTERM or sent after it, by answer | {tally(outcomes)} "
        "| each a whole answer, a 503, or a stream ended by an error event "
        f"| {verdict(wrong == 0)} |",
        f"| ... left without an answer (the connection closed or reset) | {unanswered}"
        + (f": on {tally(on)}" if unanswered else "")
        + f" | 0 | {verdict(unanswered == 0)} |",
        "| ... of those, read by the gateway (in its access log, or seen by the backend) "
        f"| {read} | 0 | {verdict(read == 0)} |",
        f"| ... {len(pairs)} pipelined pairs, the first answered after SIGTERM ({spanned} "
        f"did; {tally(firsts)}): seconds sent upstream | {seconds} | 0 "
        f"| {verdict(seconds == 0 and spanned == len(pairs))} |",
    ]


def reload_rows(reload: dict[str, Any]) -> list[str]:
    settle, poll = DEFAULT_RELOAD_SETTLE_S, DEFAULT_RELOAD_INTERVAL_S
    statuses = reload["statuses"]
    failed = sum(n for s, n in statuses.items() if s != "200")
    renamed = reload["rename_s"]
    in_place = reload["in_place_s"]
    slack = f" + {SLACK_S:g} s: a poll's own read and build, and the bench's read"
    return [
        f"| reload under load ({reload['clients']} clients on `/v1/embeddings`): answers but "
        f"200 | {failed} of {sum(statuses.values())} ({tally(statuses)}) | 0 "
        f"| {verdict(failed == 0)} |",
        "| ... the file rewritten in place, pausing 2 s and 5 s mid-file (each pause leaves "
        "a valid policy without the embeddings route): generations live while it was "
        f"written | {reload['early']} | 0 | {verdict(reload['early'] == 0)} |",
        "| ... its last write to the whole file live (the generation on `GET /policy`) | "
        + (f"{in_place:.2f} s" if in_place is not None else "never")
        + ("" if reload["whole"] else ", without its last routes")
        + f" | <= reload_settle_s + a poll ({settle + poll:g} s{slack}) | "
        + verdict(in_place is not None and in_place <= settle + poll + SLACK_S and reload["whole"])
        + " |",
        f"| ... a file renamed into place ({len(renamed)} times): live after "
        f"| {', '.join('never' if s is None else f'{s:.2f}' for s in renamed)} s "
        f"| <= a poll ({poll:g} s{slack}) "
        f"| {verdict(all(s is not None and s <= poll + SLACK_S for s in renamed))} |",
    ]


def bad_input_rows(bad: dict[str, Any]) -> list[str]:
    good = bad["good"]
    wrong = sum(n for s, n in good.items() if s != "200")
    states = ", ".join(f"{s:g}" for s in bad["states"])
    return [
        f"| one caller's bad input ({bad['rounds']} rounds of 15 rows, one malformed, "
        "batched; `circuit_breaker: {}`): good rows not answered 200 with their own sum "
        f"| {wrong} of {sum(good.values())}" + (f" ({tally(good)})" if wrong else "") + " | 0 "
        f"| {verdict(wrong == 0)} |",
        f"| ... the breaker opened (`gateway_breaker_state` read: {states}) "
        f"| {bad['opened']:g} times | never | {verdict(bad['opened'] == 0 and states == '0')} |",
    ]


def broken_rows(broken: dict[str, Any]) -> list[str]:
    bound = CONSECUTIVE + broken["clients"] - 1
    after, whole = broken["after_open"], broken["after_open_spare_whole"]
    return [
        f"| broken streams ({broken['clients']} streaming clients, a fallback; "
        f"`consecutive_failures: {CONSECUTIVE}`): broken streams clients saw "
        f"| {broken['broken']} of {broken['streams']} ({tally(broken['problems'])}) "
        f"| <= {CONSECUTIVE} + {broken['clients'] - 1} in flight "
        f"| {verdict(broken['broken'] <= bound)} |",
        "| ... streams sent once the breaker was open (`gateway_breaker_state` 1): whole "
        "from the fallback "
        f"| {whole} of {after} | all | {verdict(broken['opened'] and whole == after > 0)} |",
    ]


def notes(
    drains: list[dict[str, Any]], reload: dict[str, Any], bad: dict[str, Any], broken: Any
) -> list[str]:
    before = sum(d["before"] for d in drains)
    refused = sum(d["refused_connects"] for d in drains)
    closed = sum(d["closed_idle"] for d in drains)
    raced = sum(d["unanswered_on"][CUT_RACE] for d in drains)
    race = (
        f" {'The one request' if raced == 1 else f'The {raced} requests'} left without an "
        f"answer {'was' if raced == 1 else 'were'} sent on a stream's connection in the "
        "instant between the drain's last word to that stream (an error event at the "
        "deadline) and its close: the stream's head, sent before SIGTERM, could not say "
        "the connection closes, and the request met a reset, unread."
        if raced
        else ""
    )
    return [
        f"The drain: {before} requests answered before the SIGTERMs. A client reuses a "
        "kept-alive connection only if the gateway has not closed it, as a pooled client "
        f"checks (httpcore); {closed} times it had (the drain closes connections idle at "
        "SIGTERM, and the rest at its end) and the client connected again; "
        f"{refused} connections were refused (the listener closed). Which requests "
        "the gateway read is from its access log (`--access-log`) and the ids the backend "
        f"saw.{race}",
        "",
        f"Reload: {reload['generations']} generations in all, at the defaults "
        f"(`reload_interval_s` {DEFAULT_RELOAD_INTERVAL_S:g}, `reload_settle_s` "
        f"{DEFAULT_RELOAD_SETTLE_S:g}); the bench reads the generation every "
        f"{POLL_S * 1000:.0f} ms.",
        "",
        f"Bad input: the malformed rows' callers got {tally(bad['bad'])}; the model saw "
        f"{bad['calls']} calls, the malformed row in a merged batch of 14 or more in "
        f"{bad['bad_batched']} of {bad['rounds']} rounds; `gateway_backend_failures_total` "
        f"by reason: {fmt(bad['failures'])} (`batch_input` is never counted against the "
        "backend). Broken "
        f"streams: the primary saw {broken['primary_calls']} calls; "
        f"`gateway_backend_failures_total` by reason: {fmt(broken['failures'])}.",
    ]


def fmt(failures: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(failures.items())) or "none"


async def run(args: argparse.Namespace) -> tuple[Any, ...]:
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:

        def fresh(name: str) -> Path:
            path = Path(tmp) / name
            path.mkdir()
            return path

        async def step(name: str, coro: Awaitable[dict[str, Any]]) -> dict[str, Any]:
            started = time.perf_counter()
            result = await coro
            print(f"{name}: {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
            return result

        drains = [
            await step("drain", drain_run(fresh(f"drain{i}"), args.clients, args.load, i))
            for i in range(args.drains)
        ]
        reload = await step("reload", bench_reload(fresh("reload"), 6, args.renames))
        bad = await step("bad input", bench_bad_input(fresh("bad"), args.rounds))
        broken = await step(
            "broken streams", bench_broken_streams(fresh("broken"), 8, args.streaming)
        )
    return drains, reload, bad, broken


def cpu_seconds() -> tuple[float, float, float]:
    """Now, the CPU time the machine has been busy (``/proc/stat``), and that of this process
    with the children it waited for (the gateways)."""
    ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    own = os.times()
    ours = own.user + own.system + own.children_user + own.children_system
    return time.monotonic(), busy / os.sysconf("SC_CLK_TCK"), ours


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one drain, fewer rounds (~40 s)")
    parser.add_argument("--clients", type=int, default=24, help="the drain's clients")
    parser.add_argument("--no-write", action="store_true", help="print only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.drains, args.renames, args.rounds, args.load, args.streaming = (
        (1, 2, 20, 5.0, 3.0) if args.quick else (4, 4, 100, 6.0, 6.0)
    )
    before = cpu_seconds()
    drains, reload, bad, broken = asyncio.run(run(args))
    wall, busy, ours = (b - a for a, b in zip(before, cpu_seconds(), strict=True))
    shown = [a for a in argv if a != "--no-write"]
    command = " ".join(["python -m bench.bench_faults", *shown])
    others = max(0.0, busy - ours) / (wall * (os.cpu_count() or 1))
    table = report(drains, reload, bad, broken, command, args.clients, others)
    print(table)
    if not args.no_write:
        update_section("faults", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
