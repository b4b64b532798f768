"""The learned verifier's fit compared with nonlinear fits over the same features (issue 26).

    pip install scikit-learn     # for this comparison only; the gateway does not use it
    python -m bench.compare_verifier_fits     # about 2 min on one core

``bench.train_verifier`` fits a logistic regression over ``learned.FEATURES`` on the pairs
of ``qqp_train.tsv``'s held-out tenth that the tier scores (the cross-encoder never read
them).  This fits gradient-boosted trees (with and without a rising constraint on the
cross-encoder's logit, which the lookup's bound on a score assumes) and small neural
networks on the same rows, and scores ``qqp_dev.tsv`` as the tier would (-1 below the
cosine threshold or for a hard difference): precision at recall 0.30 and 0.45, and recall
and false hits at the budgets 0.01 and 0.02 (``calibrate.choose``, the gateway's own).
"""

from __future__ import annotations

import numpy as np

from bench.train_verifier import (
    DATA,
    DEFAULT_PAIRS,
    FOLDS,
    HOLDOUT_FOLD,
    fit,
    folds_by_question,
    table,
)
from gateway.cache.calibrate import choose, curve, precision_at_recall
from gateway.cache.embedding.learned import FEATURES
from gateway.cache.evaluate import read_pairs

TREES = ((0.05, 100, 7, 1.0), (0.03, 300, 7, 3.0), (0.03, 200, 7, 10.0), (0.05, 200, 15, 1.0))
"""Gradient-boosted trees: learning rate, trees, leaves per tree, L2."""
NETWORKS = (((8,), 1.0), ((16,), 0.01), ((32,), 0.1))
"""Neural networks: hidden layers, L2."""


def row(name: str, scores: list[float], labels: list[bool]) -> str:
    points = curve(scores, labels, steps=1000)
    cells = [f"{precision_at_recall(points, r) or 0:.1%}" for r in (0.30, 0.45)]
    for budget in (0.01, 0.02):
        p = choose(points, budget)
        cells.append(f"{p.true_hits / p.positives:.1%} / {p.false_hits}")
    return f"| {name} | " + " | ".join(cells) + " |"


def main() -> None:
    from sklearn.ensemble import HistGradientBoostingClassifier
    from sklearn.neural_network import MLPClassifier
    from sklearn.preprocessing import StandardScaler

    train = read_pairs(DATA / "qqp_train.tsv")
    held = [
        p for p, f in zip(train, folds_by_question(train, FOLDS), strict=True) if f == HOLDOUT_FOLD
    ]
    xs, _, scored = table(held)
    x, y = xs[scored], np.array([p.label for p in held], float)[scored]
    dev = read_pairs(DEFAULT_PAIRS)
    dev_xs, _, dev_scored = table(dev)
    labels = [p.label == 1 for p in dev]

    def scores(raw: np.ndarray) -> list[float]:
        return [float(v) if ok else -1.0 for v, ok in zip(raw, dev_scored, strict=True)]

    print(f"{int(scored.sum())} training pairs; {len(dev)} pairs of {DEFAULT_PAIRS.name}\n")
    print("| fit | P@R30 | P@R45 | budget 0.01: recall / false hits | budget 0.02 |")
    print("|---|---|---|---|---|")
    mean, scale, weights, bias = fit(x, y)
    logistic = 1 / (1 + np.exp(-((dev_xs - mean) / scale @ weights + bias)))
    print(row("logistic (shipped)", scores(logistic), labels))
    rising = [0] * (len(FEATURES) - 1) + [1]
    for rate, trees, leaves, l2 in TREES:
        for constraint in (None, rising):
            model = HistGradientBoostingClassifier(
                learning_rate=rate,
                max_iter=trees,
                max_leaf_nodes=leaves,
                l2_regularization=l2,
                monotonic_cst=constraint,
                early_stopping=False,
                random_state=0,
            ).fit(x, y)
            name = f"trees: rate {rate}, {trees} x {leaves} leaves, L2 {l2}"
            name += ", rising in the logit" if constraint else ""
            print(row(name, scores(model.predict_proba(dev_xs)[:, 1]), labels))
    standard = StandardScaler().fit(x)
    for hidden, l2 in NETWORKS:
        net = MLPClassifier(hidden_layer_sizes=hidden, alpha=l2, max_iter=2000, random_state=0)
        net.fit(standard.transform(x), y)
        raw = net.predict_proba(standard.transform(dev_xs))[:, 1]
        print(row(f"network {hidden}, L2 {l2}", scores(raw), labels))


if __name__ == "__main__":
    main()
