"""The guard: rejects a near-duplicate candidate unless both messages ask the same thing.

SimHash only finds candidates; it cannot tell "flights from Paris to London" from "flights
from London to Paris" (same bag of words) or "C" from "C++" on short text.  The guard
decides, conservatively, because a wrong answer is worse than a miss.  Two messages pass
only when, after ``normalize``:

* their quoted spans and fenced code blocks are identical (case and all);
* their numbers, in order, are identical; their negation counts are equal;
* their content-token sequences have the same length and agree position by position, where
  a pair of different tokens is accepted only as a *typo*: one Damerau edit inside a
  lower-case word of at least ``TYPO_MIN_LEN`` letters, same first and last letter, not a
  protected word (negations, directions, quantifiers, number words) and not a known
  confusable pair; at most one typo per ``TYPO_EVERY`` tokens.

So no content word may be added, dropped, swapped for another or moved; the tolerated edits
are case, whitespace, punctuation, articles and fillers, contractions and small typos.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gateway.cache.normalize import NUMBER, WORD, Normalized, Token, normalize

TYPO_MIN_LEN = 7
TYPO_EVERY = 8

NEGATIONS = frozenset(
    "not no never none nobody nothing nowhere neither nor without cannot lack lacks lacking "
    "fail fails failed hardly barely rarely seldom except excluding".split()
)
DIRECTIONS = frozenset(
    "before after above below over under up down in out inside outside into onto from to "
    "toward towards away left right north south east west upper lower higher lower more less "
    "most least increase increases increased increasing decrease decreases decreased "
    "decreasing rise fall gain loss import export imports exports inbound outbound upload "
    "download minimum maximum min max first last earlier later older newer bigger smaller "
    "larger greater fewer best worst buy sell push pull open close start end begin finish "
    "forward backward ascending descending encrypt decrypt encode decode compress decompress "
    "enable disable add remove include exclude".split()
)
PROTECTED = NEGATIONS | DIRECTIONS
CONFUSABLES = frozenset(
    frozenset(p.split("/"))
    for p in (
        "affect/effect affects/effects complement/compliment complements/compliments "
        "stationary/stationery capital/capitol principal/principle discreet/discrete "
        "marital/martial casual/causal desert/dessert deserts/desserts county/country "
        "prescribe/proscribe counsel/council persecute/prosecute precede/proceed "
        "adapter/adaptor elicit/illicit eminent/imminent immigrate/emigrate "
        "conscience/conscious conversation/conservation statue/statute united/untied "
        "lightning/lightening bazaar/bizarre carrot/carat cereal/serial sensor/censor "
        "accept/except advice/advise device/devise loose/lose quiet/quite "
        "access/excess ensure/insure assure/ensure choose/chose breath/breathe "
        "cloth/clothe dairy/diary angel/angle trial/trail formally/formerly "
        "personal/personnel morale/moral later/latter allusion/illusion "
        "alternate/alternative comprise/compose continual/continuous "
        "economic/economical historic/historical classic/classical electric/electrical "
        "ingenious/ingenuous precedent/president uninterested/disinterested "
        "compliment/complement averse/adverse allude/elude vein/vain waive/wave"
    ).split()
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The guard's decision; ``reason`` names the first difference found ("" when ok)."""

    ok: bool
    reason: str = ""


PASS = Verdict(True)


def check(first: str | Normalized, second: str | Normalized) -> Verdict:
    """Whether a cached answer to ``first`` may answer ``second``."""
    a = normalize(first) if isinstance(first, str) else first
    b = normalize(second) if isinstance(second, str) else second
    if a.quoted != b.quoted:
        return Verdict(False, "quoted")
    if a.code != b.code:
        return Verdict(False, "code")
    if _numbers(a) != _numbers(b):
        return Verdict(False, "numbers")
    if _negations(a) != _negations(b):
        return Verdict(False, "negation")
    return _sequence(a.tokens, b.tokens)


def signature(text: str | Normalized) -> str:
    """What ``check`` requires two messages to share, as a string: their numbers, quoted
    spans, code blocks and negation count.  Messages the guard accepts as the same question
    always have equal signatures, so the near-duplicate index may be partitioned by it."""
    norm = normalize(text) if isinstance(text, str) else text
    parts = (_numbers(norm), norm.quoted, norm.code, _negations(norm))
    return "\x1f".join("\x1e".join(p) if isinstance(p, tuple) else str(p) for p in parts)


def _numbers(norm: Normalized) -> tuple[str, ...]:
    return tuple([t.text for t in norm.tokens if t.kind == NUMBER])


def _negations(norm: Normalized) -> int:
    return len([t for t in norm.tokens if t.text in NEGATIONS])


def _sequence(a: tuple[Token, ...], b: tuple[Token, ...]) -> Verdict:
    if len(a) != len(b):
        return Verdict(False, "order" if _bag(a) == _bag(b) else "content")
    typos = 0
    for x, y in zip(a, b, strict=True):
        if x.text == y.text:
            continue
        if not _is_typo(x, y):
            if _bag(a) == _bag(b):
                return Verdict(False, "order")
            if x.text in DIRECTIONS or y.text in DIRECTIONS:
                return Verdict(False, "direction")
            return Verdict(False, "entity" if x.cased or y.cased else "content")
        typos += 1
    if typos > max(1, len(a) // TYPO_EVERY):
        return Verdict(False, "typos")
    return PASS


def _bag(tokens: tuple[Token, ...]) -> Counter[str]:
    return Counter(t.text for t in tokens)


def typo_key(token: Token) -> str:
    """The token's text, or for a word the guard lets carry a typo, the class of words it
    could be a typo of (first and last letter).  Tokens the guard accepts as equal always
    have equal keys, so the SimHash of the keys puts them in the same buckets."""
    s = token.text
    if token.kind == WORD and len(s) >= TYPO_MIN_LEN and s.isalpha() and s not in PROTECTED:
        return f"{s[0]}~{s[-1]}"  # case-blind on purpose: a case edit must not move it
    return s


def _typo_eligible(token: Token) -> bool:
    return not token.cased and typo_key(token) != token.text


def _is_typo(x: Token, y: Token) -> bool:
    s, t = x.text, y.text
    return (
        _typo_eligible(x)
        and _typo_eligible(y)
        and s[0] == t[0]
        and s[-1] == t[-1]
        and frozenset((s, t)) not in CONFUSABLES
        and _one_edit(s, t)
    )


def _one_edit(s: str, t: str) -> bool:
    """True when ``s`` and ``t`` differ by exactly one insertion, deletion, substitution or
    transposition of adjacent letters."""
    if abs(len(s) - len(t)) > 1:
        return False
    i = 0
    while i < min(len(s), len(t)) and s[i] == t[i]:
        i += 1
    if len(s) == len(t):
        if s[i + 1 :] == t[i + 1 :]:
            return True
        return s[i : i + 2] == t[i : i + 2][::-1] and s[i + 2 :] == t[i + 2 :]
    longer, shorter = (s, t) if len(s) > len(t) else (t, s)
    return longer[i + 1 :] == shorter[i:]
