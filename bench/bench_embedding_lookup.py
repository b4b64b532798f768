"""Embedding-tier lookup latency with 100k entries, embedding time, memory per entry.

    python -m bench.bench_embedding_lookup [--entries 100000] [--queries 3000]
        [--verifier learned|rules]

Fills a ``MemoryStore`` and an ``EmbeddingTier`` with N chat answers, all in ONE context
(the worst case: one index holds every entry), then times ``EmbeddingTier.lookup`` for
fresh queries of three kinds: a paraphrase of a stored prompt (reworded frame, vector at
cosine ~0.95: a verified hit), an unseen prompt (a miss), and a paraphrase whose stored
entry has expired (a stale pointer dropped, then a miss).  Lookup times exclude embedding:
the tier's embedder here answers from a precomputed table, so the figures are the index
search, the store fetch and the verification (the learned verifier at the default error
budget, its cross-encoder reading up to ``MAX_CROSS`` candidates a lookup, unless
``--verifier rules``).  The request rows time each query whole: its prompt embedded by the
local model (``LocalEmbedder``, on the model's thread, as the tier embeds it once per
request), then the lookup; their worst p99 is the figure held to the budget.  The
cross-encoder's reads are timed as the lookups await them (the run on the model's thread
and the hops there and back), which is its share of the budget; a pair of short questions
is timed alone too.  Embedding vectors are mixtures
of real MiniLM vectors of the question sets in ``gateway/data`` when the ``embedding`` extra is
installed (random ones otherwise), so their geometry, and the binary prefilter's
selectivity, are a real model's.  Embedding time is measured separately on the local
model (one text per run, as the tier calls it).  Memory per entry is traced with
tracemalloc while a fresh tier indexes 20k entries (vector arrays with their growth slack,
keys, LRU and row bookkeeping; the cached answers themselves are the store's, see
bench_cache_lookup.py).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import random
import time
import tracemalloc
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from bench.common import machine, update_section
from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import EmbeddingTier, cross, learned, local, rules
from gateway.cache.embedding.index import PREFILTER_ROWS, hamming_bound
from gateway.cache.evaluate import read_pairs
from gateway.cache.guard import Verdict
from gateway.cache.keys import RequestKey
from gateway.cache.stores import MemoryStore
from gateway.policy.route import Semantic
from gateway.testing import FakeClock

DATA = Path(__file__).resolve().parent.parent / "gateway" / "data"
WORDS = (
    "python java rust server cache model token memory thread request error install configure "
    "deploy kubernetes docker network latency database index query table column backup "
    "restore upgrade version release test build compile debug profile optimise scale "
    "cluster node replica primary secondary shard partition stream batch queue worker"
).split()
PATH = "/v1/chat/completions"
SYSTEM = "You are a helpful assistant."
BODY = b'{"object":"chat.completion","choices":[{"message":{"content":"' + b"x" * 360 + b'"}}]}'
TRACED_ENTRIES = 20_000


class TimedReader(cross.CrossReader):
    """The cross-encoder as the tier reads it, each read timed as the lookup awaits it (the
    pair's run on the model's thread and the two hops to it and back)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    async def logit(self, cached: str, asked: str) -> float:
        t0 = time.perf_counter_ns()
        try:
            return await super().logit(cached, asked)
        finally:
            self.times.append((time.perf_counter_ns() - t0) / 1e6)


class TableEmbedder:
    """Answers from a precomputed text -> vector table: lookups time no model."""

    name = "table"

    def __init__(self) -> None:
        self.vectors: dict[str, np.ndarray] = {}

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])


def body(text: str) -> dict[str, object]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}],
    }


def key(text: str) -> RequestKey:
    return request_key(
        body(text), scope="s", route="r", backend="main", model_version="v1", path=PATH
    )


