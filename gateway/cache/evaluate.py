"""``gateway cache-eval``: precision, recall and false-hit rate of each tier and setting.

Input is labelled pairs, ``label<TAB>first<TAB>second`` (1 = the answer to one is an
acceptable answer to the other), an optional header line first.  Each setting is applied as
if ``first`` were cached and ``second`` were asked in the same context: the exact tier hits
on byte-equal text; the SimHash tier at Hamming distance <= d; the guarded rows add the
guard that the product always runs.  A false hit is a hit on a pair labelled 0.

With an embedder (``embed``, e.g. ``local_embed()`` from the ``embedding`` extra) the
embedding tier is scored too, at each threshold: on cosine similarity alone, with the
guard, and with its verification (``embedding.verify``: the guard, or its checks over
reworded question frames), which is what the tier runs; and the tiers a route with
``semantic.method: embedding`` runs, in order (exact, SimHash with guard, then the
embedding tier at its default threshold), as ``EMBEDDING_SETTING``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gateway.cache.embedding.tier import DEFAULT_THRESHOLD
from gateway.cache.embedding.verify import verify
from gateway.cache.guard import check
from gateway.cache.normalize import normalize
from gateway.cache.simhash import MAX_DISTANCE, fingerprint, hamming

DEFAULT_DISTANCES = tuple(range(MAX_DISTANCE + 1))
DEFAULT_SETTING = f"simhash<={MAX_DISTANCE}+guard"
DEFAULT_THRESHOLDS = (0.80, 0.85, 0.90, 0.95)
EMBEDDING_SETTING = f"{DEFAULT_SETTING}+embedding>={DEFAULT_THRESHOLD:.2f}"

BatchEmbed = Callable[[Sequence[str]], np.ndarray]
"""A synchronous embedder for evaluation: texts -> one vector per row, in order."""


@dataclass(frozen=True, slots=True)
class Pair:
    """One labelled pair."""

    label: int
    first: str
    second: str


@dataclass(frozen=True, slots=True)
class Row:
    """The confusion counts and rates of one setting over a pair set."""

    setting: str
    true_hits: int
    false_hits: int
    misses: int
    true_rejects: int

    @property
    def positives(self) -> int:
        return self.true_hits + self.misses

    @property
    def negatives(self) -> int:
        return self.false_hits + self.true_rejects

    @property
    def precision(self) -> float | None:
        hits = self.true_hits + self.false_hits
        return self.true_hits / hits if hits else None

    @property
    def recall(self) -> float | None:
        return self.true_hits / self.positives if self.positives else None

    @property
    def false_hit_rate(self) -> float | None:
        return self.false_hits / self.negatives if self.negatives else None


@dataclass(frozen=True, slots=True)
class Report:
    """Every setting's row over one pair file; ``default`` names the shipped setting."""

    source: str
    pairs: int
    rows: tuple[Row, ...]
    default: str = DEFAULT_SETTING
    embedding_default: str | None = None

    def row(self, setting: str) -> Row:
        return next(r for r in self.rows if r.setting == setting)

    def to_json(self) -> str:
        return json.dumps(
            {
                "source": self.source,
                "pairs": self.pairs,
                "default": self.default,
                "embedding_default": self.embedding_default,
                "rows": [
                    asdict(r)
                    | {
                        "precision": r.precision,
                        "recall": r.recall,
                        "false_hit_rate": r.false_hit_rate,
                    }
                    for r in self.rows
                ],
            },
            indent=2,
        )


def read_pairs(path: str | Path) -> list[Pair]:
    """Parse a pair file; a first line whose label is not 0/1 is taken as a header."""
    pairs: list[Pair] = []
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            parts = line.rstrip("\n").split("\t")
            if not line.strip():
                continue
            if len(parts) != 3 or parts[0].strip() not in ("0", "1"):
                if number == 1:
                    continue
                raise ValueError(f"{path}:{number}: expected label<TAB>first<TAB>second")
            pairs.append(Pair(int(parts[0]), parts[1], parts[2]))
    return pairs


