"""Embedding rows of ``evaluate``: per threshold, cosine alone, with the guard and with the
tier's verification, plus the tiers of an embedding route in order; and, with the local
model, the quality targets at the documented default: precision >= 0.95 at recall >= 0.30
on the question pairs, at most 1 false hit in 30 adversarial negatives."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from gateway.cache.embedding import local
from gateway.cache.evaluate import (
    DEFAULT_SETTING,
    DEFAULT_THRESHOLDS,
    EMBEDDING_SETTING,
    Pair,
    evaluate,
    format_report,
    local_embed,
    read_adjudicated,
)

from .test_cache_embedding import WordsEmbedder

DATA = Path(__file__).parent.parent / "gateway" / "data"

PAIRS = [
    Pair(1, "How do I learn Python?", "How can I learn Python?"),
    Pair(1, "What is the best way to learn Python?", "How should I learn Python?"),
    Pair(1, "Same text", "Same text"),
    Pair(0, "How do I learn Python?", "How do I learn Java?"),
    Pair(0, "Flights from Paris to London", "Flights from London to Paris"),
]


def words(texts: Sequence[str]) -> np.ndarray:
    embedder = WordsEmbedder()
    return np.stack([embedder.vector(t) for t in texts])


def test_embedding_rows_per_threshold_and_the_route_stack() -> None:
    report = evaluate(PAIRS, embed=words, thresholds=(0.2, 0.9))
    rows = {r.setting: r for r in report.rows}
    for name in ("embedding>=0.20", "embedding>=0.20+guard", "embedding>=0.20+rules"):
        assert name in rows and "embedding>=0.90+rules" in rows
    for row in report.rows:
        assert row.true_hits + row.false_hits + row.misses + row.true_rejects == len(PAIRS)
    assert rows["embedding>=0.20"].false_hits == 2  # similar words, different questions
    assert rows["embedding>=0.20+rules"].false_hits == 0
    assert rows["embedding>=0.20+rules"].true_hits == 3
    assert rows["embedding>=0.20+guard"].true_hits == 1  # the guard alone: exact text only
    assert report.embedding_default == EMBEDDING_SETTING
    assert EMBEDDING_SETTING.startswith(DEFAULT_SETTING + "+embedding>=")
    assert rows[EMBEDDING_SETTING].false_hits == 0


def test_without_an_embedder_the_report_is_unchanged() -> None:
    report = evaluate(PAIRS)
    assert report.embedding_default is None
    assert not any(r.setting.startswith("embedding") for r in report.rows)
    assert json.loads(report.to_json())["embedding_default"] is None


def test_the_table_marks_the_embedding_default_and_json_names_it() -> None:
    report = evaluate(PAIRS, embed=words)
    table = format_report(report)
    assert f"+ {EMBEDDING_SETTING}" in table and f"* {DEFAULT_SETTING}" in table
    data = json.loads(report.to_json())
    assert data["embedding_default"] == EMBEDDING_SETTING
    settings = [row["setting"] for row in data["rows"]]
    assert [s for s in settings if s.endswith("+rules")] == [
        f"embedding>={t:.2f}+rules" for t in DEFAULT_THRESHOLDS
    ]


needs_model = pytest.mark.skipif(
    not local.available()[0], reason=f"local embedding model unavailable: {local.available()[1]}"
)


@pytest.fixture(scope="module")
def model_embed() -> object:
    return local_embed()


@needs_model
def test_quality_targets_on_the_question_pairs(model_embed: object) -> None:
    row = evaluate(DATA / "question_pairs.tsv", embed=model_embed).row(EMBEDDING_SETTING)  # type: ignore[arg-type]
    assert row.positives >= 100 and row.negatives >= 100
    assert row.precision is not None and row.precision >= 0.95
    assert row.recall is not None and row.recall >= 0.30


@needs_model
def test_quality_targets_on_the_adversarial_pairs(model_embed: object) -> None:
    row = evaluate(DATA / "adversarial_pairs.tsv", embed=model_embed).row(EMBEDDING_SETTING)  # type: ignore[arg-type]
    assert row.negatives >= 150
    assert row.false_hits <= row.negatives / 30


@needs_model
def test_adjudicated_false_hits_are_reported_apart_never_relabelled(
    tmp_path: Path, model_embed: object
) -> None:
    """A reviewer's list of pairs labelled different but judged the same question changes
    only the second precision figure: the rows stay on the labels as given."""
    mislabelled = Pair(0, "What is the best way to study quickly?", "How can I study quickly?")
    listed = tmp_path / "adjudicated.tsv"
    listed.write_text(
        "label\tfirst\tsecond\twhy\n"
        f"1\t{mislabelled.second}\t{mislabelled.first}\tthe same question\n"
        "0\tHow do I learn Python?\tHow do I learn Java?\tnot listed: judged different\n"
    )
    judged = read_adjudicated(listed)
    assert judged == {(mislabelled.second, mislabelled.first)}
    pairs = [*PAIRS, mislabelled]
    report = evaluate(pairs, embed=model_embed, adjudicated=judged)  # type: ignore[arg-type]
    row = report.row(EMBEDDING_SETTING)
    assert row.false_hits == 1 and report.relabelled == 1  # either order matches
    assert report.adjudicated_precision == 1.0 and row.precision is not None and row.precision < 1
    assert "1 of its 1 false hits judged the same question" in format_report(report)
    assert evaluate(pairs, embed=model_embed).relabelled is None  # type: ignore[arg-type]