def tag(n: int) -> str:
    """A unique word without digits."""
    letters = ""
    while True:
        n, r = divmod(n, 26)
        letters += chr(ord("a") + r)
        if not n:
            return "zq" + letters


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v, axis=-1, keepdims=True)).astype(np.float32)


def base_vectors(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    texts = sorted(
        {p.first for p in read_pairs(DATA / "question_pairs.tsv")}
        | {p.second for p in read_pairs(DATA / "question_pairs.tsv")}
        | {p.first for p in read_pairs(DATA / "adversarial_pairs.tsv")}
    )
    if local.available()[0]:
        return local.LocalModel().encode(texts), f"mixtures of MiniLM vectors of {len(texts)} texts"
    return unit(rng.standard_normal((len(texts), 384)) + 0.3), "random (extra not installed)"


async def memory_per_entry(embed: TableEmbedder, texts: list[str]) -> float:
    """Bytes traced per entry while a fresh tier indexes ``texts`` (vectors precomputed;
    the tier's memo of recent query vectors, a fixed ~1.6 MB, is emptied first)."""
    tier = EmbeddingTier(MemoryStore(), embed, max_entries=len(texts) + 1)
    keys = [key(t) for t in texts]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for text, k in zip(texts, keys, strict=True):
        await tier.add(k, text, k.exact)
    tier._memo.clear()
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return used / len(texts)


def embedding_times(queries: int) -> list[tuple[str, list[float]]]:
    if not local.available()[0]:
        return []
    rows = []
    pairs = read_pairs(DATA / "question_pairs.tsv")
    reader = cross.CrossEncoder()  # one thread, as the tier runs it (local.THREADS)
    for first, second in [(p.first, p.second) for p in pairs][:5]:
        reader.logits([(first, second)])
    times = []
    for p in (pairs * (queries // len(pairs) + 1))[: min(queries, 500)]:
        t0 = time.perf_counter_ns()
        reader.logits([(p.first, p.second)])
        times.append((time.perf_counter_ns() - t0) / 1e6)
    rows.append(("cross-encoder, a pair, 1 thread", times))
    short = [p.second for p in pairs]
    long = [" ".join(short[i : i + 25]) for i in range(0, 100, 4)]  # ~200 words each
    for threads in (1, 2):
        model = local.LocalModel(threads=threads)
        model.encode(short[:5])
        for name, texts in (("short question", short), ("~200 words", long)):
            times = []
            for text in (texts * (queries // len(texts) + 1))[: min(queries, 500)]:
                t0 = time.perf_counter_ns()
                model.encode([text])
                times.append((time.perf_counter_ns() - t0) / 1e6)
            rows.append((f"{name}, {threads} thread{'s' if threads > 1 else ''}", times))
    return rows


async def main(entries: int, queries: int, verifier: str = "learned") -> list[str]:
    lines: list[str] = []

    def out(text: str) -> None:
        print(text)
        lines.append(text)

    rng = np.random.default_rng(7)
    prng = random.Random(7)
    base, origin = base_vectors(rng)
    clock = FakeClock()
    store = MemoryStore(max_bytes=1 << 40, clock=clock)
    cache = ResponseCache(store, clock=clock)
    embed = TableEmbedder()
    semantic = Semantic(method="embedding", verifier=verifier)  # type: ignore[arg-type]
    reader = TimedReader()
    checker: Callable[[str, str, float], Verdict] = rules
    if learned.uses_learned(semantic):
        point = learned.verifier_for(semantic)
        checker = learned.LearnedVerifier(point.model, point.min_score, reader, needed=point.needed)
    tier = EmbeddingTier(store, embed, max_entries=entries + 1, verifier=checker)
    dims = base.shape[1]

    def stored_vector() -> np.ndarray:
        i, j = rng.integers(0, len(base), 2)
        return unit(base[i] + 0.8 * base[j] + 0.6 * rng.standard_normal(dims) / np.sqrt(dims))

    def near(vector: np.ndarray) -> np.ndarray:  # cosine about 0.95
        return unit(vector + 0.33 * rng.standard_normal(dims) / np.sqrt(dims))

    prompts = []  # no digits: numbers are part of the context key, and this is ONE context
    for n in range(entries):
        words = " ".join(prng.choices(WORDS, k=prng.randint(4, 12)))
        prompts.append(f"How do I {words} {tag(n)}?")
    entry = CachedResponse(200, (), BODY, None, 0.0, "main", "v1", "r", "s")

    async def fill(texts: list[str], ttl_s: float = 3600) -> None:
        for text in texts:
            k = key(text)
            embed.vectors[text] = stored_vector()
            await cache.put(k, entry, ttl_s)
            await tier.add(k, text, k.exact)

    expiring = prompts[:queries]
    started = time.perf_counter()
    await fill(expiring, ttl_s=10)
    await fill(prompts[queries:])
    fill_s = time.perf_counter() - started
    per_entry = await memory_per_entry(embed, prompts[: min(entries, TRACED_ENTRIES)])

    def paraphrases(texts: list[str]) -> list[str]:
        out = []
        for text in texts:
            asked = text.replace("How do I", "How can I", 1)
            embed.vectors[asked] = near(embed.vectors[text])
            out.append(asked)
        return out

    live = paraphrases(prng.sample(prompts[queries:], queries))
    unseen = []
    for n in range(queries):
        text = f"Why does {' '.join(prng.choices(WORDS, k=6))} break {tag(n)}?"
        embed.vectors[text] = stored_vector()
        unseen.append(text)
    stale = paraphrases(expiring)

    embedder = local.LocalEmbedder() if local.available()[0] else None
    if embedder is not None:
        await embedder.load()
        await embedder(["How do I warm up the model?"])
        await reader.load()
        await reader.logit("How do I warm up the model?", "How can I warm up the model?")
        reader.times.clear()

    async def timed(texts: list[str]) -> tuple[list[float], list[float], int]:
        """Each lookup's time, and each request's: the prompt embedded by the local model
        (as the tier embeds it, on the model's thread), then the lookup."""
        gc.collect()
        times, whole, hits = [], [], 0
        for text in texts:
            k = key(text)
            assert k.prompt is not None
            t0 = time.perf_counter_ns()
            if embedder is not None:
                await embedder([k.prompt])
            t1 = time.perf_counter_ns()
            hit = await tier.lookup(k, k.prompt)
            t2 = time.perf_counter_ns()
            times.append((t2 - t1) / 1e6)
            whole.append((t2 - t0) / 1e6)
            hits += hit is not None
        return times, whole, hits

    out(f"entries: {len(tier)} in one context, {origin}; filled in {fill_s:.1f} s")
    out(f"host load average (1 min) before timing: {os.getloadavg()[0]:.1f}")
    out(
        f"memory: {per_entry:.0f} B/entry traced over {min(entries, TRACED_ENTRIES)} adds to a "
        f"fresh tier (fp16 vector {2 * dims} B + sign code {dims // 8} B + growth slack + "
        f"keys, LRU and row bookkeeping); arrays at {len(tier)} entries: "
        f"{tier.nbytes() / len(tier):.0f} B/entry allocated"
    )
    out(
        f"prefilter at threshold {tier.threshold:.2f}: Hamming bound "
        f"{hamming_bound(tier.threshold, 64)} of the first 64 bits, then "
        f"{hamming_bound(tier.threshold, dims)} of {dims}; at most {PREFILTER_ROWS} exact "
        "cosines per lookup"
    )
    out(
        f"{'lookup (embedding excluded)':<34} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'hits':>7}"
    )
    results = [("paraphrase (verified hit)", await timed(live))]
    results.append(("unseen (miss)", await timed(unseen)))
    clock.advance(11)
    results.append(("paraphrase of expired (stale)", await timed(stale)))
    for name, (times, _, hits) in results:
        out(
            f"{name:<34} {pct(times, 0.5):>8.3f} {pct(times, 0.99):>8.3f} {max(times):>8.3f} "
            f"{hits / len(times):>7.1%}"
        )
    if embedder is not None:
        out(f"{'request: embedding + lookup':<34} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for name, (_, whole, _) in results:
            row = f"{pct(whole, 0.5):>8.3f} {pct(whole, 0.99):>8.3f} {max(whole):>8.3f}"
            out(f"{'+ ' + name:<34} {row}")
    if reader.times:
        row = f"{pct(reader.times, 0.5):>8.3f} {pct(reader.times, 0.99):>8.3f}"
        out(
            f"{'cross-encoder reads in the lookups':<34} {row} {max(reader.times):>8.3f} "
            f"{len(reader.times):>7}"
        )
    out(f"tier after the run: {tier!r}")
    rows = embedding_times(queries)
    if rows:
        out(f"{'one run of the local models':<34} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
        for name, times in rows:
            out(f"{name:<34} {pct(times, 0.5):>8.3f} {pct(times, 0.99):>8.3f} {max(times):>8.3f}")
    else:
        out("embedding time: the embedding extra is not installed")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=3000)
    parser.add_argument("--no-gc", action="store_true", help="disable the cyclic GC while timing")
    parser.add_argument("--verifier", choices=("learned", "rules"), default="learned")
    args = parser.parse_args()
    if args.no_gc:
        gc.disable()
    printed = asyncio.run(main(args.entries, args.queries, args.verifier))

    def p99_of(prefix: str, column: int) -> float:
        found = [float(line.split()[column]) for line in printed if line.startswith(prefix)]
        return max(found) if found else float("nan")

    # lookup rows end "p50 p99 max hits", request and embedding rows "p50 p99 max"
    lookup = max(p99_of(kind, -3) for kind in ("paraphrase (", "unseen", "paraphrase of"))
    request = max(p99_of(f"+ {kind}", -2) for kind in ("paraphrase (", "unseen", "paraphrase of"))
    embedding = p99_of(f"short question, {local.THREADS} thread", -2)
    reading = p99_of("cross-encoder reads in the lookups", -3)
    alone = p99_of("cross-encoder, a pair", -2)
    command = "python -m bench.bench_embedding_lookup" + (" --no-gc" if args.no_gc else "")
    if args.verifier != "learned":
        command += f" --verifier {args.verifier}"
    cross_row = (
        f"| the cross-encoder's share <= 5 ms p99 (at most {learned.MAX_CROSS} run a lookup, "
        f"included in the lookup above) | {learned.MAX_CROSS} x {reading:.3f} ms, a read of "
        f"the bench's pairs as a lookup awaits it (a pair of short questions alone: "
        f"{alone:.3f} ms) | "
        f"{'met' if learned.MAX_CROSS * reading <= 5 else '**missed**'} |\n"
        if args.verifier == "learned"
        else ""
    )
    update_section(
        "embedding",
        "## Embedding cache tier (issues 4, 14 and 26)\n\n"
        f"`{command}` on {machine()}; {args.entries} entries in one exact context "
        "(the worst case: lookups only search their own context).  The lookup rows include "
        "the verification, with the learned verifier's cross-encoder (issue 26) on the "
        "candidates it reads.  One run: this VM's cores are not steady, and docs/caching.md "
        "gives the spread of several.\n\n```\n"
        + "\n".join(printed)
        + "\n```\n\n| target | measured | |\n|---|---|---|\n"
        f"| lookup plus verification plus embedding the prompt <= 10 ms p99, plus up to 5 ms "
        f"for the cross-encoder | {request:.3f} ms p99 a request, the worst of the three kinds "
        f"(the p99s of its parts timed apart, added: {lookup:.3f} + {embedding:.3f} = "
        f"{lookup + embedding:.3f}) | {'met' if request <= 15 else '**missed**'} in this run |\n"
        + cross_row,
    )
