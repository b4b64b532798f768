"""The backend as judge, measured on a real model: llama.cpp's server with Gemma 3 270M (a
*base* model) asked about the grey zone of a labelled pair file (``qqp_dev.tsv``), as
``gateway cache-eval --judge`` asks it, and two ways to make a weak judge stricter:

* ``judge (as shipped)``: the gateway's own request (``judge.request_body``: its system
  prompt, temperature 0, 5 tokens) and parser (``judge.parse``: a clear yes);
* ``P(yes) >= t``: the same request, the yes taken from the probability of the first token
  (``logprobs``): P(yes) / (P(yes) + P(no)) over the top tokens, at thresholds ``t``;
* ``few-shot P(yes) >= t``: a stricter completion prompt for a base model, six solved
  examples (none from the pair file) that differ in a number, a place, a negation or a
  direction, then the pair; the same probability.

Each verdict is read against the pair's label.  The default error budget
(``max_false_hit_rate`` 1%) leaves the judge room for a few false yeses: the tier's own
false hits plus the judge's, projected from the sample's rate onto the whole grey zone (at
its 95% upper bound), must stay within 1% of the file's different pairs.  Also the cost of
one judged pair: the prompt tokens the server computed (a shared prefix is reused from the
slot), and its latency, which is what ``mode: inline`` adds to a miss.

``python -m bench.bench_judge`` writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, machine, update_section
from bench.llama_load import percentile
from gateway.cache import calibrate
from gateway.cache.embedding.judge import parse, request_body
from gateway.cache.evaluate import Pair, local_embed, read_pairs
from gateway.cache.judge_eval import classify
from gateway.policy.route import DEFAULT_MAX_FALSE_HIT_RATE, Judge
from gateway.testing.llama import MODEL_ALIAS, LlamaOptions, LlamaServer

PAIRS = ROOT.parent / "shared" / "data" / "qqp_dev.tsv"
CONCURRENCY = 4
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
FEW_SHOT = """\
Two questions are the same only if one answer fully and correctly serves both. A different \
number, name, place, time, direction, negation or subject makes them different.

Question 1: How do I learn to play the guitar quickly?
Question 2: What is the fastest way to learn guitar?
Same: yes

Question 1: How do I become a doctor in India?
Question 2: How do I become a doctor in Canada?
Same: no

Question 1: Why is the sky blue?
Question 2: What makes the sky look blue?
Same: yes

Question 1: Is it safe to eat eggs every day?
Question 2: Is it unsafe to eat eggs every day?
Same: no

Question 1: What is the best laptop under 500 dollars?
Question 2: Which laptop is best for less than $500?
Same: yes

Question 1: How can I convert Celsius to Fahrenheit?
Question 2: How can I convert Fahrenheit to Celsius?
Same: no

Question 1: {first}
Question 2: {second}
Same:"""


@dataclass
class Asked:
    """One variant's answers on the sample: a score per pair (None: no answer), costs."""

    name: str
    scores: list[float | None] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    computed_tokens: list[int] = field(default_factory=list)


def yes_probability(top: Sequence[dict[str, Any]]) -> float:
    """P(yes) / (P(yes) + P(no)) over a token's top alternatives (0 with neither: the
    model was not about to answer yes)."""
    yes = no = 0.0
    for alt in top:
        word = str(alt.get("token", "")).strip().lower()
        if word in ("yes", "no"):
            p = math.exp(float(alt["logprob"]))
            yes, no = (yes + p, no) if word == "yes" else (yes, no + p)
    return yes / (yes + no) if yes + no else 0.0


async def ask_chat(http: httpx.AsyncClient, url: str, pair: Pair) -> tuple[float, float, dict]:
    """The shipped judge's request (with logprobs): its parsed verdict and P(yes)."""
    body = json.loads(request_body(pair.first, pair.second, MODEL_ALIAS))
    body |= {"logprobs": True, "top_logprobs": 10}
    answer = (await http.post(url + "/v1/chat/completions", json=body)).json()
    choice = answer["choices"][0]
    verdict = 1.0 if parse(choice["message"]["content"] or "") else 0.0
    first = choice["logprobs"]["content"][0]["top_logprobs"]
    return verdict, yes_probability(first), answer["timings"]


async def ask_few_shot(http: httpx.AsyncClient, url: str, pair: Pair) -> tuple[float, dict]:
    body = {
        "model": MODEL_ALIAS,
        "prompt": FEW_SHOT.format(first=pair.first, second=pair.second),
        "max_tokens": 1,
        "temperature": 0,
        "n_probs": 10,
    }
    answer = (await http.post(url + "/completion", json=body)).json()
    top = answer["completion_probabilities"][0]["top_logprobs"]
    return yes_probability(top), answer["timings"]


async def ask_all(url: str, pairs: Sequence[Pair]) -> list[Asked]:
    shipped, chat_p, few = Asked("judge (as shipped)"), Asked("P(yes)"), Asked("few-shot P(yes)")
    gate = asyncio.Semaphore(CONCURRENCY)

    async def chat_one(http: httpx.AsyncClient, index: int, pair: Pair) -> None:
        async with gate:
            started = time.perf_counter()
            try:
                verdict, p_yes, timings = await ask_chat(http, url, pair)
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
                return
            ms = (time.perf_counter() - started) * 1000
            for asked, score in ((shipped, verdict), (chat_p, p_yes)):
                asked.scores[index] = score
                asked.latencies_ms.append(ms)
                asked.computed_tokens.append(timings["prompt_n"])

    async def few_one(http: httpx.AsyncClient, index: int, pair: Pair) -> None:
        async with gate:
            started = time.perf_counter()
            try:
                few.scores[index], timings = await ask_few_shot(http, url, pair)
            except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError):
                return
            few.latencies_ms.append((time.perf_counter() - started) * 1000)
            few.computed_tokens.append(timings["prompt_n"])

    for asked in (shipped, chat_p, few):
        asked.scores = [None] * len(pairs)
    async with httpx.AsyncClient(timeout=120) as http:
        # one prompt at a time, so the slots keep its shared prefix
        for one in (chat_one, few_one):
            await asyncio.gather(*(one(http, i, p) for i, p in enumerate(pairs)))
    return [shipped, chat_p, few]


