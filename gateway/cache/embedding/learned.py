"""The learned verifier: a logistic model over cheap features of a candidate pair.

An embedding candidate (a cached message whose vector is near the asked one) is accepted
when, first, no *hard difference* refuses it (quoted spans, code, numbers, negations, the
same words in another order, "my" against "your": the minimal edits that change an answer
and that no score may outvote), and then its score reaches the route's ``min_score``.  The
score is a logistic model over features that cost microseconds: the cosine, token and character
overlap, what each side has that the other lacks, entity and direction differences, the
opening question word, the length ratio, and the verdicts of the guard and the rule-based
verifier (``verify``).

The weights (``gateway/data/verifier.json``) were trained offline on development pairs by
``bench/train_verifier.py``, which also ships the *calibration*: the operating points of
the model on pairs it was not trained on (cross-fitted), from which a route's
``max_false_hit_rate`` picks its ``min_score`` (``calibrate.choose``).  The calibration
holds for the local model's cosines; with another embedder, calibrate on your own pairs
(``gateway cache-eval --calibrate``).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import TYPE_CHECKING

from gateway.cache import guard
from gateway.cache.calibrate import Point, choose
from gateway.cache.embedding.verify import canonical, opposite, relaxed, stem, swapped
from gateway.cache.guard import Verdict
from gateway.cache.normalize import Normalized, normalize
from gateway.policy.route import Semantic

if TYPE_CHECKING:
    from gateway.cache.embedding.cross import CrossReader

log = logging.getLogger("gateway.cache")

HARD = frozenset(("quoted", "code", "numbers", "negation", "order", "pronoun"))
"""Rule verdicts no score overrides."""
SCORE = "score"
"""The rejection reason of a candidate whose score is below ``min_score``."""
UNREAD = "unread"
"""The rejection reason of a candidate past the ``MAX_CROSS`` a lookup reads."""
TOO_LONG = "too_long"
"""The rejection reason of a pair too long for the cross-encoder to read whole (more than
``cross.MAX_PAIR_TOKENS`` tokens together): the verifier vouches only for what it read,
and two prompts alike where it reads may differ after it (a long document, then another
question)."""
CROSS_ERROR = "cross_error"
"""The rejection reason of a candidate the cross-encoder could not read."""
MAX_CROSS = 1
"""At most this many candidates per lookup are read by the cross-encoder (the most similar
that no hard difference refused and that could reach the score needed): its cost bounds a
lookup's."""
_OPENINGS = frozenset(
    "what how why who when where which is are can do does should will would was were did".split()
)

FEATURES = (
    "cosine",
    "cosine_over_0.8",
    "cosine_over_0.9",
    "token_jaccard",
    "char_jaccard",
    "only_first_share",
    "only_second_share",
    "only_fewer",
    "only_more",
    "length_ratio",
    "entities_differ",
    "direction_swap",
    "direction_change",
    "same_opening",
    "other_question_opening",
    "guard_ok",
    "rules_ok",
    "log_length",
    "rules_ok_x_cosine",
    "guard_ok_x_cosine",
    "token_jaccard_x_cosine",
    "cross_logit",
)


def verdicts(a: Normalized, b: Normalized) -> tuple[bool, Verdict]:
    """The guard's verdict on the pair and, when it refuses, the rules' (run once, shared by
    ``hard_difference`` and ``features``)."""
    if guard.check(a, b).ok:
        return True, guard.PASS
    return False, relaxed(a, b)


