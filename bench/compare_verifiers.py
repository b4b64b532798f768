"""Issue 26's comparison: each way of verifying an embedding candidate, on the same footing.

    python -m bench.compare_verifiers      # after the training scripts; about 5 min

Every method scores the pairs of ``qqp_dev.tsv`` as the tier would (byte-equal text is the
exact tier's hit; below the tier's cosine threshold, 0.80, or for a hard difference a pair
is refused), except "cosine alone", which is the cosine over every pair.  Its operating
point for the default budget (``max_false_hit_rate: 0.01``) is chosen on ``qqp_dev.tsv``
(the Clopper-Pearson bound, as the gateway chooses), and the adversarial minimal edits
(``gateway/data/adversarial_pairs.tsv``), the Quora-style ``question_pairs.tsv`` and PAWS
dev are scored at that point.  Methods:

* cosine alone: the local model's cosine;
* cheap features, trained on qqp_dev (the verifier before issue 26, from git);
* cheap features, trained on qqp_train: the same logistic model over the 21 cheap
  features, fitted on every pair of ``qqp_train.tsv`` (no cross-encoder);
* pair classifier: ``bench/train_pair_classifier.py``'s network over the frozen vectors
  (``bench/out/pair_classifier.npz``), with the hard differences;
* cross-encoder alone: the shipped cross-encoder's probability, with the hard differences;
* the shipped verifier: the cheap features and the cross-encoder's logit
  (``gateway/data/verifier.json``);
* the shipped verifier with the pair classifier's logit as one more feature (fitted like
  the shipped one, on ``qqp_train.tsv``'s held-out tenth).

Writes its table, with this command, to docs/benchmarks.md.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.common import machine, update_section
from bench.train_pair_classifier import inputs, logits, vectors
from bench.train_verifier import DATA, FOLDS, HOLDOUT_FOLD, fit, folds_by_question, model_of
from gateway.cache.calibrate import Point, choose, curve, precision_at_recall
from gateway.cache.embedding import cross, learned
from gateway.cache.embedding.tier import DEFAULT_THRESHOLD
from gateway.cache.evaluate import Pair, read_adjudicated, read_pairs
from gateway.cache.normalize import normalize

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SETS = {
    "qqp_dev": DATA / "qqp_dev.tsv",
    "adversarial": ROOT / "gateway" / "data" / "adversarial_pairs.tsv",
    "question_pairs": ROOT / "gateway" / "data" / "question_pairs.tsv",
    "paws_dev": DATA / "paws_wiki_dev.tsv",
}
ADJUDICATED = ROOT / "docs" / "adjudicated_qqp_dev.tsv"
CHEAP = len(learned.FEATURES) - 1  # the features before the cross-encoder's logit
BUDGET = 0.01


@dataclass(frozen=True, slots=True)
class Scored:
    """What every method needs of one pair set: per pair its cosine, whether the tier
    would score it (exact, floor, hard differences), features, CE and MLP logits."""

    pairs: list[Pair]
    cosine: np.ndarray
    exact: np.ndarray
    scored: np.ndarray
    xs: np.ndarray
    mlp: np.ndarray

    @property
    def labels(self) -> list[bool]:
        return [p.label == 1 for p in self.pairs]

    def scores(self, fn: Callable[[int], float]) -> list[float]:
        return [
            2.0 if self.exact[i] else fn(i) if self.scored[i] else -1.0
            for i in range(len(self.pairs))
        ]


def prepare(pairs: list[Pair], table: dict[str, np.ndarray], mlp: dict[str, np.ndarray]) -> Scored:
    cosine = np.array([float(table[p.first] @ table[p.second]) for p in pairs])
    exact = np.array([p.first == p.second for p in pairs])
    scored = np.zeros(len(pairs), bool)
    found = []
    for i, p in enumerate(pairs):
        if not exact[i] and cosine[i] >= DEFAULT_THRESHOLD:
            a, b = normalize(p.first), normalize(p.second)
            verdict = learned.verdicts(a, b)
            if not learned.hard_difference(a, b, verdict):
                found.append((i, a, b, verdict))
                scored[i] = True
    ce = cross.shared().logits([(pairs[i].first, pairs[i].second) for i, *_ in found])
    xs = np.zeros((len(pairs), len(learned.FEATURES)))
    for (i, a, b, verdict), logit in zip(found, ce, strict=True):
        xs[i] = learned.features(a, b, float(cosine[i]), float(logit), verdict)
    return Scored(pairs, cosine, exact, scored, xs, logits(mlp, inputs(pairs, table)))


def cheap_on_train(train: list[Pair], table: dict[str, np.ndarray]) -> learned.Model:
    """The 21 cheap features' logistic model, fitted on every pair of qqp_train.tsv the
    tier would score."""
    rows, labels = [], []
    for p in train:
        c = float(table[p.first] @ table[p.second])
        if p.first == p.second or c < DEFAULT_THRESHOLD:
            continue
        a, b = normalize(p.first), normalize(p.second)
        verdict = learned.verdicts(a, b)
        if not learned.hard_difference(a, b, verdict):
            rows.append(learned.features(a, b, c, 0.0, verdict)[:CHEAP])
            labels.append(p.label)
    params = fit(np.array(rows), np.array(labels, float))
    mean, scale, weights, bias = _floats(params)
    return learned.Model(learned.FEATURES[:CHEAP], mean, scale, weights, bias, ())


def _floats(
    params: tuple[np.ndarray, ...],
) -> tuple[tuple[float, ...], tuple[float, ...], tuple[float, ...], float]:
    mean, scale, weights, bias = params
    return (
        tuple(map(float, mean)),
        tuple(map(float, scale)),
        tuple(map(float, weights)),
        float(bias),
    )


def previous_verifier() -> learned.Model:
    """The verifier before issue 26 (trained on qqp_dev), from git."""
    text = subprocess.run(
        ["git", "show", "d6442d5:gateway/data/verifier.json"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    data = json.loads(text)
    return learned.Model(
        tuple(data["features"]),
        tuple(data["mean"]),
        tuple(data["scale"]),
        tuple(data["weights"]),
        float(data["bias"]),
        (),
    )


def row(name: str, sets: dict[str, Scored], method: Callable[[Scored], list[float]]) -> str:
    dev = sets["qqp_dev"]
    points = curve(method(dev), dev.labels)
    point = choose(points, BUDGET)
    cells = [
        name,
        _pct(precision_at_recall(points, 0.30)),
        _pct(precision_at_recall(points, 0.45)),
        f"{_pct(point.recall)} / {_pct(point.precision)} / {point.false_hits} of {point.negatives}",
    ]
    for key in ("adversarial", "question_pairs", "paws_dev"):
        data = sets[key]
        at = _at(method(data), data.labels, point.min_score)
        cells.append(f"{at.false_hits} of {at.negatives} (recall {_pct(at.recall)})")
    return "| " + " | ".join(cells) + " |"


def _at(scores: list[float], labels: list[bool], min_score: float) -> Point:
    tp = sum(1 for s, y in zip(scores, labels, strict=True) if s >= min_score and y)
    fp = sum(1 for s, y in zip(scores, labels, strict=True) if s >= min_score and not y)
    return Point(min_score, tp, fp, sum(labels), len(labels) - sum(labels))


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def main() -> None:
    started = time.perf_counter()
    loaded = {name: read_pairs(path) for name, path in SETS.items()}
    train = read_pairs(DATA / "qqp_train.tsv")
    every = [t for pairs in [*loaded.values(), train] for p in pairs for t in (p.first, p.second)]
    table = {t: v / np.linalg.norm(v) for t, v in vectors(every).items()}
    with np.load(OUT / "pair_classifier.npz") as stored:
        mlp = dict(stored)
    sets = {name: prepare(pairs, table, mlp) for name, pairs in loaded.items()}
    held = [p for p, f in zip(train, folds_by_question(train, FOLDS), strict=True) if f == 0]
    assert HOLDOUT_FOLD == 0
    held_set = prepare(held, table, mlp)
    y = np.array([p.label for p in held], float)
    with_mlp = model_of(
        fit(np.hstack([held_set.xs, held_set.mlp[:, None]])[held_set.scored], y[held_set.scored])
    )
    cheap = cheap_on_train(train, table)
    previous = previous_verifier()
    shipped = learned.shipped()
    methods: list[tuple[str, Callable[[Scored], list[float]]]] = [
        (
            "cosine alone",
            lambda s: [2.0 if e else c for e, c in zip(s.exact, s.cosine, strict=True)],
        ),
        (
            "cheap features, trained on qqp_dev (before)",
            lambda s: s.scores(lambda i: previous.raw_score(list(s.xs[i, :CHEAP]))),
        ),
        (
            "cheap features, trained on qqp_train",
            lambda s: s.scores(lambda i: cheap.raw_score(list(s.xs[i, :CHEAP]))),
        ),
        ("pair classifier (frozen vectors)", lambda s: s.scores(lambda i: _sigmoid(s.mlp[i]))),
        ("cross-encoder alone", lambda s: s.scores(lambda i: _sigmoid(s.xs[i, CHEAP]))),
        (
            "**shipped: cheap features + cross-encoder**",
            lambda s: s.scores(lambda i: shipped.raw_score(list(s.xs[i]))),
        ),
        (
            "cheap features + cross-encoder + pair classifier",
            lambda s: s.scores(lambda i: with_mlp.raw_score([*s.xs[i], s.mlp[i]])),
        ),
    ]
    lines = [
        "| method | P@R30 | P@R45 | qqp_dev at the 0.01 budget: recall / precision / false "
        "hits | adversarial false hits | question_pairs false hits | PAWS dev false hits |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, method in methods:
        lines.append(row(name, sets, method))
        print(lines[-1], flush=True)
    dev = sets["qqp_dev"]
    scores = methods[5][1](dev)
    point = choose(curve(scores, dev.labels), BUDGET)
    false_hits = [
        f"0\t{p.first}\t{p.second}\t{s:.4f}"
        for p, s in zip(dev.pairs, scores, strict=True)
        if s >= point.min_score and not p.label
    ]
    (OUT / "false_hits_qqp_dev.tsv").write_text("\n".join(false_hits) + "\n")
    judged = read_adjudicated(ADJUDICATED) if ADJUDICATED.exists() else frozenset()
    relabelled = sum(
        1
        for p, s in zip(dev.pairs, scores, strict=True)
        if s >= point.min_score and not p.label and (p.first, p.second) in judged
    )
    hits = point.true_hits + point.false_hits
    adjudicated = (
        f"The shipped verifier at the default budget on `qqp_dev.tsv`: precision "
        f"{_pct(point.precision)} on the labels as given; {relabelled} of its "
        f"{point.false_hits} false hits are judged the same question in "
        f"`docs/adjudicated_qqp_dev.tsv`, so {_pct((point.true_hits + relabelled) / hits)} "
        "adjudicated."
    )
    print(adjudicated)
    took = time.perf_counter() - started
    update_section(
        "verifiers",
        "## Embedding-tier verifiers compared (issue 26)\n\n"
        f"`python -m bench.compare_verifiers` on {machine()} ({took:.0f} s). Each method's "
        "operating point for `max_false_hit_rate: 0.01` is chosen on `qqp_dev.tsv`; the other "
        "sets are scored at that point (false hits over the pairs labelled different).\n\n"
        + "\n".join(lines)
        + "\n\n"
        + adjudicated,
    )


def _sigmoid(x: float) -> float:
    return float(1 / (1 + np.exp(-x)))


if __name__ == "__main__":
    main()