@dataclass(frozen=True, slots=True)
class Row:
    """One variant at one threshold: its verdicts on the sample's grey pairs as an operating
    point (a yes a hit: ``true_hits`` duplicates confirmed, ``false_hits`` different pairs
    confirmed), and what they project onto the whole file."""

    name: str
    threshold: float | None
    sample: calibrate.Point
    allowance: float  # the false-yes rate the budget leaves the judge on grey differents
    recall_file: float  # the tier's and the judge's projected recall on the whole file

    @property
    def safe(self) -> bool:
        return self.sample.upper <= self.allowance


def rows_for(
    variants: Sequence[Asked], labels: Sequence[bool], tier: calibrate.Point, grey: tuple[int, int]
) -> list[Row]:
    grey_same, grey_different = grey
    room = max(0.0, DEFAULT_MAX_FALSE_HIT_RATE * tier.negatives - tier.false_hits)
    allowance = room / grey_different
    rows = []
    for asked in variants:
        cuts: Sequence[float | None] = (None,) if asked.name.startswith("judge") else THRESHOLDS
        for cut in cuts:
            t = 0.5 if cut is None else cut
            answered = [(s, y) for s, y in zip(asked.scores, labels, strict=True) if s is not None]
            same = sum(1 for _, y in answered if y)
            yes_same = sum(1 for s, y in answered if y and s >= t)
            yes_different = sum(1 for s, y in answered if not y and s >= t)
            added = yes_same / same * grey_same if same else 0.0
            recall = (tier.true_hits + added) / tier.positives
            point = calibrate.Point(t, yes_same, yes_different, same, len(answered) - same)
            rows.append(Row(asked.name, cut, point, allowance, recall))
    return rows


def run(path: Path, limit: int) -> tuple[calibrate.Point, tuple[int, int], list[Row], list[Asked]]:
    pairs = read_pairs(path)
    floor = Judge().min_score
    kinds, min_score = classify(pairs, local_embed(), floor)
    positives = sum(p.label for p in pairs)
    hits = [i for i, k in enumerate(kinds) if k == "hit"]
    true_hits = sum(pairs[i].label for i in hits)
    tier = calibrate.Point(
        min_score, true_hits, len(hits) - true_hits, positives, len(pairs) - positives
    )
    grey = [i for i, k in enumerate(kinds) if k == "grey"]
    grey_same = sum(pairs[i].label for i in grey)
    sample = [pairs[i] for i in grey[:limit]]
    options = LlamaOptions(slots=CONCURRENCY, context_tokens_per_slot=640)
    with LlamaServer(options) as server:
        variants = asyncio.run(ask_all(server.url, sample))
    labels = [bool(p.label) for p in sample]
    counts = (grey_same, len(grey) - grey_same)
    return tier, counts, rows_for(variants, labels, tier, counts), variants


def report(path: Path, limit: int, tier, grey, rows: list[Row], variants: list[Asked]) -> str:
    command = f"python -m bench.bench_judge --limit {limit}"
    sample = rows[0].sample.positives + rows[0].sample.negatives
    lines = [
        "## The backend as judge on a real model (issue 25)",
        "",
        f"`{command}` on {machine()}: `llama-server` with Gemma 3 270M Q4_K_M (the base "
        f"model), {CONCURRENCY} slots, asked about the first {sample} of the "
        f"{sum(grey)} grey-zone pairs of `{path.name}` ({grey[0]} duplicates, {grey[1]} not "
        f"in the whole zone), {CONCURRENCY} at a time. The embedding tier alone at its "
        f"defaults: recall {tier.recall:.1%}, {tier.false_hits} false hits of "
        f"{tier.negatives}. The default budget (1%) leaves the judge "
        f"{rows[0].allowance:.1%} of the grey zone's different pairs as false yeses "
        "(its 95% upper bound must stay under that).",
        "",
        "| judge | yes at | precision on the grey zone | grey duplicates confirmed | "
        "false yes on grey different (95% upper) | recall on the file | safe at 1% |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.sample
        precision = "-" if p.precision is None else f"{p.precision:.1%}"
        lines.append(
            f"| {r.name} | {'its parser' if r.threshold is None else r.threshold} | "
            f"{precision} | {p.true_hits}/{p.positives} | {p.false_hits}/{p.negatives} "
            f"({p.upper:.1%}) | {r.recall_file:.1%} | {'yes' if r.safe else 'no'} |"
        )
    lines += [
        "",
        "| request | prompt tokens computed per pair, p50 | latency p50 ms | p99 ms | answered |",
        "|---|---|---|---|---|",
    ]
    for asked in (variants[0], variants[2]):
        answered = sum(1 for s in asked.scores if s is not None)
        lines.append(
            f"| {asked.name} | {percentile(asked.computed_tokens, 0.5):.0f} | "
            f"{percentile(asked.latencies_ms, 0.5):.0f} | "
            f"{percentile(asked.latencies_ms, 0.99):.0f} | {answered}/{len(asked.scores)} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=Path, default=PAIRS)
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    tier, grey, rows, variants = run(args.pairs, args.limit)
    table = report(args.pairs, args.limit, tier, grey, rows, variants)
    print(table)
    if not args.no_write:
        update_section("judge", table)


if __name__ == "__main__":
    main()
