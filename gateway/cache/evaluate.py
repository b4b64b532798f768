"""``gateway cache-eval``: precision, recall and false-hit rate of each tier and setting.

Input is labelled pairs, ``label<TAB>first<TAB>second`` (1 = the answer to one is an
acceptable answer to the other), an optional header line first.  Each setting is applied as
if ``first`` were cached and ``second`` were asked in the same context: the exact tier hits
on byte-equal text; the SimHash tier at Hamming distance <= d; the guarded rows add the
guard that the product always runs.  A false hit is a hit on a pair labelled 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .guard import check
from .normalize import normalize
from .simhash import MAX_DISTANCE, fingerprint, hamming

DEFAULT_DISTANCES = tuple(range(MAX_DISTANCE + 1))
DEFAULT_SETTING = f"simhash<={MAX_DISTANCE}+guard"


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

    def row(self, setting: str) -> Row:
        return next(r for r in self.rows if r.setting == setting)

    def to_json(self) -> str:
        return json.dumps(
            {
                "source": self.source,
                "pairs": self.pairs,
                "default": self.default,
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
    pairs: str | Path | Sequence[Pair], distances: Iterable[int] = DEFAULT_DISTANCES
) -> Report:
    """Score the exact tier and the SimHash tier at each distance, with and without guard."""
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
    labels = [p.label == 1 for p in items]
    rows = tuple(_row(name, hits, labels) for name, hits in outcomes.items())
    return Report(source, len(items), rows)


def _row(setting: str, hits: list[bool], labels: list[bool]) -> Row:
    tp = sum(1 for h, y in zip(hits, labels, strict=True) if h and y)
    fp = sum(1 for h, y in zip(hits, labels, strict=True) if h and not y)
    fn = sum(1 for h, y in zip(hits, labels, strict=True) if not h and y)
    return Row(setting, tp, fp, fn, len(hits) - tp - fp - fn)


def format_report(report: Report) -> str:
    """A plain-text table of the report, the default setting marked with ``*``."""
    lines = [
        f"{report.source}: {report.pairs} pairs",
        f"  {'setting':<22} {'precision':>9} {'recall':>7} {'false-hit':>9} "
        f"{'TP':>6} {'FP':>6} {'FN':>6} {'TN':>6}",
    ]
    for r in report.rows:
        mark = "*" if r.setting == report.default else " "
        lines.append(
            f"{mark} {r.setting:<22} {_pct(r.precision):>9} {_pct(r.recall):>7} "
            f"{_pct(r.false_hit_rate):>9} {r.true_hits:>6} {r.false_hits:>6} "
            f"{r.misses:>6} {r.true_rejects:>6}"
        )
    lines.append("  * default tiers (exact + SimHash with guard); guard-only ignores SimHash")
    return "\n".join(lines)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"
