"""Train the learned verifier (``gateway/cache/embedding/learned.py``) and its calibration.

    python -m bench.train_verifier [--pairs ../shared/data/qqp_dev.tsv] [--folds 5]

Reads labelled development pairs (never shipped), embeds every text once with the local
model, and fits a logistic regression (L2, Newton's method) over ``learned.FEATURES`` of
the pairs no hard difference refuses.  The calibration is cross-fitted: the pairs are split
into ``--folds`` folds by connected question (a question and every pair it is in stay in
one fold, as in a held-out sample that shares no question), each fold is scored by a model
trained on the others, and the operating points over those scores are what ships.  The
shipped weights are then fitted on every pair.  Writes ``gateway/data/verifier.json``.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

import numpy as np

from gateway.cache.calibrate import curve, precision_at_recall
from gateway.cache.embedding.learned import (
    FEATURES,
    Model,
    features,
    hard_difference,
    verdicts,
)
from gateway.cache.evaluate import Pair, read_pairs
from gateway.cache.normalize import normalize

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PAIRS = ROOT.parent / "shared" / "data" / "qqp_dev.tsv"
OUT = ROOT / "gateway" / "data" / "verifier.json"
L2 = 3.0


def folds_by_question(pairs: list[Pair], folds: int) -> np.ndarray:
    """A fold per pair, the pairs that share a question (transitively) in the same one."""
    parent: dict[str, str] = {}

    def find(x: str) -> str:
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for p in pairs:
        parent[find(p.first)] = find(p.second)
    return np.array(
        [int(hashlib.sha256(find(p.first).encode()).hexdigest(), 16) % folds for p in pairs]
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


def model_of(params: tuple[np.ndarray, ...], calibration=(), source: str = "") -> Model:
    mean, scale, weights, bias = params
    return Model(
        FEATURES,
        tuple(float(v) for v in mean),
        tuple(float(v) for v in scale),
        tuple(float(v) for v in weights),
        float(bias),
        tuple(calibration),
        source,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=Path, default=DEFAULT_PAIRS)
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    from gateway.cache.embedding.local import LocalModel

    pairs = read_pairs(args.pairs)
    texts = sorted({t for p in pairs for t in (p.first, p.second)})
    encoder = LocalModel()
    vectors = np.vstack([encoder.encode(texts[i : i + 64]) for i in range(0, len(texts), 64)])
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    row = {t: i for i, t in enumerate(texts)}
    x, hard = [], []
    for p in pairs:
        a, b = normalize(p.first), normalize(p.second)
        cosine = float(vectors[row[p.first]] @ vectors[row[p.second]])
        found = verdicts(a, b)
        x.append(features(a, b, cosine, found))
        hard.append(bool(hard_difference(a, b, found)))
    xs, y, refused = np.array(x), np.array([p.label for p in pairs], float), np.array(hard)
    fold = folds_by_question(pairs, args.folds)
    scores = np.full(len(pairs), -1.0)
    for k in range(args.folds):
        train = (fold != k) & ~refused
        held = model_of(fit(xs[train], y[train]))
        for i in np.flatnonzero((fold == k) & ~refused):
            scores[i] = held.raw_score(list(xs[i]))
    points = curve(list(scores), [bool(v) for v in y])
    source = f"{args.pairs.name}: {len(pairs)} pairs, {args.folds}-fold cross-fitted"
    final = model_of(fit(xs[~refused], y[~refused]), points, source)
    args.out.write_text(final.to_json() + "\n")
    for r in (0.2, 0.3, 0.45):
        print(f"precision at recall {r}: {precision_at_recall(points, r)}")
    for budget in (0.005, 0.01, 0.02, 0.05):
        print(f"budget {budget}: {final.operating_point(budget).as_dict()}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