def features(
    a: Normalized,
    b: Normalized,
    cosine: float,
    cross_logit: float,
    found: tuple[bool, Verdict] | None = None,
) -> list[float]:
    """The model's inputs for the pair, in ``FEATURES`` order (``cross_logit``: the
    cross-encoder's logit of the pair; ``found``: its ``verdicts``, when already known)."""
    guarded, rules = found or verdicts(a, b)
    guard_ok = 1.0 if guarded else 0.0
    rules_ok = 1.0 if guarded or rules.ok else 0.0
    ca, cb = canonical(a), canonical(b)
    sa, sb = set(ca), set(cb)
    only_a, only_b = sa - sb, sb - sa
    la, lb = len(ca) or 1, len(cb) or 1
    jaccard = len(sa & sb) / (len(sa | sb) or 1)
    wa = [t.text for t in a.tokens]
    wb = [t.text for t in b.tokens]
    ga, gb = _grams(" ".join(wa)), _grams(" ".join(wb))
    cased_a = {stem(t.text) for t in a.tokens if t.cased}
    cased_b = {stem(t.text) for t in b.tokens if t.cased}
    dir_a = any(w in guard.DIRECTIONS for w in only_a)
    dir_b = any(w in guard.DIRECTIONS for w in only_b)
    same_opening = bool(wa and wb and wa[0] == wb[0])
    both_questions = bool(wa and wb and wa[0] in _OPENINGS and wb[0] in _OPENINGS)
    return [
        cosine,
        max(0.0, cosine - 0.8),
        max(0.0, cosine - 0.9),
        jaccard,
        len(ga & gb) / (len(ga | gb) or 1),
        len(only_a) / la,
        len(only_b) / lb,
        float(min(len(only_a), len(only_b))),
        float(max(len(only_a), len(only_b))),
        min(la, lb) / max(la, lb),
        float(len(cased_a ^ cased_b)),
        float(dir_a and dir_b),
        float(dir_a or dir_b),
        float(same_opening),
        float(both_questions and not same_opening),
        guard_ok,
        rules_ok,
        math.log(max(la, lb)),
        rules_ok * cosine,
        guard_ok * cosine,
        jaccard * cosine,
        cross_logit,
    ]


def hard_difference(a: Normalized, b: Normalized, found: tuple[bool, Verdict] | None = None) -> str:
    """The reason a pair is refused whatever its score, or "" when none applies: the
    rules' hard verdicts, a word against its opposite (``opposite``, counted as a
    negation), and words both sides share in another order (``swapped``)."""
    guarded, rules = found or verdicts(a, b)
    if guarded:
        return ""
    if rules.reason in HARD:
        return rules.reason
    if opposite(a, b):
        return "negation"
    return "order" if swapped(a, b) else ""


def _grams(text: str, n: int = 3) -> set[str]:
    padded = f" {text} "
    return {padded[i : i + n] for i in range(len(padded) - n + 1)}


