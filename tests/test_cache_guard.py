"""Normalisation, SimHash and the guard, and the evaluation behind ``gateway cache-eval``."""

from __future__ import annotations

import gc
import hashlib
import json
import random
import tracemalloc
from pathlib import Path

import pytest

from gateway.cache.evaluate import DEFAULT_SETTING, Pair, evaluate, format_report, read_pairs
from gateway.cache.guard import check
from gateway.cache.normalize import comparable_form, normalize
from gateway.cache.simhash import MAX_DISTANCE, bands, features, fingerprint, hamming

DATA = Path(__file__).parent.parent / "gateway" / "data"
PAWS = Path("/work/shared/data/paws_wiki_dev.tsv")


def test_normalisation_keeps_digits_symbols_and_negations() -> None:
    assert normalize("What is C++?").words != normalize("What is C?").words
    assert normalize("Is 3 > 4?").words == ("is", "3", ">", "4")
    assert normalize("Why isn't it -5?").words == ("why", "is", "not", "it", "-", "5")
    assert normalize("Why dont cats swim").words == normalize("Why don't cats swim?").words


def test_normalisation_remembers_long_texts_by_the_few() -> None:
    """Results are remembered (a message is normalised for its keys, tiers and verifier),
    but a result costs about 140 bytes a word: 300 distinct messages of 8 KB, the longest
    the near-duplicate tiers compare, held 63 MB when the thousands remembered could be any
    length; the long ones are now remembered by the 64 (12 MB)."""
    rng = random.Random(8)
    words = "how do i configure the cluster for my model server not 42 3.5".split()
    texts = [f"{i} " + " ".join(rng.choices(words, k=2000))[:8190] for i in range(300)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    results = [normalize(text).words[:3] for text in texts]
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(results) == 300 and held < 20 * 2**20
    assert normalize(texts[-1]) is normalize(texts[-1])  # still remembered
    short = "What is the capital of France?"
    assert normalize(short) is normalize(short)


def test_normalisation_drops_case_punctuation_articles_and_edge_greetings() -> None:
    assert normalize("Hi! What's the capital of France? Thanks!").words == (
        "what",
        "is",
        "capital",
        "of",
        "france",
    )
    assert "hello" in normalize("How do you say hello in Spanish?").words


def test_normalisation_maps_number_words_and_keeps_quotes_and_code() -> None:
    assert normalize("the first twelve").words == normalize("the 1st 12").words
    norm = normalize('Translate "Good night" and ```x = 1```')
    assert norm.quoted == ("Good night",) and norm.code == ("```x = 1```",)


def test_fingerprint_is_stable_and_banded() -> None:
    fp = fingerprint("What is the capital of France?")
    assert fp == fingerprint("what is the capital of france")
    assert 0 <= fp < 2**64 and len(bands(fp)) == MAX_DISTANCE + 1
    assert hamming(fp, fp ^ 0b111) == 3


def test_capitals_are_marked_only_mid_sentence() -> None:
    norm = normalize("Is it in Paris? Paris is big.\nParis, or Rome: Rome it is; London then")
    cased = [t.text for t in norm.tokens if t.cased]
    assert cased == ["paris", "rome", "london"]
    assert len(norm.tokens) == 15


def _reference_fingerprint(feats: list[str]) -> int:
    """SimHash spelled out: bit i is set when more than half the features' blake2b hashes
    have bit i set."""
    ones = [0] * 64
    for feature in feats:
        digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
        value = int.from_bytes(digest, "big")
        for bit in range(64):
            ones[bit] += value >> bit & 1
    return sum(1 << bit for bit in range(64) if ones[bit] * 2 > len(feats))


def test_fingerprint_is_the_majority_vote_of_feature_hashes() -> None:
    """The vectorised vote equals a per-bit count on random messages of 0 to 60 tokens,
    ties (an even number of features) included."""
    rng = random.Random(5)
    vocabulary = "how do I what is the not C++ 42 3.5 Paris paris configure - ? don't".split()
    vocabulary += ["".join(rng.choices("abcdefghij", k=rng.randint(1, 9))) for _ in range(50)]
    for _ in range(400):
        text = " ".join(rng.choices(vocabulary, k=rng.randint(0, 60)))
        assert fingerprint(text) == _reference_fingerprint(features(normalize(text)))


def test_fingerprints_are_stable_across_versions() -> None:
    """Stores keep fingerprints: a change of the features or their hash would strand every
    stored entry outside its query's buckets."""
    assert fingerprint("What is the capital of France?") == 0x33FD4672F95DD2DE
    assert fingerprint("How do I reverse a list in Python?") == 4148582368393062224


def test_fingerprints_within_max_distance_share_a_band() -> None:
    fp = fingerprint("How do I reverse a list in Python?")
    for flips in ((0, 17, 33), (1, 2, 3), (15, 31, 47), (63, 62, 48)):
        other = fp
        for bit in flips:
            other ^= 1 << bit
        assert any(a == b for a, b in zip(bands(fp), bands(other), strict=True))


@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        ("Flights from Paris to London", "Flights from London to Paris", "order"),
        ("Is coffee good for you?", "Is coffee not good for you?", "negation"),
        ("What is 12 times 13?", "What is 12 times 14?", "numbers"),
        ('Translate "good morning"', 'Translate "good night"', "quoted"),
        ("How do I increase my score?", "How do I decrease my score?", "direction"),
        ("Who founded Microsoft?", "Who founded Apple?", "entity"),
        ("What is marital law?", "What is martial law?", "content"),
        ("Explain pointers in C++", "Explain pointers in C", "entity"),
    ],
)
def test_guard_rejects_minimal_edits_with_a_reason(first: str, second: str, reason: str) -> None:
    verdict = check(first, second)
    assert not verdict.ok and verdict.reason == reason


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("What is the capital of France?", "what is the capital of france"),
        ("How do I receive payments?", "How do I recieve payments?"),
        ("Why don't cats like water?", "why dont cats like water"),
        ("Explain the theory of relativity", "Please explain the theory of relativity."),
    ],
)
def test_guard_accepts_case_punctuation_typo_and_filler_edits(first: str, second: str) -> None:
    assert check(first, second).ok
    assert check(second, first).ok


