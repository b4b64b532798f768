"""``gateway cache-eval --plot``: the precision-recall curves of each method, one panel per
pair file, the default operating point marked.  Needs matplotlib (not a dependency: it is
imported only here, and ``ImportError`` says so)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from gateway.cache.evaluate import Report


def plot(reports: Sequence[Report], path: str | Path) -> None:
    """Draw every report's curves into one PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in reports if r.curves]
    if not shown:
        raise ValueError("no curves to draw: run with --embedding")
    cols = min(2, len(shown))
    rows = -(-len(shown) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(shown) :]:
        ax.set_visible(False)
    for ax, report in zip(axes.flat, shown, strict=False):
        for name, points in report.curves:
            drawn = [p for p in points if p.precision is not None and p.min_score <= 1]
            ax.plot([p.recall for p in drawn], [p.precision for p in drawn], label=name)
        if report.embedding_default is not None:
            row = report.row(report.embedding_default)
            if row.recall is not None and row.precision is not None:
                ax.plot(row.recall, row.precision, "k*", markersize=12, label="default tiers")
        ax.set_title(f"{Path(report.source).name} ({report.pairs} pairs)")
        ax.set_xlabel("recall")
        ax.set_ylabel("precision")
        ax.set_xlim(0, 1)
        ax.set_ylim(0.4, 1.01)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