def evaluate(
    pairs: str | Path | Sequence[Pair],
    distances: Iterable[int] = DEFAULT_DISTANCES,
    *,
    embed: BatchEmbed | None = None,
    thresholds: Iterable[float] = DEFAULT_THRESHOLDS,
) -> Report:
    """Score the exact tier and the SimHash tier at each distance, with and without guard;
    with ``embed``, also the embedding tier at each threshold (see the module docstring)."""
    source = str(pairs) if isinstance(pairs, str | Path) else "<pairs>"
    items = read_pairs(pairs) if isinstance(pairs, str | Path) else list(pairs)
    distances = tuple(distances)
    outcomes: dict[str, list[bool]] = {"exact": []}
    for d in distances:
        outcomes[f"simhash<={d}"] = []
        outcomes[f"simhash<={d}+guard"] = []
    outcomes["guard-only"] = []
    for pair in items:
        a, b = normalize(pair.first), normalize(pair.second)
        exact = pair.first == pair.second
        distance = hamming(fingerprint(a), fingerprint(b))
        guarded = check(a, b).ok
        outcomes["exact"].append(exact)
        for d in distances:
            near = exact or distance <= d
            outcomes[f"simhash<={d}"].append(near)
            outcomes[f"simhash<={d}+guard"].append(exact or (near and guarded))
        outcomes["guard-only"].append(exact or guarded)
    embedding_default = None
    if embed is not None:
        embedded, tier = _embedding_outcomes(items, embed, tuple(thresholds))
        outcomes.update(embedded)
        stack = outcomes[DEFAULT_SETTING]
        outcomes[EMBEDDING_SETTING] = [n or t for n, t in zip(stack, tier, strict=True)]
        embedding_default = EMBEDDING_SETTING
    labels = [p.label == 1 for p in items]
    rows = tuple(_row(name, hits, labels) for name, hits in outcomes.items())
    return Report(source, len(items), rows, embedding_default=embedding_default)


def _embedding_outcomes(
    items: Sequence[Pair], embed: BatchEmbed, thresholds: tuple[float, ...]
) -> tuple[dict[str, list[bool]], list[bool]]:
    """Per threshold: cosine alone, with the guard, with the tier's verification; and the
    tier's own hits (verified, at its default threshold)."""
    texts = sorted({p.first for p in items} | {p.second for p in items})
    vectors = np.asarray(embed(texts), dtype=np.float32).reshape(len(texts), -1)
    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {text: i for i, text in enumerate(texts)}
    cosines = [float(vectors[row[p.first]] @ vectors[row[p.second]]) for p in items]
    exact = [p.first == p.second for p in items]
    guarded = [check(p.first, p.second).ok for p in items]
    verified = [verify(p.first, p.second).ok for p in items]
    outcomes: dict[str, list[bool]] = {}
    for t in thresholds:
        near = [e or c >= t for e, c in zip(exact, cosines, strict=True)]
        name = f"embedding>={t:.2f}"
        outcomes[name] = near
        outcomes[name + "+guard"] = [
            e or (n and g) for e, n, g in zip(exact, near, guarded, strict=True)
        ]
        outcomes[name + "+verify"] = [
            e or (n and v) for e, n, v in zip(exact, near, verified, strict=True)
        ]
    tier = [c >= DEFAULT_THRESHOLD and v for c, v in zip(cosines, verified, strict=True)]
    return outcomes, tier


def local_embed() -> BatchEmbed:
    """The local model's batch embedder; ``ImportError`` without the ``embedding`` extra."""
    from gateway.cache.embedding.local import LocalModel

    return LocalModel().encode


def _row(setting: str, hits: list[bool], labels: list[bool]) -> Row:
    tp = sum(1 for h, y in zip(hits, labels, strict=True) if h and y)
    fp = sum(1 for h, y in zip(hits, labels, strict=True) if h and not y)
    fn = sum(1 for h, y in zip(hits, labels, strict=True) if not h and y)
    return Row(setting, tp, fp, fn, len(hits) - tp - fp - fn)


def format_report(report: Report) -> str:
    """A plain-text table of the report, the default setting marked with ``*`` (and the
    embedding tier's default, when scored, with ``+``)."""
    width = max(22, *(len(r.setting) for r in report.rows))
    lines = [
        f"{report.source}: {report.pairs} pairs",
        f"  {'setting':<{width}} {'precision':>9} {'recall':>7} {'false-hit':>9} "
        f"{'TP':>6} {'FP':>6} {'FN':>6} {'TN':>6}",
    ]
    for r in report.rows:
        mark = "*" if r.setting == report.default else " "
        if r.setting == report.embedding_default:
            mark = "+"
        lines.append(
            f"{mark} {r.setting:<{width}} {_pct(r.precision):>9} {_pct(r.recall):>7} "
            f"{_pct(r.false_hit_rate):>9} {r.true_hits:>6} {r.false_hits:>6} "
            f"{r.misses:>6} {r.true_rejects:>6}"
        )
    lines.append("  * default tiers (exact + SimHash with guard); guard-only ignores SimHash")
    if report.embedding_default is not None:
        lines.append(
            "  + with the embedding tier at its default threshold (exact, SimHash, embedding); "
            "+verify: the tier's verification"
        )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
