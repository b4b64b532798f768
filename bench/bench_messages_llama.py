"""Anthropic's Messages API shared by single flight, in front of a real generating model:
llama.cpp's server with Gemma 3 270M (the ``llm`` extra), directly and through the gateway
in the same run, a fresh server for each path so each prompt cache starts empty.

    python -m bench.bench_messages_llama [--bursts 6] [--size 6] [--no-write]

Bursts of identical requests arrive together (a page asked by several clients at once, a
retry storm): ``--size`` copies of one question at temperature 0, each burst another
question, whole answers then streams.  Straight at the server every copy is generated (on
its slots, in turn); through the gateway (``coalesce: true``, no cache, so only requests in
flight together are shared) the first copy is generated and the others join it, each
handed the server's bytes as they came.  Per path: the bursts' wall time, each request's
latency, the tokens the server generated (its own ``tokens_predicted_total``), and
whether every copy in a burst got the same answer.  Writes its section of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from bench.common import machine, update_section
from bench.llama_load import percentile
from bench.plumbing import gateway
from gateway.testing.llama import MODEL_ALIAS, LlamaOptions, LlamaServer, start_servers, stop_all

QUESTIONS = (
    "Name three things to check before buying a used bicycle.",
    "How should I store fresh basil so it lasts longer?",
    "What is a good first houseplant for a dark room?",
    "Give two tips for packing a suitcase for a week away.",
    "Why does bread go stale, in one or two sentences?",
    "What should I look for in a pair of running shoes?",
    "How often should a wooden cutting board be oiled?",
    "Suggest a simple way to keep a kitchen sink drain clear.",
)
SLOTS = 2
MAX_TOKENS = 32


@dataclass
class Run:
    """What one path's bursts measured."""

    latencies_ms: list[float] = field(default_factory=list)
    bursts_ms: list[float] = field(default_factory=list)
    failed: int = 0
    same: bool = True  # every copy of each burst got the same answer
    generated: float = 0.0


def body(question: str, *, stream: bool) -> dict[str, Any]:
    return {
        "model": MODEL_ALIAS,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": stream,
        "messages": [{"role": "user", "content": question}],
    }


async def ask(http: httpx.AsyncClient, url: str, sent: dict[str, Any], run: Run) -> bytes:
    started = time.perf_counter()
    try:
        reply = await http.post(url + "/v1/messages", json=sent)
    except httpx.HTTPError:
        run.failed += 1
        return b""
    if reply.status_code != 200:
        run.failed += 1
        return b""
    run.latencies_ms.append((time.perf_counter() - started) * 1000)
    return _answer(reply.content, streamed=sent["stream"])


def _answer(content: bytes, *, streamed: bool) -> bytes:
    """What a reply says, without what differs between two generations of one text (its
    id, the server's timings)."""
    if not streamed:
        return json.dumps(json.loads(content)["content"]).encode()
    return b"".join(line for line in content.splitlines() if b"text_delta" in line)


async def bursts(url: str, questions: Sequence[str], size: int, *, stream: bool) -> Run:
    run = Run()
    limits = httpx.Limits(max_connections=size)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        for question in questions:
            sent = body(question, stream=stream)
            started = time.perf_counter()
            answers = await asyncio.gather(*(ask(http, url, sent, run) for _ in range(size)))
            run.bursts_ms.append((time.perf_counter() - started) * 1000)
            run.same = run.same and len(set(answers)) == 1 and answers[0] != b""
    return run


@contextlib.asynccontextmanager
async def server() -> AsyncIterator[LlamaServer]:
    options = LlamaOptions(slots=SLOTS, context_tokens_per_slot=512, threads=1)
    started = await asyncio.to_thread(start_servers, 1, options)
    try:
        yield started[0]
    finally:
        stop_all(started)


async def scene(questions: Sequence[str], size: int, *, stream: bool) -> dict[str, Run]:
    runs: dict[str, Run] = {}
    for path in ("direct", "gateway"):
        async with server() as llm:
            if path == "direct":
                run = await bursts(llm.url, questions, size, stream=stream)
            else:
                spec = {
                    "backends": {"llm": {"url": llm.url, "timeout_s": 300}},
                    "routes": [{"backend": "llm", "coalesce": True}],
                }
                async with gateway(spec) as url:
                    run = await bursts(url, questions, size, stream=stream)
            run.generated = llm.metrics().get("tokens_predicted_total", 0.0)
        runs[path] = run
    return runs


def report(command: str, size: int, count: int, scenes: dict[str, dict[str, Run]]) -> str:
    lines = [
        "## Anthropic's Messages API shared by single flight, before llama.cpp's server",
        "",
        f"`{command}` on {machine()}. One llama.cpp server of {SLOTS} slots (Gemma 3 270M, "
        f"Q4_K_M, one thread), fresh for each path; {count} bursts of {size} identical "
        f"requests at temperature 0 (`max_tokens: {MAX_TOKENS}`), each burst another "
        "question; the gateway's route `coalesce: true` without a cache, so only requests "
        "in flight together are shared.",
        "",
        "| shape | path | burst p50 ms | request p50 ms | request p99 ms | tokens generated "
        "| failed | one answer per burst |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, runs in scenes.items():
        for path, run in runs.items():
            lines.append(
                f"| {shape} | {path} | {percentile(run.bursts_ms, 0.5):.0f} | "
                f"{percentile(run.latencies_ms, 0.5):.0f} | "
                f"{percentile(run.latencies_ms, 0.99):.0f} | {run.generated:.0f} | "
                f"{run.failed} | {'yes' if run.same else 'no'} |"
            )
    for shape, runs in scenes.items():
        direct, via = runs["direct"], runs["gateway"]
        lines += [
            "",
            f"{shape.capitalize()}: the server generated {via.generated:.0f} tokens through "
            f"the gateway against {direct.generated:.0f} straight at it "
            f"({1 - via.generated / max(direct.generated, 1):.0%} saved); a burst took "
            f"{percentile(direct.bursts_ms, 0.5) / percentile(via.bursts_ms, 0.5):.2f}x as "
            "long straight at it.",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--bursts", type=int, default=6)
    parser.add_argument("--size", type=int, default=6)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    questions = [QUESTIONS[n % len(QUESTIONS)] for n in range(args.bursts)]
    command = (
        "python -m bench.bench_messages_llama"
        + (f" --bursts {args.bursts}" if args.bursts != 6 else "")
        + (f" --size {args.size}" if args.size != 6 else "")
    )

    async def run() -> dict[str, dict[str, Run]]:
        return {
            "whole": await scene(questions, args.size, stream=False),
            "streamed": await scene(questions, args.size, stream=True),
        }

    table = report(command, args.size, args.bursts, asyncio.run(run()))
    print(table)
    if not args.no_write:
        update_section("messages-llama", table)


if __name__ == "__main__":
    main()
