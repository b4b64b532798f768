"""Near-duplicate lookup latency and memory per entry of the memory store.

    .venv/bin/python bench/bench_cache_lookup.py [--entries 100000] [--queries 5000]

Fills a ``MemoryStore`` with N chat answers (~400-byte bodies) whose prompts are random
6-20 word questions, all in ONE context (the worst case for bucket sizes), then times
``ResponseCache.lookup`` for three kinds of query, each a fresh text (no memoised
normalisation): a near-duplicate of a stored prompt (case/punctuation edit: a SimHash hit),
an unseen prompt (a miss after the near tier), and an exact repeat.  Memory per entry is
measured with tracemalloc over the fill, next to the store's own byte accounting.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
import tracemalloc
from typing import Any

from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.simhash import fingerprint
from gateway.cache.stores import MemoryStore

WORDS = (
    "how what why when where which who is are do does can should the a of in on for to with "
    "python java rust server cache model token memory thread request error install configure "
    "deploy kubernetes docker network latency database index query table column backup "
    "restore upgrade version release test build compile debug profile optimise scale "
    "cluster node replica primary secondary shard partition stream batch queue worker"
).split()
WHERE: dict[str, Any] = {"scope": "s", "route": "r", "backend": "main", "model_version": "v1"}
PATH = "/v1/chat/completions"
TRACED_ENTRIES = 20_000
BODY = b'{"object":"chat.completion","choices":[{"message":{"content":"' + b"x" * 360 + b'"}}]}'


def prompt(rng: random.Random) -> str:
    words = rng.choices(WORDS, k=rng.randint(6, 20))
    words[0] = words[0].capitalize()
    return " ".join(words) + "?"


def body(text: str) -> dict[str, object]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def main(entries: int, queries: int) -> None:
    rng = random.Random(7)
    store = MemoryStore(max_bytes=1 << 40)
    cache = ResponseCache(store)
    prompts = [prompt(rng) for _ in range(entries)]
    entry = CachedResponse(200, (), BODY, None, 0.0, "main", "v1", "r", "s")

    # The first TRACED_ENTRIES warm the bounded memo caches; the next ones are traced.
    traced = min(entries // 2, TRACED_ENTRIES)
    for text in prompts[:traced]:
        await cache.put(request_key(body(text), path=PATH, **WHERE), entry, 3600)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for text in prompts[traced : 2 * traced]:
        await cache.put(request_key(body(text), path=PATH, **WHERE), entry, 3600)
    gc.collect()
    per_entry = (tracemalloc.get_traced_memory()[0] - before) / traced
    tracemalloc.stop()
    started = time.perf_counter()
    for text in prompts[2 * traced :]:
        await cache.put(request_key(body(text), path=PATH, **WHERE), entry, 3600)
    fill_s = time.perf_counter() - started
    stats = store.stats()

    async def timed(texts: list[str]) -> tuple[list[float], int]:
        gc.collect()
        times, hits = [], 0
        for text in texts:
            t0 = time.perf_counter_ns()
            key = request_key(body(text), path=PATH, **WHERE)
            hit = await cache.lookup(key)
            times.append((time.perf_counter_ns() - t0) / 1e6)
            hits += hit is not None
        return times, hits

    sample = rng.sample(prompts, queries)
    near = [p.lower().rstrip("?") + " ." for p in sample]
    unseen = [prompt(rng) + " " + rng.choice(WORDS) for _ in range(queries)]
    fps = [t + "!" for t in sample]

    fp_times = []
    for text in fps:
        t0 = time.perf_counter_ns()
        fingerprint(text)
        fp_times.append((time.perf_counter_ns() - t0) / 1e6)

    print(f"entries: {entries} in one context; {entries - 2 * traced} stored in {fill_s:.1f} s")
    print(
        f"memory: {per_entry:.0f} B/entry traced over {traced} entries (tracemalloc), "
        f"{(stats.bytes or 0) / entries:.0f} B/entry accounted by the store"
    )
    print(f"{'query':<26} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'hit rate':>9}")
    for name, texts in (
        ("near-duplicate (simhash)", near),
        ("unseen (miss)", unseen),
        ("exact repeat", sample),
    ):
        times, hits = await timed(texts)
        print(
            f"{name:<26} {pct(times, 0.5):>8.3f} {pct(times, 0.99):>8.3f} "
            f"{max(times):>8.3f} {hits / len(texts):>9.1%}"
        )
    print(f"{'fingerprint only':<26} {pct(fp_times, 0.5):>8.3f} {pct(fp_times, 0.99):>8.3f}")
    print("lookup times include computing the RequestKey (canonical JSON + sha256);")
    keys = [body(t) for t in unseen]
    t0 = time.perf_counter_ns()
    for b in keys:
        request_key(b, path=PATH, **WHERE)
    print(f"request_key alone: {(time.perf_counter_ns() - t0) / len(keys) / 1e6:.3f} ms mean")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=5000)
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    args = parser.parse_args()
    if args.no_gc:
        gc.disable()
    asyncio.run(main(args.entries, args.queries))
