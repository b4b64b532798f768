"""Train the learned verifier (``gateway/cache/embedding/learned.py``) and calibrate it.

    python -m bench.train_verifier        # after bench.train_cross_encoder; about 3 min

Fits a logistic regression (L2, Newton's method) over ``learned.FEATURES`` (the cosine of
the local model's vectors, the cheap features of the pair, and the cross-encoder's logit)
on the pairs of ``qqp_train.tsv``'s held-out tenth (``HOLDOUT_FOLD`` of ``FOLDS``
question-disjoint folds: the cross-encoder never read them, so the weights see its scores
as a lookup will) that no hard difference refuses and whose cosine reaches the tier's
threshold (the only pairs the tier scores).  Then calibrates on ``qqp_dev.tsv``, which no
model was trained on: the operating points of the tier's scores there (-1 below the cosine
threshold or for a hard difference), from which a route's ``max_false_hit_rate`` picks
its ``min_score``.  Writes ``gateway/data/verifier.json``.  The data files are never
shipped.
"""

from __future__ import annotations

import argparse
import hashlib
import math
from pathlib import Path

import numpy as np

from bench.closure import Groups
from gateway.cache.calibrate import curve, precision_at_recall
from gateway.cache.embedding.learned import (
    FEATURES,
    Model,
    features,
    hard_difference,
    verdicts,
)
from gateway.cache.embedding.tier import DEFAULT_THRESHOLD
from gateway.cache.evaluate import Pair, read_pairs
from gateway.cache.normalize import normalize

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data"
DEFAULT_PAIRS = DATA / "qqp_dev.tsv"
OUT = ROOT / "gateway" / "data" / "verifier.json"
L2 = 3.0
FOLDS = 10
HOLDOUT_FOLD = 0
CROSS_MARGIN = 1.0
"""Added to the highest cross-encoder logit seen, for ``Model.cross_max``."""
CALIBRATION_STEPS = 1000
"""Operating points every 0.001 of the score: a coarser grid leaves recall under the budget."""
"""``qqp_train.tsv``'s question-disjoint fold the cross-encoder is not trained on."""


def folds_by_question(pairs: list[Pair], folds: int) -> np.ndarray:
    """A fold per pair, the pairs that share a question (transitively) in the same one."""
    joined = Groups()
    for p in pairs:
        joined.join(p.first, p.second)
    return np.array(
        [int(hashlib.sha256(joined.find(p.first).encode()).hexdigest(), 16) % folds for p in pairs]
    )


def fit(x: np.ndarray, y: np.ndarray, l2: float = L2) -> tuple[np.ndarray, ...]:
    """Standardised logistic regression: (mean, scale, weights, bias)."""
    mean, scale = x.mean(0), x.std(0) + 1e-9
    z = np.hstack([(x - mean) / scale, np.ones((len(x), 1))])
    beta = np.zeros(z.shape[1])
    ridge = l2 * np.diag(np.r_[np.ones(z.shape[1] - 1), 0.0])
    for _ in range(50):
        p = 1 / (1 + np.exp(-z @ beta))
        gradient = z.T @ (p - y) + ridge @ beta
        hessian = (z * (p * (1 - p))[:, None]).T @ z + ridge
        step = np.linalg.solve(hessian, gradient)
        beta -= step
        if np.abs(step).max() < 1e-8:
            break
    return mean, scale, beta[:-1], np.array(beta[-1])


def model_of(
    params: tuple[np.ndarray, ...], calibration=(), source: str = "", cross_max: float = math.inf
) -> Model:
    mean, scale, weights, bias = params
    return Model(
        FEATURES,
        tuple(float(v) for v in mean),
        tuple(float(v) for v in scale),
        tuple(float(v) for v in weights),
        float(bias),
        tuple(calibration),
        source,
        cross_max,
    )


def table(pairs: list[Pair]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Features (CE logit included), cosine and hard-difference flags of each pair, as the
    tier computes them; rows of refused or dissimilar pairs are left at zero."""
    from gateway.cache.embedding.cross import shared
    from gateway.cache.embedding.local import LocalModel

    texts = sorted({t for p in pairs for t in (p.first, p.second)})
    encoder = LocalModel()
    vectors = np.vstack([encoder.encode(texts[i : i + 256]) for i in range(0, len(texts), 256)])
    row = {t: i for i, t in enumerate(texts)}
    cosine = np.array([float(vectors[row[p.first]] @ vectors[row[p.second]]) for p in pairs])
    found = []
    for i, p in enumerate(pairs):
        if cosine[i] >= DEFAULT_THRESHOLD:
            a, b = normalize(p.first), normalize(p.second)
            verdict = verdicts(a, b)
            if not hard_difference(a, b, verdict):
                found.append((i, a, b, verdict))
    logits = shared().logits([(pairs[i].first, pairs[i].second) for i, *_ in found])
    xs = np.zeros((len(pairs), len(FEATURES)))
    scored = np.zeros(len(pairs), bool)
    for (i, a, b, verdict), logit in zip(found, logits, strict=True):
        xs[i] = features(a, b, float(cosine[i]), float(logit), verdict)
        scored[i] = True
    return xs, cosine, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    train = read_pairs(DATA / "qqp_train.tsv")
    held = [
        p for p, f in zip(train, folds_by_question(train, FOLDS), strict=True) if f == HOLDOUT_FOLD
    ]
    xs, _, scored = table(held)
    y = np.array([p.label for p in held], float)
    params = fit(xs[scored], y[scored])
    dev = read_pairs(DEFAULT_PAIRS)
    dev_xs, _, dev_scored = table(dev)
    model = model_of(params)
    scores = [model.raw_score(list(dev_xs[i])) if dev_scored[i] else -1.0 for i in range(len(dev))]
    points = curve(scores, [p.label == 1 for p in dev], steps=CALIBRATION_STEPS)
    source = (
        f"{DEFAULT_PAIRS.name}: {len(dev)} pairs, never trained on (weights: "
        f"{int(scored.sum())} pairs of qqp_train.tsv's held-out tenth)"
    )
    if params[2][-1] <= 0:  # the lookup's bound on a score assumes it rises with the logit
        raise SystemExit("the cross-encoder's logit got a weight <= 0")
    highest = max(xs[scored, -1].max(), dev_xs[dev_scored, -1].max())
    final = model_of(params, points, source, cross_max=float(highest) + CROSS_MARGIN)
    args.out.write_text(final.to_json() + "\n")
    for r in (0.2, 0.3, 0.45):
        print(f"precision at recall {r}: {precision_at_recall(points, r)}")
    for budget in (0.005, 0.01, 0.02, 0.05):
        print(f"budget {budget}: {final.operating_point(budget).as_dict()}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
