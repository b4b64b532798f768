"""Train the pair classifier over the frozen local model's vectors (issue 26, compared, not
shipped: docs/caching.md says why).

    pip install torch==2.13.0          # training only, CPU
    nice -n 10 python -m bench.train_pair_classifier      # about 5 min on 2 cores

Each text of ``qqp_train.tsv`` and ``qqp_dev.tsv`` is embedded once by the tier's own int8
all-MiniLM-L6-v2 (``local.LocalModel``; the vectors are cached in ``bench/out/``), and a
small network reads a pair as ``[|u - v|, u * v]`` (768 inputs), one hidden layer of 128
ReLUs, one logit; binary cross-entropy on both labels of the pairs the cross-encoder is
trained on (every fold but ``HOLDOUT_FOLD``), Adam at 1e-3, 8 epochs of batches of 256,
seed 26.  At lookup it would cost one 768x128 product: microseconds.  Writes the weights
to ``bench/out/pair_classifier.npz`` and prints precision at recall 0.30 and 0.45 on
``qqp_dev.tsv``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.train_verifier import DATA, FOLDS, HOLDOUT_FOLD, folds_by_question
from gateway.cache.calibrate import curve, precision_at_recall
from gateway.cache.evaluate import Pair, read_pairs

OUT = Path(__file__).resolve().parent / "out"
SEED = 26
HIDDEN = 128
EPOCHS = 8
BATCH = 256


def vectors(texts: list[str]) -> dict[str, np.ndarray]:
    """The local model's vector of each text, cached in ``bench/out/``."""
    from gateway.cache.embedding.local import LocalModel

    cache = OUT / "int8_vectors.npz"
    known: dict[str, np.ndarray] = {}
    if cache.exists():
        with np.load(cache) as stored:
            known = dict(zip(stored["texts"].tolist(), stored["vectors"], strict=True))
    missing = sorted(set(texts) - known.keys())
    if missing:
        model = LocalModel(threads=1)
        rows = np.vstack([model.encode(missing[i : i + 256]) for i in range(0, len(missing), 256)])
        known.update(zip(missing, rows, strict=True))
        OUT.mkdir(exist_ok=True)
        names = sorted(known)
        np.savez(cache, texts=np.array(names), vectors=np.stack([known[t] for t in names]))
    return known


def inputs(pairs: list[Pair], table: dict[str, np.ndarray]) -> np.ndarray:
    u = np.stack([table[p.first] for p in pairs]).astype(np.float16).astype(np.float32)
    v = np.stack([table[p.second] for p in pairs]).astype(np.float16).astype(np.float32)
    return np.hstack([np.abs(u - v), u * v])  # fp16 rounded: as the index stores them


def logits(weights: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The classifier in numpy, as a lookup would run it."""
    hidden = np.maximum(0.0, x @ weights["w1"] + weights["b1"])
    return (hidden @ weights["w2"] + weights["b2"]).reshape(-1)


def main() -> None:
    import torch

    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    started = time.perf_counter()
    train = read_pairs(DATA / "qqp_train.tsv")
    fold = folds_by_question(train, FOLDS)
    used = [p for p, f in zip(train, fold, strict=True) if f != HOLDOUT_FOLD]
    dev = read_pairs(DATA / "qqp_dev.tsv")
    table = vectors([t for p in train + dev for t in (p.first, p.second)])
    embedded = time.perf_counter() - started
    x = torch.tensor(inputs(used, table))
    y = torch.tensor([float(p.label) for p in used])
    first, second = torch.nn.Linear(x.shape[1], HIDDEN), torch.nn.Linear(HIDDEN, 1)
    net = torch.nn.Sequential(first, torch.nn.ReLU(), second)
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(SEED)
    for epoch in range(EPOCHS):
        order = torch.randperm(len(used), generator=generator)
        total = 0.0
        for start in range(0, len(used), BATCH):
            rows = order[start : start + BATCH]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                net(x[rows]).squeeze(-1), y[rows]
            )
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            total += loss.item() * len(rows)
        print(f"epoch {epoch + 1}: loss {total / len(used):.4f}", flush=True)
    weights: dict[str, Any] = {
        "w1": first.weight.detach().numpy().T.copy(),
        "b1": first.bias.detach().numpy().copy(),
        "w2": second.weight.detach().numpy().T.copy(),
        "b2": second.bias.detach().numpy().copy(),
    }
    np.savez(OUT / "pair_classifier.npz", **weights)
    scores = 1 / (1 + np.exp(-logits(weights, inputs(dev, table))))
    points = curve(list(scores), [p.label == 1 for p in dev])
    trained = time.perf_counter() - started - embedded
    print(f"embedded in {embedded:.0f} s, trained in {trained:.0f} s")
    for r in (0.3, 0.45):
        print(f"qqp_dev precision at recall {r}: {precision_at_recall(points, r)}")


if __name__ == "__main__":
    main()
