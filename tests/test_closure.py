"""The pairs a labelled set implies (``bench/closure.py``, ``train_cross_encoder --closure``)."""

from __future__ import annotations

from bench.closure import implied
from gateway.cache.evaluate import Pair


def _named(pairs: list[Pair]) -> set[tuple[int, frozenset[str]]]:
    return {(p.label, frozenset((p.first, p.second))) for p in pairs}


def test_duplicates_of_one_question_are_duplicates_and_its_differences_differ_from_all() -> None:
    labelled = [Pair(1, "a", "b"), Pair(1, "b", "c"), Pair(0, "c", "x"), Pair(1, "x", "y")]
    assert _named(implied(labelled)) == {
        (1, frozenset("ac")),
        (0, frozenset("ax")),
        (0, frozenset("bx")),
        (0, frozenset("ay")),
        (0, frozenset("by")),
        (0, frozenset("cy")),
    }


def test_a_group_the_labels_contradict_implies_nothing() -> None:
    labelled = [Pair(1, "a", "b"), Pair(1, "b", "c"), Pair(0, "a", "c"), Pair(0, "c", "x")]
    assert implied(labelled) == []


def test_a_large_group_gives_at_most_as_many_duplicates_as_it_has_questions() -> None:
    chain = [Pair(1, f"q{i}", f"q{i + 1}") for i in range(9)]  # 10 questions, 36 implied
    out = implied(chain)
    assert len(out) == 10 and all(p.label == 1 for p in out)
    assert not _named(out) & _named(chain)
    assert implied(chain) == out  # seeded: the same draw every run
    assert implied(list(reversed(chain))) == out  # whatever order the file lists them in
