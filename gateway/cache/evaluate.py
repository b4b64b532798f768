"""``gateway cache-eval``: precision, recall and false-hit rate of each tier and setting.

Input is labelled pairs, ``label<TAB>first<TAB>second`` (1 = the answer to one is an
acceptable answer to the other), an optional header line first.  Each setting is applied as
if ``first`` were cached and ``second`` were asked in the same context: the exact tier hits
on byte-equal text; the SimHash tier at Hamming distance <= d; the guarded rows add the
guard that the product always runs.  A false hit is a hit on a pair labelled 0.

With an embedder (``embed``, e.g. ``local_embed()`` from the ``embedding`` extra) the
embedding tier is scored too, at each threshold: on cosine similarity alone, with the
guard, with the rules (``embedding.verify``: the guard, or its checks over reworded
question frames) and with the learned verifier at the default error budget
(``embedding.learned``), which is what the tier runs by default; and the tiers a route with
``semantic.method: embedding`` runs, in order (exact, SimHash with guard, then the
embedding tier at its defaults), as ``EMBEDDING_SETTING``.  Each method also gets its
precision-recall curve (``calibrate.curve``), with the false-hit rate's 95% upper bound at
every operating point; ``calibrate_pairs`` picks the operating point for a budget on the
user's own pairs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gateway.cache import calibrate
from gateway.cache.calibrate import Point
from gateway.cache.embedding import learned
from gateway.cache.embedding.tier import DEFAULT_THRESHOLD
from gateway.cache.embedding.verify import verify
from gateway.cache.guard import Verdict, check
from gateway.cache.normalize import Normalized, normalize
from gateway.cache.simhash import MAX_DISTANCE, fingerprint, hamming
from gateway.policy.route import DEFAULT_MAX_FALSE_HIT_RATE

DEFAULT_DISTANCES = tuple(range(MAX_DISTANCE + 1))
DEFAULT_SETTING = f"simhash<={MAX_DISTANCE}+guard"
DEFAULT_THRESHOLDS = (0.80, 0.85, 0.90, 0.95)
LEARNED = f"+learned@{DEFAULT_MAX_FALSE_HIT_RATE:g}"
EMBEDDING_SETTING = f"{DEFAULT_SETTING}+embedding>={DEFAULT_THRESHOLD:.2f}{LEARNED}"
RECALLS = (0.1, 0.2, 0.3, 0.45)
BUDGETS = (0.005, 0.01, 0.02, 0.05)

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
    curves: tuple[tuple[str, tuple[Point, ...]], ...] = ()
    relabelled: int | None = None
    """Of the embedding default's false hits, how many a reviewer judged the same question
    (``read_adjudicated``); None when no adjudication was given."""

    @property
    def adjudicated_precision(self) -> float | None:
        """The embedding default's precision with the judged false hits counted as true."""
        if self.relabelled is None or self.embedding_default is None:
            return None
        row = self.row(self.embedding_default)
        hits = row.true_hits + row.false_hits
        return (row.true_hits + self.relabelled) / hits if hits else None

    def row(self, setting: str) -> Row:
        return next(r for r in self.rows if r.setting == setting)

    def to_json(self) -> str:
        return json.dumps(
            {
                "source": self.source,
                "pairs": self.pairs,
                "default": self.default,
                "embedding_default": self.embedding_default,
                "relabelled": self.relabelled,
                "adjudicated_precision": self.adjudicated_precision,
                "rows": [
                    asdict(r)
                    | {
                        "precision": r.precision,
                        "recall": r.recall,
                        "false_hit_rate": r.false_hit_rate,
                    }
                    for r in self.rows
                ],
                "curves": {
                    name: [p.as_dict() for p in points[::4] if p.min_score <= 1]
                    for name, points in self.curves
                },
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


def read_adjudicated(path: str | Path) -> frozenset[tuple[str, str]]:
    """Pairs labelled different that a reviewer judged to ask the same question: lines of
    ``1<TAB>first<TAB>second<TAB>why`` (a header line and ``#`` comments skipped).  Used
    only to report precision a second time, never to train or calibrate."""
    found = set()
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[0] == "1":
            found.add((parts[1], parts[2]))
    return frozenset(found)


def evaluate(
    pairs: str | Path | Sequence[Pair],
    distances: Iterable[int] = DEFAULT_DISTANCES,
    *,
    embed: BatchEmbed | None = None,
    thresholds: Iterable[float] = DEFAULT_THRESHOLDS,
    adjudicated: frozenset[tuple[str, str]] | None = None,
) -> Report:
    """Score the exact tier and the SimHash tier at each distance, with and without guard;
    with ``embed``, also the embedding tier at each threshold (see the module docstring);
    with ``adjudicated`` (``read_adjudicated``), count the embedding default's false hits
    that a reviewer judged the same question."""
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
    curves: tuple[tuple[str, tuple[Point, ...]], ...] = ()
    labels = [p.label == 1 for p in items]
    if embed is not None:
        embedded, tier, scored = _embedding_outcomes(items, embed, tuple(thresholds))
        outcomes.update(embedded)
        curves = tuple((name, calibrate.curve(s, labels)) for name, s in scored.items())
        stack = outcomes[DEFAULT_SETTING]
        outcomes[EMBEDDING_SETTING] = [n or t for n, t in zip(stack, tier, strict=True)]
        embedding_default = EMBEDDING_SETTING
    relabelled = None
    if adjudicated is not None and embedding_default is not None:
        hits = outcomes[EMBEDDING_SETTING]
        relabelled = sum(
            1
            for p, hit in zip(items, hits, strict=True)
            if hit and not p.label and adjudicated & {(p.first, p.second), (p.second, p.first)}
        )
    rows = tuple(_row(name, hits, labels) for name, hits in outcomes.items())
    return Report(
        source,
        len(items),
        rows,
        embedding_default=embedding_default,
        curves=curves,
        relabelled=relabelled,
    )


def cosines(items: Sequence[Pair], embed: BatchEmbed) -> list[float]:
    """The cosine similarity of each pair, every distinct text embedded once."""
    if not items:
        return []
    texts = sorted({p.first for p in items} | {p.second for p in items})
    vectors = np.asarray(embed(texts), dtype=np.float32).reshape(len(texts), -1)
    vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    row = {text: i for i, text in enumerate(texts)}
    return [float(vectors[row[p.first]] @ vectors[row[p.second]]) for p in items]


def learned_scores(
    items: Sequence[Pair], similarity: Sequence[float], floor: float = DEFAULT_THRESHOLD
) -> list[float]:
    """The learned verifier's score of each pair as the tier computes it: 2 for byte-equal
    text (the exact tier), -1 below the cosine ``floor`` or for a hard difference.  The
    cross-encoder reads the other pairs, in batches."""
    from gateway.cache.embedding import cross

    model = learned.shipped()
    out = [2.0 if p.first == p.second else -1.0 for p in items]
    read: list[int] = []
    found: list[tuple[Normalized, Normalized, tuple[bool, Verdict]]] = []
    for i, (p, c) in enumerate(zip(items, similarity, strict=True)):
        if out[i] == -1.0 and c >= floor:
            a, b = normalize(p.first), normalize(p.second)
            verdict = learned.verdicts(a, b)
            if not learned.hard_difference(a, b, verdict):
                read.append(i)
                found.append((a, b, verdict))
    logits = cross.shared().logits([(items[i].first, items[i].second) for i in read], whole=True)
    for i, (a, b, verdict), logit in zip(read, found, logits, strict=True):
        if np.isnan(logit):  # too long to read whole: refused, as the tier refuses it
            continue
        values = learned.features(a, b, similarity[i], float(logit), verdict)
        out[i] = model.raw_score(values)
    return out


def calibrate_pairs(
    pairs: str | Path | Sequence[Pair], embed: BatchEmbed, budget: float
) -> tuple[Point, tuple[Point, ...]]:
    """The learned verifier's operating point for ``budget`` on the user's labelled pairs,
    and the whole curve."""
    items = read_pairs(pairs) if isinstance(pairs, str | Path) else list(pairs)
    if not items:
        raise ValueError(f"{pairs}: no labelled pairs to calibrate on")
    scores = learned_scores(items, cosines(items, embed))
    points = calibrate.curve(scores, [p.label == 1 for p in items])
    return calibrate.choose(points, budget), points


def _embedding_outcomes(
    items: Sequence[Pair], embed: BatchEmbed, thresholds: tuple[float, ...]
) -> tuple[dict[str, list[bool]], list[bool], dict[str, list[float]]]:
    """Per threshold: cosine alone, with the guard, with the rules, with the learned
    verifier; the tier's own hits at its defaults; and each method's scores for its
    curve."""
    similarity = cosines(items, embed)
    exact = [p.first == p.second for p in items]
    guarded = [check(p.first, p.second).ok for p in items]
    verified = [verify(p.first, p.second).ok for p in items]
    scores = learned_scores(items, similarity, floor=min((*thresholds, DEFAULT_THRESHOLD)))
    min_score = learned.shipped().operating_point(DEFAULT_MAX_FALSE_HIT_RATE).min_score
    accepted = [s >= min_score for s in scores]
    outcomes: dict[str, list[bool]] = {}
    for t in thresholds:
        near = [e or c >= t for e, c in zip(exact, similarity, strict=True)]
        name = f"embedding>={t:.2f}"
        outcomes[name] = near
        outcomes[name + "+guard"] = [
            e or (n and g) for e, n, g in zip(exact, near, guarded, strict=True)
        ]
        outcomes[name + "+rules"] = [
            e or (n and v) for e, n, v in zip(exact, near, verified, strict=True)
        ]
        outcomes[name + LEARNED] = [
            e or (n and a) for e, n, a in zip(exact, near, accepted, strict=True)
        ]
    tier = [c >= DEFAULT_THRESHOLD and a for c, a in zip(similarity, accepted, strict=True)]
    scored = {
        "cosine": [2.0 if e else c for e, c in zip(exact, similarity, strict=True)],
        "cosine+rules": [
            2.0 if e else (c if v else -1.0)
            for e, c, v in zip(exact, similarity, verified, strict=True)
        ],
        "learned": [
            -1.0 if c < DEFAULT_THRESHOLD else s for c, s in zip(similarity, scores, strict=True)
        ],
    }
    return outcomes, tier, scored


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
            "+rules: the rule-based verifier; "
            f"{LEARNED.lstrip('+')}: the learned verifier at the default error budget"
        )
    if report.relabelled is not None and report.embedding_default is not None:
        row = report.row(report.embedding_default)
        lines.append(
            f"  + adjudicated: precision {_pct(report.adjudicated_precision)} "
            f"({report.relabelled} of its {row.false_hits} false hits judged the same question)"
        )
    for name, points in report.curves:
        lines.append("")
        lines.append(
            f"  {name}: precision at recall "
            + "  ".join(
                f"{r:.2f}: {_pct(calibrate.precision_at_recall(points, r))}" for r in RECALLS
            )
        )
        if name == "learned":
            lines.append(
                f"    {'budget':>7} {'min_score':>9} {'precision':>9} {'recall':>7} "
                f"{'false-hit':>9} {'upper 95%':>9}"
            )
            for budget in BUDGETS:
                p = calibrate.choose(points, budget)
                lines.append(
                    f"    {budget:>7g} {p.min_score:>9.3f} {_pct(p.precision):>9} "
                    f"{_pct(p.recall):>7} {_pct(p.false_hit_rate):>9} {_pct(p.upper):>9}"
                )
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
