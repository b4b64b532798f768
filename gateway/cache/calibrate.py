"""Operating points of a scored verifier: counts per threshold, the false-hit bound, choice.

A verifier gives each candidate pair a score and accepts it at ``score >= min_score``.  Over
labelled pairs, each candidate ``min_score`` is an operating point: how many duplicates it
accepts (true hits) and how many different questions (false hits).  The *false-hit rate* is
false hits over the pairs labelled different (a rate over negatives, so it does not depend
on how many duplicates a set happens to hold); its upper bound is the one-sided Wilson score
bound at 95% confidence, so a rate measured on few pairs is trusted less than the same rate
on many.  ``choose`` turns an error budget into the most permissive operating point whose
bound stays within it.  The bound is Clopper-Pearson's (exact: it inverts the binomial
distribution, so it covers the true rate at least 95% of the time, also for a handful of
false hits, where Wilson's can fall short); ``wilson_upper`` is the cheaper approximation,
shown beside it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

Z_95 = 1.6448536269514722
"""The one-sided 95% normal quantile."""


def wilson_upper(k: int, n: int, z: float = Z_95) -> float:
    """Upper Wilson score bound of a rate seen ``k`` times in ``n`` trials (1.0 when n=0)."""
    if n <= 0:
        return 1.0
    centre, spread = _wilson(k, n, z)
    return min(1.0, centre + spread)


def wilson_lower(k: int, n: int, z: float = Z_95) -> float:
    """Lower Wilson score bound of a rate seen ``k`` times in ``n`` trials (0.0 when n=0):
    a measured rate whose lower bound is above a budget contradicts it."""
    if n <= 0:
        return 0.0
    centre, spread = _wilson(k, n, z)
    return max(0.0, centre - spread)


def _wilson(k: int, n: int, z: float) -> tuple[float, float]:
    p, z2 = k / n, z * z
    scale = 1 + z2 / n
    centre = (p + z2 / (2 * n)) / scale
    spread = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / scale
    return centre, spread


@lru_cache(maxsize=4096)
def clopper_pearson_upper(k: int, n: int, alpha: float = 0.05) -> float:
    """The exact one-sided ``1 - alpha`` upper bound of a rate seen ``k`` times in ``n``:
    the rate ``p`` at which seeing ``k`` or fewer has probability ``alpha``."""
    if n <= 0 or k >= n:
        return 1.0
    low, high = k / n, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if _binomial_cdf(k, n, mid) > alpha:
            low = mid
        else:
            high = mid
    return high


def _binomial_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    log_p, log_q = math.log(p), math.log1p(-p)
    log_choose = 0.0  # log C(n, 0)
    total = 0.0
    for i in range(k + 1):
        if i:
            log_choose += math.log(n - i + 1) - math.log(i)
        total += math.exp(log_choose + i * log_p + (n - i) * log_q)
    return min(1.0, total)


@dataclass(frozen=True, slots=True)
class Point:
    """One operating point: accept at ``score >= min_score``."""

    min_score: float
    true_hits: int
    false_hits: int
    positives: int
    negatives: int

    @property
    def recall(self) -> float:
        return self.true_hits / self.positives if self.positives else 0.0

    @property
    def precision(self) -> float | None:
        hits = self.true_hits + self.false_hits
        return self.true_hits / hits if hits else None

    @property
    def false_hit_rate(self) -> float:
        return self.false_hits / self.negatives if self.negatives else 0.0

    @property
    def upper(self) -> float:
        """The false-hit rate's exact 95% upper bound (Clopper-Pearson)."""
        return clopper_pearson_upper(self.false_hits, self.negatives)

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "min_score": round(self.min_score, 6),
            "recall": round(self.recall, 4),
            "precision": None if self.precision is None else round(self.precision, 4),
            "false_hit_rate": round(self.false_hit_rate, 5),
            "false_hit_rate_upper": round(self.upper, 5),
            "false_hit_rate_wilson_upper": round(wilson_upper(self.false_hits, self.negatives), 5),
            "true_hits": self.true_hits,
            "false_hits": self.false_hits,
            "positives": self.positives,
            "negatives": self.negatives,
        }


def curve(scores: Sequence[float], labels: Sequence[bool], steps: int = 200) -> tuple[Point, ...]:
    """Operating points at ``steps`` score thresholds between 0 and 1 (and above every
    score), most permissive first.  A pair the verifier refuses outright scores below 0."""
    positives = sum(1 for y in labels if y)
    negatives = len(labels) - positives
    ranked = sorted(zip(scores, labels, strict=True), key=lambda p: -p[0])
    thresholds = [i / steps for i in range(steps + 1)] + [math.inf]
    points: list[Point] = []
    tp = fp = 0
    counted = 0  # thresholds from high to low, so each pair is counted once
    for t in reversed(thresholds):
        while counted < len(ranked) and ranked[counted][0] >= t:
            if ranked[counted][1]:
                tp += 1
            else:
                fp += 1
            counted += 1
        points.append(Point(t, tp, fp, positives, negatives))
    return tuple(reversed(points))


def choose(points: Sequence[Point], budget: float) -> Point:
    """The most permissive point whose false-hit upper bound is within ``budget``; the
    strictest point when none is.  False hits only grow as ``min_score`` falls, and so
    does the bound, so the points are walked from the strictest (where the bound is cheap)
    until the next one would exceed the budget."""
    ordered = sorted(points, key=lambda p: -p.min_score)
    chosen = ordered[0]
    for point in ordered:
        if point.upper > budget:
            break
        chosen = point
    return chosen


def precision_at_recall(points: Sequence[Point], recall: float) -> float | None:
    """The best precision among points with at least ``recall``."""
    found = [p.precision for p in points if p.recall >= recall and p.precision is not None]
    return max(found) if found else None
