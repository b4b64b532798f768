"""The gateway's own cost of merging 32 embedding requests into one call and splitting the answer.

Run: ``.venv/bin/python bench/bench_batch_merge.py [--dim 384] [--rounds 2000]``

Rows (each timed per batch of 32 single-input ``/v1/embeddings`` requests; p50 / p99):

- ``logic``: compat keys, item counts, ``merge`` (encoded) and ``split`` on an already
  parsed answer: the batching logic alone;
- ``merge+split``: the same, but from the backend's raw answer bytes to 32 encoded answers
  the way the batcher does it (``split_answer``: vectors pass through as raw bytes): the
  gateway's own cost of merging and splitting, the figure the target is about;
- ``stdlib json``: ``merge+split`` done the plain way, decoding every float and encoding
  every share with ``json``, for comparison;
- ``batcher``: 32 concurrent ``Batcher.submit`` calls through the event loop into one call
  of a backend that answers at once: ``merge+split`` plus scheduling, futures and timers.

Target (issue 5): merging and splitting a batch of 32 costs <= 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

from gateway.batching import Batcher, FixedLimit, OpenAIEmbeddings
from gateway.batching.answer import split_answer

BATCH = 32


def bodies() -> list[dict[str, Any]]:
    return [
        {"model": "bge-small", "input": f"what is request number {i} about, really?"}
        for i in range(BATCH)
    ]


def answer(dim: int) -> bytes:
    rng = random.Random(7)
    data = [
        {"object": "embedding", "index": i, "embedding": [rng.uniform(-1, 1) for _ in range(dim)]}
        for i in range(BATCH)
    ]
    usage = {"prompt_tokens": 10 * BATCH, "total_tokens": 10 * BATCH}
    return json.dumps(
        {"object": "list", "data": data, "model": "bge-small", "usage": usage}
    ).encode()


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(0.99 * (len(ordered) - 1))]


def bench_merge_split(raw: bytes, rounds: int, mode: str) -> list[float]:
    adapter = OpenAIEmbeddings()
    reqs = bodies()
    parsed = json.loads(raw)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for body in reqs:
            adapter.compat_key(body)
            adapter.count(body)
        merged = json.dumps(adapter.merge(reqs)).encode()
        if mode == "logic":
            adapter.split(200, parsed, reqs)
        elif mode == "gateway":
            split_answer(adapter, 200, raw, reqs)
        else:  # the plain way: decode every float, encode every share
            for part in adapter.split(200, json.loads(raw), reqs):
                json.dumps(part, separators=(",", ":")).encode()
        out.append(time.perf_counter() - t0)
    assert merged
    return out


async def bench_batcher(raw: bytes, rounds: int) -> list[float]:
    async def send(body: Any, verdict: Any) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
        return 200, (), raw

    batcher = Batcher(OpenAIEmbeddings(), send, limit=FixedLimit(BATCH), max_wait_ms=1000)
    reqs = bodies()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        answers = await asyncio.gather(*(batcher.submit(b) for b in reqs))
        for a in answers:
            a.body  # noqa: B018 - the per-caller encoding is part of the cost
        out.append(time.perf_counter() - t0)
    assert batcher.upstream_calls == rounds, batcher
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=384, help="embedding dimensions")
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    raw = answer(args.dim)
    bench_merge_split(raw, 50, "gateway")  # warm up
    rows = [
        ("logic", bench_merge_split(raw, args.rounds, "logic")),
        ("merge+split", bench_merge_split(raw, args.rounds, "gateway")),
        ("stdlib json", bench_merge_split(raw, args.rounds, "stdlib")),
        ("batcher", asyncio.run(bench_batcher(raw, args.rounds))),
    ]
    print(f"batch of {BATCH} embedding requests, {args.dim} dims, {args.rounds} rounds")
    print(f"| {'what':<14} | {'p50 ms':>8} | {'p99 ms':>8} |")
    print(f"|{'-' * 16}|{'-' * 10}|{'-' * 10}|")
    for name, samples in rows:
        p50, p99 = percentiles(samples)
        print(f"| {name:<14} | {p50 * 1000:8.3f} | {p99 * 1000:8.3f} |")


if __name__ == "__main__":
    main()
