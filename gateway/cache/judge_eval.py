"""``gateway cache-eval --judge PAIRS.tsv``: the backend as judge, measured on labelled pairs.

Each pair is taken as the embedding tier at its defaults takes a cached message
(``first``) and an asked one (``second``): below the cosine threshold it is never a
candidate; then the learned verifier at the default budget accepts it (a hit), refuses it
in the grey zone (by score, no hard difference, a score >= ``judge.min_score``), or
refuses it.  Without ``--judge-url`` the report is the grey zone's: how many pairs the
judge would be asked about and how many of them are duplicates.  With ``--judge-url``, an
OpenAI-compatible server, every grey pair (up to ``--judge-limit``) is put to the served
model with the gateway's own request and parser (``judge.BackendJudge.ask``, through the
gateway's upstream transport), and the report adds the judge's precision on the grey zone
and the tier's precision and recall with the judge's yeses as hits.  Only the embedding
tier is modelled (the exact and SimHash tiers hit few paraphrases).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.cache.calibrate import Point
from gateway.cache.embedding.judge import BackendJudge
from gateway.cache.embedding.learned import SCORE, verifier_for
from gateway.cache.embedding.tier import DEFAULT_THRESHOLD
from gateway.cache.evaluate import BatchEmbed, Pair, read_pairs
from gateway.clock import SYSTEM_CLOCK
from gateway.errors import GatewayError
from gateway.metrics import Metrics
from gateway.policy.model import Backend, Judge, Semantic
from gateway.transport.backends import Upstreams

CONCURRENCY = 4
"""Judge calls in flight at once."""


@dataclass(frozen=True, slots=True)
class JudgeReport:
    """The tier alone, the grey zone, and (when asked) the judge's verdicts there."""

    source: str
    tier: Point
    grey_same: int
    grey_different: int
    floor: float
    judged: Point | None = None
    asked: int = 0
    errors: int = 0


def classify(pairs: Sequence[Pair], embed: BatchEmbed, floor: float) -> tuple[list[str], float]:
    """ "hit", "grey" or "miss" for each pair, and the verifier's ``min_score``."""
    texts = sorted({t for p in pairs for t in (p.first, p.second)})
    vectors = np.vstack([embed(texts[i : i + 64]) for i in range(0, len(texts), 64)])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    row = {t: i for i, t in enumerate(texts)}
    verifier = verifier_for(Semantic(method="embedding"))
    kinds = []
    for p in pairs:
        cosine = float(vectors[row[p.first]] @ vectors[row[p.second]])
        if cosine < DEFAULT_THRESHOLD:
            kinds.append("miss")
            continue
        verdict, score = verifier.assess(p.first, p.second, cosine)
        grey = verdict.reason == SCORE and score >= floor
        kinds.append("hit" if verdict.ok else "grey" if grey else "miss")
    return kinds, verifier.min_score


async def ask_all(
    pairs: Sequence[Pair], url: str, model: str | None, headers: Sequence[tuple[str, str]]
) -> list[bool | None]:
    """The judge's verdict on each pair (None: no verdict, an error or a timeout)."""
    backend = Backend(name="judge", url=url.rstrip("/"), headers=tuple(headers))
    transport = Upstreams(Metrics())
    settings = Judge(enabled=True, model=model)
    judge = BackendJudge(settings, transport, backend, clock=SYSTEM_CLOCK, route="cache-eval")
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(pair: Pair) -> bool | None:
        async with gate:
            try:
                return await asyncio.wait_for(
                    judge.ask(pair.first, pair.second), settings.timeout_ms / 1000
                )
            except (GatewayError, OSError, ValueError, TimeoutError):
                return None

    try:
        return list(await asyncio.gather(*(one(p) for p in pairs)))
    finally:
        await transport.aclose()


def evaluate_judge(
    path: str,
    embed: BatchEmbed,
    *,
    url: str | None = None,
    model: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    limit: int | None = None,
    floor: float | None = None,
) -> JudgeReport:
    """The report for the pairs in ``path``."""
    pairs = read_pairs(path)
    floor = Judge().min_score if floor is None else floor
    kinds, min_score = classify(pairs, embed, floor)
    positives = sum(p.label for p in pairs)
    negatives = len(pairs) - positives

    def point(hits: Sequence[bool]) -> Point:
        true = sum(1 for h, p in zip(hits, pairs, strict=True) if h and p.label)
        return Point(min_score, true, sum(hits) - true, positives, negatives)

    grey = [i for i, k in enumerate(kinds) if k == "grey"]
    report = JudgeReport(
        str(path),
        point([k == "hit" for k in kinds]),
        sum(pairs[i].label for i in grey),
        sum(1 - pairs[i].label for i in grey),
        floor,
    )
    if url is None:
        return report
    asked = grey[:limit] if limit is not None else grey
    verdicts = asyncio.run(ask_all([pairs[i] for i in asked], url, model, headers))
    yes = {i for i, v in zip(asked, verdicts, strict=True) if v}
    judged = point([k == "hit" or i in yes for i, k in enumerate(kinds)])
    errors = sum(1 for v in verdicts if v is None)
    return JudgeReport(
        report.source,
        report.tier,
        report.grey_same,
        report.grey_different,
        floor,
        judged,
        len(asked),
        errors,
    )


def format_judge(report: JudgeReport) -> str:
    tier = report.tier
    lines = [
        f"{report.source}: {tier.positives + tier.negatives} pairs "
        f"({tier.positives} same, {tier.negatives} different)",
        f"embedding tier at its defaults (cosine >= {DEFAULT_THRESHOLD:.2f}, min_score "
        f"{tier.min_score:.3f}): {_point(tier)}",
        f"grey zone (refused by score >= {report.floor:g}, no hard difference): "
        f"{report.grey_same + report.grey_different} pairs, {report.grey_same} same, "
        f"{report.grey_different} different",
    ]
    if report.judged is not None:
        lines.append(f"judged: {report.asked} pairs asked, {report.errors} without a verdict")
        lines.append(f"tier + judge's yeses: {_point(report.judged)}")
    else:
        lines.append("(give --judge-url URL to ask a served model about the grey zone)")
    return "\n".join(lines)


def _point(p: Point) -> str:
    precision = "-" if p.precision is None else f"{p.precision:.3f}"
    return (
        f"precision {precision}, recall {p.recall:.3f}, false hits {p.false_hits} of "
        f"{p.negatives} ({p.false_hit_rate:.2%}, 95% upper bound {p.upper:.2%})"
    )
