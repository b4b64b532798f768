"""The embedding index shared through Redis: what reading the stream costs a lookup, and how
long a cold replica takes to catch up.

    .venv/bin/python -m bench.bench_embedding_shared [--lookups 2000] [--backlog 10000 100000]

Starts a private ``redis-server`` (the binary must be installed) and measures, with real
Redis round trips on loopback:

* lookup latency of a tier over ``RedisStore`` without sharing, and with sharing when
  already caught up (each lookup reads the stream once: one XRANGE that finds nothing),
  for a paraphrase in a context with 1,000 entries (a verified hit: one GET, verify) and
  for a context with nothing cached (a miss, no embedding: sharing must read the stream
  before it can say so).  The embedder answers from a table, so the figures are the tier's
  own work; with the local MiniLM model installed, the same lookups embedding each text
  too (the stream is read while the text is embedded);
* ``SharedIndex.sync()`` alone, caught up;
* a cold replica catching up a backlog of N entries (384-dim vectors, 100 contexts): the
  time until all are in its index, and Redis's memory per stream entry (``INFO memory``).

Prints a markdown table and puts it in docs/benchmarks.md (``--no-write``: print only).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from bench.common import free_port, machine, process, update_section
from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import EmbeddingTier, local
from gateway.cache.keys import RequestKey
from gateway.cache.stores import RedisStore

DIMS = 384
CONTEXT_ENTRIES = 1000
BODY = b'{"object":"chat.completion","choices":[{"message":{"content":"' + b"x" * 360 + b'"}}]}'
COMMAND = "python -m bench.bench_embedding_shared"


class TableEmbedder:
    """Answers from a text -> vector table (a random vector for an unknown text)."""

    name = "table"

    def __init__(self) -> None:
        self.vectors: dict[str, np.ndarray] = {}
        self._rng = np.random.default_rng(11)

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.vectors.get(t, self._random()) for t in texts])

    def _random(self) -> np.ndarray:
        return unit(self._rng.standard_normal(DIMS))


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v)).astype(np.float32)


def key(text: str, system: str = "You are terse.") -> RequestKey:
    body = {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
    }
    where: dict[str, Any] = {
        "scope": "s",
        "route": "chat",
        "backend": "main",
        "model_version": "v1",
    }
    return request_key(body, path="/v1/chat/completions", **where)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def timed(n: int, fn: Callable[[int], Awaitable[object]]) -> list[float]:
    for i in range(min(n, 200)):  # warm the connection pool and caches
        await fn(i)
    gc.collect()
    times = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        await fn(i)
        times.append((time.perf_counter_ns() - t0) / 1e6)
    return times


async def lookups(url: str, n: int) -> list[tuple[str, list[float]]]:
    rng = np.random.default_rng(5)
    embed = TableEmbedder()
    writer = RedisStore.from_url(url, prefix="bl:")
    cache = ResponseCache(writer)
    publisher = EmbeddingTier(writer, embed)
    publisher.share(writer, "chat", "table")
    entry = CachedResponse(200, (), BODY, None, 0.0, "main", "v1", "chat", "s")
    stored = []
    for i in range(CONTEXT_ENTRIES):
        text = f"How do I tune the {'abcdefghij'[i % 10]} cache of server {tag(i)}?"
        k = key(text)
        embed.vectors[text] = unit(rng.standard_normal(DIMS))
        await cache.put(k, entry, 3600)
        assert k.prompt is not None
        await publisher.add(k, k.prompt, k.exact)
        stored.append(text)
    paraphrases = []
    for text in stored:
        asked = text.replace("How do I", "How can I", 1)
        noise = rng.standard_normal(DIMS)
        embed.vectors[asked] = unit(embed.vectors[text] + 0.33 * noise / np.sqrt(DIMS))
        paraphrases.append(asked)

    tiers: dict[str, EmbeddingTier] = {}
    for label in ("not shared", "shared, caught up"):
        store = RedisStore.from_url(url, prefix="bl:")
        tier = tiers[label] = EmbeddingTier(store, embed, max_entries=CONTEXT_ENTRIES * 2)
        if label == "not shared":
            for text in stored:
                k = key(text)
                assert k.prompt is not None
                await tier.add(k, k.prompt, k.exact)
        else:
            shared_index = tier.share(store, "chat", "table")
            while len(tier) < CONTEXT_ENTRIES:  # a backlog: caught up over several reads
                await shared_index.sync()
                await asyncio.sleep(0)
        assert len(tier) == CONTEXT_ENTRIES

    async def hit(tier: EmbeddingTier, i: int) -> None:
        k = key(paraphrases[i % len(paraphrases)])
        assert await tier.lookup(k, k.prompt or "") is not None

    async def empty(tier: EmbeddingTier, i: int) -> None:
        k = key("How do I tune this?", system=f"empty context {i}")
        assert await tier.lookup(k, k.prompt or "") is None

    async def embedded(tier: EmbeddingTier, i: int) -> None:
        k = key(f"How can I tune the cache of server {tag(i)} quickly today?")
        await tier.lookup(k, k.prompt or "")

    scenarios: list[tuple[str, Callable[[EmbeddingTier, int], Awaitable[None]], int]] = [
        ("verified hit (table embedder)", hit, n),
        ("empty context, a miss (table embedder)", empty, n),
    ]
    model: local.LocalEmbedder | None = None
    if local.available()[0]:
        model = local.LocalEmbedder()
        await model.load()
        scenarios.append(("a miss embedding with the local model", embedded, n))
    rows: list[tuple[str, list[float]]] = []
    for name, lookup, count in scenarios:
        for tier in tiers.values():
            tier._embed = model if lookup is embedded and model is not None else embed
        # interleaved, so that both see the same noise of a shared machine
        times = await timed_pair(count, lookup, list(tiers.values()))
        rows += [(f"lookup, {name}, {label}", t) for label, t in zip(tiers, times, strict=True)]
    sync = shared_index.sync
    rows.append(("`SharedIndex.sync()` alone, caught up", await timed(n, lambda _: sync())))
    for tier in tiers.values():
        await tier.aclose()
        await tier.store.close()
    await publisher.aclose()
    await writer.close()
    return rows


async def timed_pair(
    n: int, fn: Callable[[EmbeddingTier, int], Awaitable[None]], tiers: list[EmbeddingTier]
) -> list[list[float]]:
    for i in range(min(n, 200)):
        for tier in tiers:
            await fn(tier, i)
    gc.collect()
    times: list[list[float]] = [[] for _ in tiers]
    for i in range(n):
        for tier, out in zip(tiers, times, strict=True):
            t0 = time.perf_counter_ns()
            await fn(tier, 10_000 + i)
            out.append((time.perf_counter_ns() - t0) / 1e6)
    return times


async def catch_up(url: str, backlog: int) -> tuple[float, float, float, int]:
    """(seconds to catch up, Redis bytes per stream entry, first lookup's wait in ms,
    entries indexed)."""
    admin = aioredis.Redis.from_url(url)
    await admin.flushdb()
    rng = np.random.default_rng(backlog)
    writer = RedisStore.from_url(url, prefix="bc:", budget_s=1.0)
    publisher = EmbeddingTier(writer, TableEmbedder(), max_entries=backlog)
    shared = publisher.share(writer, "chat", "table")
    before = (await admin.info("memory"))["used_memory"]
    vectors = rng.standard_normal((1000, DIMS)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    contexts = [key("q", system=f"system prompt {c}").context or "" for c in range(100)]
    for start in range(0, backlog, 50):
        await asyncio.gather(
            *(
                shared.publish(contexts[i % 100], f"{i:040x}", vectors[i % 1000])
                for i in range(start, min(backlog, start + 50))
            )
        )
    used = (await admin.info("memory"))["used_memory"] - before
    length = await admin.xlen("bc:v:chat")

    store = RedisStore.from_url(url, prefix="bc:")
    cold = EmbeddingTier(store, TableEmbedder(), max_entries=backlog)
    reader = cold.share(store, "chat", "table")
    gc.collect()
    t0 = time.perf_counter()
    await reader.sync()
    first_wait_ms = (time.perf_counter() - t0) * 1000
    while reader.counts["indexed"] < length:
        await reader.sync()
        await asyncio.sleep(0)
    elapsed = time.perf_counter() - t0
    indexed = len(cold)
    for tier, s in ((cold, store), (publisher, writer)):
        await tier.aclose()
        await s.close()
    await admin.flushdb()
    await admin.aclose()
    return elapsed, used / length, first_wait_ms, indexed


def tag(n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = ""
    for _ in range(4):
        n, r = divmod(n, 26)
        out += letters[r]
    return out


async def run(n: int, backlogs: list[int], tmp: Path) -> str:
    port = free_port()
    args = ["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"]
    lines = [
        f"`{COMMAND} --lookups {n} --backlog {' '.join(map(str, backlogs))}` on {machine()}, "
        "redis-server on loopback.",
        "",
        "| lookup | p50 ms | p99 ms |",
        "|---|---|---|",
    ]
    with process([*args, "--dir", str(tmp)], port):
        url = f"redis://127.0.0.1:{port}/0"
        for label, times in await lookups(url, n):
            lines.append(f"| {label} | {pct(times, 0.5):.3f} | {pct(times, 0.99):.3f} |")
            print(lines[-1], flush=True)
        lines += [
            "",
            "| cold replica, backlog | caught up in | per 1,000 | first lookup waited "
            "| Redis per stream entry |",
            "|---|---|---|---|---|",
        ]
        for backlog in backlogs:
            elapsed, per_entry, first_ms, indexed = await catch_up(url, backlog)
            per_1000_ms = elapsed / indexed * 1e6
            lines.append(
                f"| {indexed:,} entries | {elapsed:.2f} s | {per_1000_ms:.1f} ms "
                f"| {first_ms:.1f} ms | {per_entry:.0f} B |"
            )
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lookups", type=int, default=2000)
    parser.add_argument("--backlog", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("needs a redis-server binary")
    with tempfile.TemporaryDirectory() as tmp:
        table = asyncio.run(run(args.lookups, args.backlog, Path(tmp)))
    print()
    print(table)
    if not args.no_write:
        update_section("embedding-shared", "## Embedding index shared through Redis\n\n" + table)


if __name__ == "__main__":
    main()