@dataclass(frozen=True, slots=True)
class Model:
    """A trained logistic model and its calibration (operating points on unseen pairs)."""

    names: tuple[str, ...]
    mean: tuple[float, ...]
    scale: tuple[float, ...]
    weights: tuple[float, ...]
    bias: float
    calibration: tuple[Point, ...]
    source: str = ""
    cross_max: float = math.inf
    """Above the highest cross-encoder logit seen in training and calibration: a pair whose
    score stays below what is needed even at this logit is refused without reading it."""

    def score(self, a: Normalized, b: Normalized, cosine: float, cross_logit: float) -> float:
        """The probability the model gives that both ask the same thing; -1 for a hard
        difference."""
        found = verdicts(a, b)
        if hard_difference(a, b, found):
            return -1.0
        return self.raw_score(features(a, b, cosine, cross_logit, found))

    def raw_score(self, values: list[float]) -> float:
        z = self.bias
        for x, m, s, w in zip(values, self.mean, self.scale, self.weights, strict=True):
            z += w * (x - m) / s
        return 1.0 / (1.0 + math.exp(-max(-60.0, min(60.0, z))))

    def operating_point(self, max_false_hit_rate: float) -> Point:
        """The most permissive calibrated point within the error budget."""
        return choose(self.calibration, max_false_hit_rate)

    def to_json(self) -> str:
        return json.dumps(
            {
                "features": list(self.names),
                "mean": list(self.mean),
                "scale": list(self.scale),
                "weights": list(self.weights),
                "bias": self.bias,
                "source": self.source,
                "cross_max": self.cross_max,
                "calibration": [
                    [p.min_score, p.true_hits, p.false_hits, p.positives, p.negatives]
                    for p in self.calibration
                ],
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, text: str) -> Model:
        data = json.loads(text)
        names = tuple(data["features"])
        if names != FEATURES:
            raise ValueError("the verifier's weights were trained on other features")
        return cls(
            names,
            tuple(data["mean"]),
            tuple(data["scale"]),
            tuple(data["weights"]),
            float(data["bias"]),
            tuple(Point(float(t), *map(int, rest)) for t, *rest in data["calibration"]),
            data.get("source", ""),
            float(data.get("cross_max", math.inf)),
        )


@lru_cache(maxsize=1)
def shipped() -> Model:
    """The model that ships in the package (``gateway/data/verifier.json``)."""
    text = resources.files("gateway.data").joinpath("verifier.json").read_text("utf-8")
    return Model.from_json(text)


class LearnedVerifier:
    """Accepts a candidate at ``score >= min_score``; ``min_score`` from the route's policy
    or the error budget's operating point.  The cross-encoder (``reader``, the process's
    one by default) reads each candidate no hard difference refused."""

    def __init__(
        self,
        model: Model,
        min_score: float,
        reader: CrossReader | None = None,
        *,
        needed: float | None = None,
    ) -> None:
        self.model = model
        self.min_score = min_score
        self.needed = min_score if needed is None else min(needed, min_score)
        """The lowest score any caller uses (the judge's grey zone may start below
        ``min_score``): a pair that cannot reach it is not read."""
        from gateway.cache.embedding import cross  # numpy: only where a tier verifies

        if reader is None:
            reader = cross.shared()
        self.reader = reader
        self.window = cross.MAX_PAIR_TOKENS - cross.PAIR_MARKERS
        """The most tokens of text a pair may have to be read whole."""
        self.errors = 0

    def __call__(self, first: str, second: str, cosine: float) -> Verdict:
        return self.assess(first, second, cosine)[0]

    def too_long(self, first: str, second: str) -> bool:
        """Whether the pair certainly has more tokens than the cross-encoder reads whole:
        each word (between spaces) is at least one.  Microseconds, before the features
        (which cost milliseconds for long texts); the reader's own count decides the rest."""
        return len(first.split()) + len(second.split()) > self.window

    def unreadable(self, text: str) -> bool:
        """Whether no pair with ``text`` in it can be read whole (it leaves the other text
        not one token): the tier neither embeds nor indexes such a message."""
        return len(text.split()) >= self.window

    def assess(
        self, first: str, second: str, cosine: float, cross_logit: float | None = None
    ) -> tuple[Verdict, float]:
        """The verdict and the score it was given by (-1 for a hard difference), the
        cross-encoder run on this thread unless its ``cross_logit`` is given."""
        if self.too_long(first, second):
            return Verdict(False, TOO_LONG), -1.0
        a, b = normalize(first), normalize(second)
        found = verdicts(a, b)
        reason = hard_difference(a, b, found)
        if reason:
            return Verdict(False, reason), -1.0
        if cross_logit is None:
            cross_logit = float(self.reader.logits([(first, second)], whole=True)[0])
        if math.isnan(cross_logit):
            return Verdict(False, TOO_LONG), -1.0
        return self._decide(features(a, b, cosine, cross_logit, found))

    async def check(
        self, first: str, second: str, cosine: float, *, may_read: bool = True
    ) -> tuple[Verdict, float, bool]:
        """``assess`` for the tier: the cross-encoder runs off the event loop, and only when
        ``may_read`` (a lookup reads at most ``MAX_CROSS`` candidates; one past them is
        refused, ``UNREAD``; one too long to read whole, ``TOO_LONG``).  Also says whether the
        cross-encoder was asked."""
        if self.too_long(first, second):
            return Verdict(False, TOO_LONG), -1.0, False
        a, b = normalize(first), normalize(second)
        found = verdicts(a, b)
        reason = hard_difference(a, b, found)
        if reason:
            return Verdict(False, reason), -1.0, False
        best = self.model.raw_score(features(a, b, cosine, self.model.cross_max, found))
        if best < self.needed:  # refused whatever the cross-encoder says
            return Verdict(False, SCORE), best, False
        if not may_read:
            return Verdict(False, UNREAD), -1.0, False
        try:
            cross_logit = await self.reader.logit(first, second)
        except ImportError as exc:  # the shipped file is missing or not the pinned one
            self.errors += 1
            level = logging.WARNING if self.errors == 1 else logging.DEBUG
            log.log(level, "learned verifier: the cross-encoder failed: %s", exc)
            return Verdict(False, CROSS_ERROR), -1.0, False
        if math.isnan(cross_logit):  # asked, so it counts against MAX_CROSS
            return Verdict(False, TOO_LONG), -1.0, True
        verdict, score = self._decide(features(a, b, cosine, cross_logit, found))
        return verdict, score, True

    def _decide(self, values: list[float]) -> tuple[Verdict, float]:
        score = self.model.raw_score(values)
        return (guard.PASS if score >= self.min_score else Verdict(False, SCORE)), score

    def __repr__(self) -> str:
        return f"<LearnedVerifier min_score={self.min_score:.3f}>"


def uses_learned(semantic: Semantic) -> bool:
    """Whether a route runs the learned verifier: when its policy says so, except with a
    backend ``embedder`` and no ``min_score`` (the shipped calibration is for the local
    model's cosines; another model's need their own), where the rules run."""
    return semantic.verifier == "learned" and (
        semantic.embedder is None or semantic.min_score is not None
    )


def in_force(semantic: Semantic) -> dict[str, object]:
    """The operating point a route's ``cache.semantic`` runs at, as ``GET /policy`` shows
    it: from ``min_score`` when set (with the shipped calibration's figures there), else
    from the error budget; and the judge's settings, with the grey zone it judges."""
    if not uses_learned(semantic):
        why = "policy" if semantic.verifier == "rules" else "embedder without min_score"
        if semantic.judge.enabled:  # refused at load; shown here for a policy made in code
            return {"verifier": "rules", "why": why, "judge": {"enabled": False, "why": why}}
        return {"verifier": "rules", "why": why}
    model = shipped()
    wanted = semantic.min_score
    if wanted is not None:
        point = min(model.calibration, key=lambda p: (abs(p.min_score - wanted), p.min_score))
        chosen: dict[str, object] = {"from": "min_score", "min_score": wanted}
    else:
        point = model.operating_point(semantic.max_false_hit_rate)
        chosen = {"from": "max_false_hit_rate", "min_score": point.min_score}
    judge = semantic.judge
    return {
        "verifier": "learned",
        "max_false_hit_rate": semantic.max_false_hit_rate,
        **chosen,
        "calibration": model.source,
        "calibrated": point.as_dict(),
        "judge": {
            "enabled": True,
            "grey_zone": [judge.min_score, chosen["min_score"]],
            "rate_per_s": judge.rate_per_s,
            "burst": judge.burst,
            "max_pending": judge.max_pending,
            "timeout_ms": judge.timeout_ms,
            "model": judge.model or "the request's",
            "max_aliases": judge.max_aliases,
        }
        if judge.enabled
        else {"enabled": False},
    }


def verifier_for(semantic: Semantic) -> LearnedVerifier:
    """The learned verifier at the route's operating point (reading the pairs the judge's
    grey zone needs too)."""
    model = shipped()
    if semantic.min_score is not None:
        min_score = semantic.min_score
    else:
        min_score = model.operating_point(semantic.max_false_hit_rate).min_score
    judge = semantic.judge
    return LearnedVerifier(model, min_score, needed=judge.min_score if judge.enabled else None)