def test_guard_rejects_typos_in_short_or_capitalised_words() -> None:
    assert not check("Who is the CEO of Gogle?", "Who is the CEO of Google?").ok
    assert not check("Is the cat here?", "Is the car here?").ok


def test_default_tiers_have_zero_false_hits_on_adversarial_pairs() -> None:
    report = evaluate(DATA / "adversarial_pairs.tsv")
    row = report.row(DEFAULT_SETTING)
    assert row.negatives >= 150 and row.false_hits == 0
    assert row.recall is not None and row.recall >= 0.9


def test_default_tiers_have_zero_false_hits_on_question_pairs() -> None:
    row = evaluate(DATA / "question_pairs.tsv").row(DEFAULT_SETTING)
    assert row.negatives >= 50 and row.false_hits == 0


@pytest.mark.skipif(not PAWS.exists(), reason="PAWS development set not present")
def test_default_tiers_stay_under_one_percent_false_hits_on_paws() -> None:
    report = evaluate(PAWS)
    assert (report.row(DEFAULT_SETTING).false_hit_rate or 0) <= 0.01
    assert (report.row(f"simhash<={MAX_DISTANCE}").false_hit_rate or 0) > 0.01  # guard matters


def test_report_formats_as_table_and_json(tmp_path: Path) -> None:
    path = tmp_path / "pairs.tsv"
    path.write_text("label\tfirst\tsecond\n1\tHi there\thi there\n0\tIs it 3?\tIs it 4?\n")
    report = evaluate(path)
    assert report.pairs == 2
    row = report.row(DEFAULT_SETTING)
    assert (row.true_hits, row.false_hits, row.precision, row.recall) == (1, 0, 1.0, 1.0)
    table = format_report(report)
    assert "* " + DEFAULT_SETTING in table and "precision" in table
    data = json.loads(report.to_json())
    assert data["default"] == DEFAULT_SETTING and data["rows"][0]["setting"] == "exact"


def test_read_pairs_rejects_malformed_lines(tmp_path: Path) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text("1\ta\tb\nnot a pair\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:2"):
        read_pairs(path)
    assert evaluate([Pair(1, "a b", "a b")]).row("exact").true_hits == 1


def test_comparable_forms_are_equal_exactly_when_normalised_messages_are() -> None:
    """Equal forms stand in for the guard on stored prompts, so they must never merge two
    different normalised messages (token text, kind, case, quoted spans, code)."""
    pairs = read_pairs(DATA / "adversarial_pairs.tsv")
    texts = [t for p in pairs for t in (p.first, p.second)] + [
        'Say "x y" twice',
        'Say "x" y twice',
        "Say x 'y' twice",
        "Compare C++ and C",
        "Compare C and C++",
        "Where is paris?",
        "Where is Paris?",
        "Where is Paris!",
        "What is 12 plus 3?",
        "What is 1 2 plus 3?",
        "Run ```ls -la``` here",
        "Run ```ls  -la``` here",
    ]
    by_form: dict[str, set[object]] = {}
    for text in texts:
        by_form.setdefault(comparable_form(normalize(text)), set()).add(normalize(text))
    assert all(len(norms) == 1 for norms in by_form.values())
    assert len(by_form) == len({normalize(t) for t in texts})
    assert comparable_form(normalize("Where is Paris?")) == comparable_form(
        normalize("where is Paris!")
    )
