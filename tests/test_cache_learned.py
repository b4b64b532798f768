"""The learned verifier and its error budget: the Wilson bound, operating points, hard
differences no score outvotes, the shipped weights, the policy's `max_false_hit_rate` and
`min_score`, `GET /policy` showing the point in force, `cache-eval --calibrate`, and (on
the development pairs, when present) a budget that holds on pairs used neither to train
nor to calibrate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from gateway.cache.calibrate import (
    Point,
    choose,
    curve,
    precision_at_recall,
    wilson_lower,
    wilson_upper,
)
from gateway.cache.embedding import learned, local
from gateway.cache.embedding.learned import (
    FEATURES,
    SCORE,
    LearnedVerifier,
    Model,
    hard_difference,
    in_force,
    shipped,
    uses_learned,
)
from gateway.cache.embedding.verify import opposite
from gateway.cache.evaluate import read_pairs
from gateway.cache.normalize import normalize
from gateway.policy.route import DEFAULT_MAX_FALSE_HIT_RATE, Semantic
from tests.helpers import write_policy
from tests.upstreams import Recorder

ROOT = Path(__file__).resolve().parents[1]
EVAL = (sys.executable, "-m", "gateway", "cache-eval")
CALIBRATE = (*EVAL, "--calibrate")
QQP = ROOT.parent / "shared" / "data" / "qqp_dev.tsv"
needs_model = pytest.mark.skipif(
    not local.available()[0], reason=f"local embedding model unavailable: {local.available()[1]}"
)


def test_the_wilson_bound_is_above_the_rate_and_tightens_with_more_pairs() -> None:
    assert wilson_upper(0, 0) == 1.0
    assert wilson_upper(0, 100) == pytest.approx(0.0263, abs=1e-3)  # the rule of three, roughly
    assert wilson_upper(10, 1000) == pytest.approx(0.0170, abs=1e-3)
    assert wilson_upper(1, 100) > wilson_upper(10, 1000) > 10 / 1000
    assert wilson_upper(100, 100) == 1.0


def test_operating_points_count_each_pair_once_and_choose_the_most_permissive_in_budget() -> None:
    scores = [0.95, 0.9, 0.8, 0.7, 0.6, -1.0]
    labels = [True, True, False, True, False, True]
    points = curve(scores, labels, steps=20)
    assert points[0].min_score == 0.0 and points[-1].min_score == float("inf")
    assert all(p.positives == 4 and p.negatives == 2 for p in points)
    at = {round(p.min_score, 2): p for p in points}
    assert (at[0.85].true_hits, at[0.85].false_hits) == (2, 0)
    assert (at[0.0].true_hits, at[0.0].false_hits) == (3, 2)  # the refused pair never hits
    hits = [p.true_hits + p.false_hits for p in points]
    assert hits == sorted(hits, reverse=True)
    many = [Point(t, 50, fp, 100, 1000) for t, fp in ((0.5, 40), (0.7, 15), (0.9, 2))]
    assert choose(many, 0.025).min_score == 0.7  # 15 in 1000: bound 2.1%
    assert choose(many, 0.02).min_score == 0.9
    assert choose(many, 0.001).min_score == 0.9  # none within: the strictest
    assert precision_at_recall(many, 0.5) == pytest.approx(50 / 52)


def test_choose_agrees_with_the_bound() -> None:
    point = Point(0.7, 50, 15, 100, 1000)
    assert point.upper <= 0.025 and point.upper > 0.015
    assert choose([point], point.upper).min_score == 0.7


@pytest.mark.parametrize(
    ("first", "second", "reason"),
    [
        ("How do I reset my password?", "How do I reset your password?", "pronoun"),
        ("Flights from Paris to London", "Flights from London to Paris", "order"),
        ("Is 7 a prime number?", "Is 9 a prime number?", "numbers"),
        ("Why is my code working?", "Why is my code not working?", "negation"),
        ('What does "foo" mean?', 'What does "bar" mean?', "quoted"),
        ("Is it legal to record a phone call?", "Is it illegal to record a call?", "negation"),
        ("Are vaccines safe in pregnancy?", "Are vaccines unsafe for pregnant women?", "negation"),
        (
            "Is this statement true: water boils at 100 C",
            "Is it false: water boils at 100 C",
            "negation",
        ),
        ("Should I buy Tesla stock now?", "Is now the time to sell Tesla stock?", "negation"),
        ("Why do people dislike cats?", "Why do people like cats so much?", "negation"),
        ("How can I become more productive?", "How can I become less productive?", "negation"),
    ],
)
def test_a_hard_difference_refuses_whatever_the_score(first, second, reason) -> None:
    a, b = normalize(first), normalize(second)
    assert hard_difference(a, b) == reason
    assert shipped().score(a, b, 1.0, 10.0) == -1.0
    verdict = LearnedVerifier(shipped(), 0.0)(first, second, 1.0)
    assert (verdict.ok, verdict.reason) == (False, reason)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("How do I play a video on my TV?", "How do I display a video on my TV?"),
        ("How do I install Python?", "What is the way to install Python?"),
        ("Is Python easy to learn?", "Is learning Python easy or hard for beginners?"),
    ],
)
def test_words_that_only_look_negated_are_no_opposites(first, second) -> None:
    """ "dis" is not read as a negation (play/display), and a word on both sides is none."""
    assert not opposite(normalize(first), normalize(second))


def test_opposites_are_found_in_time_linear_in_the_words() -> None:
    """Two long prompts of different words: each word's few opposites are looked up, never
    every pair of words (40,000 words a side would be 1.6 billion pairs)."""

    def letters(n: int) -> str:  # a word of its own per n, no digits
        return "".join(chr(ord("a") + int(d, 26)) for d in np.base_repr(n, 26))

    many = " ".join("qx" + letters(i) for i in range(40_000))
    other = " ".join("zv" + letters(i) for i in range(40_000))
    assert not opposite(normalize(f"Is {many} legal?"), normalize(f"Is {other} fine?"))
    assert opposite(normalize(f"Is {many} legal?"), normalize(f"Is {other} illegal?"))


@needs_model
def test_the_score_decides_when_no_hard_difference_applies() -> None:
    first, second = "How can I learn Python quickly?", "What is the fastest way to learn Python?"
    assert hard_difference(normalize(first), normalize(second)) == ""
    assert LearnedVerifier(shipped(), 0.0)(first, second, 0.9).ok
    refused = LearnedVerifier(shipped(), 1.0)(first, second, 0.9)
    assert (refused.ok, refused.reason) == (False, SCORE)
    a, b = normalize(first), normalize(second)
    score = shipped().score(a, b, 0.9, 2.0)
    assert shipped().score(a, b, 0.9, -2.0) < score  # the cross-encoder counts
    assert repr(LearnedVerifier(shipped(), 0.5)) == "<LearnedVerifier min_score=0.500>"


def test_the_shipped_model_round_trips_and_refuses_other_features() -> None:
    model = shipped()
    assert model.names == FEATURES and len(model.weights) == len(FEATURES)
    assert Model.from_json(model.to_json()) == model
    assert model.calibration and model.source.startswith("qqp_dev.tsv")
    assert FEATURES[-1] == "cross_logit"
    data = json.loads(model.to_json())
    data["features"] = data["features"][:-1]
    with pytest.raises(ValueError, match="other features"):
        Model.from_json(json.dumps(data))


def test_the_budget_picks_the_operating_point_and_min_score_overrides_it() -> None:
    default = Semantic(method="embedding")
    assert default.verifier == "learned" and default.max_false_hit_rate == 0.01
    point = shipped().operating_point(DEFAULT_MAX_FALSE_HIT_RATE)
    assert point.upper <= DEFAULT_MAX_FALSE_HIT_RATE
    assert learned.verifier_for(default).min_score == point.min_score
    looser = learned.verifier_for(Semantic(method="embedding", max_false_hit_rate=0.05))
    assert looser.min_score < point.min_score
    assert learned.verifier_for(Semantic(method="embedding", min_score=0.5)).min_score == 0.5
    shown = in_force(default)
    assert shown["from"] == "max_false_hit_rate" and shown["min_score"] == point.min_score
    assert shown["calibrated"]["false_hit_rate_upper"] <= 0.01  # type: ignore[index]
    assert in_force(Semantic(method="embedding", min_score=0.5))["from"] == "min_score"


def test_rules_run_where_the_policy_asks_or_the_calibration_does_not_hold() -> None:
    assert not uses_learned(Semantic(method="embedding", verifier="rules"))
    assert not uses_learned(Semantic(method="embedding", embedder="tei"))
    assert uses_learned(Semantic(method="embedding", embedder="tei", min_score=0.8))
    assert in_force(Semantic(method="embedding", embedder="tei")) == {
        "verifier": "rules",
        "why": "embedder without min_score",
    }


@needs_model
async def test_get_policy_shows_the_operating_point_in_force(
    serve_app, start_gateway, tmp_path
) -> None:
    url = await serve_app(Recorder().app())
    policy = write_policy(
        tmp_path,
        {
            "backends": {"main": {"url": url}},
            "routes": [
                {
                    "name": "chat",
                    "backend": "main",
                    "cache": {"semantic": {"method": "embedding", "max_false_hit_rate": 0.02}},
                },
                {"name": "plain", "backend": "main"},
            ],
        },
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        shown = (await client.get(gw.admin_url + "/policy")).json()
    points = shown["cache_operating_points"]
    assert list(points) == ["chat"]
    assert points["chat"]["min_score"] == shipped().operating_point(0.02).min_score
    assert points["chat"]["calibrated"]["false_hit_rate_upper"] <= 0.02


@needs_model
def test_cache_eval_calibrate_prints_the_operating_point_and_a_policy_snippet() -> None:
    pairs = ROOT / "gateway" / "data" / "question_pairs.tsv"
    done = subprocess.run(
        [*CALIBRATE, str(pairs), "--max-false-hit-rate", "0.05"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "method: embedding" in done.stdout and "min_score: " in done.stdout
    assert "95% upper bound" in done.stdout
    strict = subprocess.run(
        [*CALIBRATE, str(pairs), "--max-false-hit-rate", "0.001", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert strict.returncode == 1 and json.loads(strict.stdout)["found"] is False


@needs_model
@pytest.mark.skipif(not QQP.exists(), reason="development pairs not present (../shared/data)")
def test_the_error_budget_holds_on_pairs_used_neither_to_train_nor_to_calibrate() -> None:
    """The shipped verifier (trained on qqp_train.tsv, which shares no question with the
    development pairs) scores the development pairs as the tier does; five rotations over
    their question-disjoint folds: calibrate on four, measure on the fifth.  At each
    budget, the false-hit rate measured on the fresh folds, pooled (about 3,800 pairs
    labelled different), stays within the budget, and no single fresh fold contradicts it
    (its lower bound is within it)."""
    from bench.train_verifier import folds_by_question
    from gateway.cache.evaluate import cosines, learned_scores, local_embed

    pairs = read_pairs(QQP)
    scores = np.array(learned_scores(pairs, cosines(pairs, local_embed())))
    y = np.array([p.label for p in pairs])
    fold = folds_by_question(pairs, 5)
    budgets = (0.01, 0.02, 0.05)
    pooled = dict.fromkeys(budgets, 0)
    negatives = 0
    for fresh in range(5):
        calibrating = fold != fresh
        calibration = curve(list(scores[calibrating]), [bool(v) for v in y[calibrating]])
        measured, labels = scores[fold == fresh], y[fold == fresh]
        n = int((labels == 0).sum())
        negatives += n
        for budget in budgets:
            point = choose(calibration, budget)
            assert point.upper <= budget
            false_hits = int(((measured >= point.min_score) & (labels == 0)).sum())
            assert wilson_lower(false_hits, n) <= budget, (fresh, budget, false_hits, n)
            assert ((measured >= point.min_score) & (labels == 1)).sum() > 0  # it does hit
            pooled[budget] += false_hits
    for budget in budgets:
        assert pooled[budget] / negatives <= budget, (budget, pooled[budget], negatives)


@needs_model
def test_cache_eval_plot_draws_the_curves(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    done = subprocess.run(
        [*EVAL, "--embedding", "--plot", str(out), str(ROOT / "gateway/data/question_pairs.tsv")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes().startswith(b"\x89PNG")
    assert "learned: precision at recall" in done.stdout
