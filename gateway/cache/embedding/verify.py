"""The embedding tier's verification: the guard, or the same checks over reworded frames.

Cosine similarity finds paraphrases but cannot see the small edits that change an answer
(a number, a negation, an entity, a direction, who does what to whom).  So every embedding
candidate must pass ``verify``: either the near-duplicate guard itself (``guard.check``),
or ``relaxed``, which runs the guard's checks after a wider normalisation:

* question frames that ask the same thing are one frame: "how do I", "how can I", "how
  should I", "how to", "what is the best way to", "what are some ways to", "what should I
  do to" all become ``how-to`` ("how do/can you" is a frame of its own: it may ask the
  assistant itself); "can I" is "is it possible to"; "which" is "what";
* auxiliaries keep only their tense ("do"/"does", "is"/"are"/"am"), so "how does a fridge
  work" matches "how do fridges work" but "who is" never matches "who was";
* content words are compared by a light stem (plural, -ing, -ly, silent e);
* a few hedges that never change the question ("really", "exactly", "some") are dropped;
* "is the best" may move ("which laptop is the best" = "what is the best laptop"), and a
  possessive may be missing on one side ("clean my screen" = "clean the screen") but never
  differ ("my" is not "your").

Everything else must be equal, in the same order: quoted spans, code, numbers, symbols,
negations, directions, pronouns, modals outside a frame, and every content word.  So a
hit may reword how a question is asked, never what it asks about.
"""

from __future__ import annotations

from bisect import bisect_left

from gateway.cache import guard
from gateway.cache.guard import NEGATIONS, Verdict
from gateway.cache.normalize import NUMBER, WORD, Normalized, normalize

HOW_TO = "\x00how-to"
HOW_TO_YOU = "\x00how-to-you"
"""A frame asked of "you" is its own: "how do you feel" asks the assistant, not the user."""
CAN_I = "\x00can-i"
MOVABLE = frozenset("be best good better worst bad worse great greatest".split())
"""Words whose position may change ("which laptop is the best" = "what is the best
laptop"): they must still be present on both sides, and everything else keeps its order."""
POSSESSIVES = frozenset("my your our".split())
"""May be missing on one side ("clean my screen" = "clean the screen") but never differ."""

_AUX = {
    "do": "do",
    "does": "do",
    "is": "be",
    "are": "be",
    "am": "be",
    "has": "have",
    "have": "have",
}
"""Present-tense auxiliaries that agree with their subject: one form each."""

_HEDGES = frozenset("really exactly just truly very some any so".split())
_FRAME_SUBJECTS = frozenset("i we you one someone somebody".split())
_FRAME_MODALS = frozenset("do does can could should would will may might must".split())
_FRAME_GOOD = frozenset("best good right proper correct effective".split())
_FRAME_NOUNS = frozenset("way ways method methods".split())


def verify(first: str | Normalized, second: str | Normalized) -> Verdict:
    """Whether a cached answer to ``first`` may answer ``second`` on an embedding match."""
    a = normalize(first) if isinstance(first, str) else first
    b = normalize(second) if isinstance(second, str) else second
    strict = guard.check(a, b)
    if strict.ok:
        return strict
    return relaxed(a, b)


def relaxed(a: Normalized, b: Normalized) -> Verdict:
    """The guard's checks over canonical frames, tense-only auxiliaries and stems."""
    if a.quoted != b.quoted:
        return Verdict(False, "quoted")
    if a.code != b.code:
        return Verdict(False, "code")
    if _numbers(a) != _numbers(b):
        return Verdict(False, "numbers")
    if _negations(a) != _negations(b):
        return Verdict(False, "negation")
    x, y = canonical(a), canonical(b)
    if x == y:
        return guard.PASS
    px, py = _possessives(x), _possessives(y)
    if px != py and px and py:
        return Verdict(False, "pronoun")
    x, y = _without(x, POSSESSIVES), _without(y, POSSESSIVES)
    if x == y:
        return guard.PASS
    if sorted(x) != sorted(y):
        diff = set(x).symmetric_difference(y)
        return Verdict(False, "direction" if diff & guard.DIRECTIONS else "content")
    if _without(x, MOVABLE) == _without(y, MOVABLE):
        return guard.PASS
    return Verdict(False, "order")


SWAP_WORDS = 2
"""Content words both sides share that may be out of order before a pair is ``swapped``."""
_FUNCTION_WORDS = frozenset(
    "a an the of to in on for and or is are be by with from at as it its this that".split()
)


def swapped(a: Normalized, b: Normalized) -> bool:
    """Whether the words both sides share come in another order: two or more shared
    content words out of place ("trained by Velazquez, ridden by Romans" against "trained by
    Romans, ridden by Velazquez", with other words changed too), or any two shared names
    (words capitalised mid-sentence) swapped.  Who does what to whom changes the answer;
    the rules refuse the same words reordered, this refuses it with other edits around."""
    x = [w for w in canonical(a) if w not in _FUNCTION_WORDS and not w.startswith("\x00")]
    y = [w for w in canonical(b) if w not in _FUNCTION_WORDS and not w.startswith("\x00")]
    if _out_of_order(x, y) >= SWAP_WORDS:
        return True
    names_a = [t.text for t in a.tokens if t.cased]
    names_b = [t.text for t in b.tokens if t.cased]
    return _out_of_order(names_a, names_b) >= 1


NEGATING_PREFIXES = ("un", "in", "im", "il", "ir", "non")
"""Not "dis": play/display, count/discount, ease/disease; its opposites are listed."""
OPPOSITE_MIN_LEN = 4
"""The shortest word whose prefixed form counts as its opposite ("safe"/"unsafe")."""
_PAIRS = (
    "true/false right/wrong buy/sell win/lose won/lost pass/fail accept/reject "
    "allow/forbid allowed/forbidden safe/dangerous good/bad better/worse cheap/expensive "
    "like/dislike likes/dislikes agree/disagree honest/dishonest connect/disconnect "
    "advantage/disadvantage advantages/disadvantages approve/disapprove appear/disappear "
    "more/less most/least increase/decrease higher/lower bigger/smaller before/after "
    "best/worst import/export upload/download encrypt/decrypt enable/disable add/remove "
    "include/exclude open/close start/stop"
).split()
OPPOSITES: dict[str, tuple[str, ...]] = {}
"""Each listed word's opposites, both ways."""
for _first, _second in (pair.split("/") for pair in _PAIRS):
    OPPOSITES[_first] = (*OPPOSITES.get(_first, ()), _second)
    OPPOSITES[_second] = (*OPPOSITES.get(_second, ()), _first)


def opposite(a: Normalized, b: Normalized) -> bool:
    """Whether a word only one side has is the opposite of a word only the other has: a
    word against its negated form ("legal"/"illegal", "safe"/"unsafe", "possible"/
    "impossible") or a pair of opposites ("true"/"false", "buy"/"sell", "more"/"less").
    The answer to "Is it legal to record a call?" says the opposite of what "Is it illegal
    ..." asks, and the embedding puts the two side by side (cosine 0.97).  Linear in the
    words: each word's few possible opposites are looked up on the other side."""
    x = {t.text for t in a.tokens if t.kind == WORD}
    y = {t.text for t in b.tokens if t.kind == WORD}
    only_x, only_y = x - y, y - x
    return any(not only_y.isdisjoint(_opposites_of(w)) for w in only_x)


def _opposites_of(word: str) -> list[str]:
    found = list(OPPOSITES.get(word, ()))
    if len(word) >= OPPOSITE_MIN_LEN:
        found += [p + word for p in NEGATING_PREFIXES]
    found += [
        word[len(p) :]
        for p in NEGATING_PREFIXES
        if word.startswith(p) and len(word) - len(p) >= OPPOSITE_MIN_LEN
    ]
    return found


def _out_of_order(x: list[str], y: list[str]) -> int:
    """How many of the words both lists share (first occurrences) are out of order: their
    number less the longest run in the same order (an increasing subsequence, n log n)."""
    shared = set(x) & set(y)
    if len(shared) < 2:
        return 0
    where = {w: i for i, w in reversed(list(enumerate(y)))}
    seen: set[str] = set()
    tails: list[int] = []
    for w in x:
        if w in shared and w not in seen:
            seen.add(w)
            k = bisect_left(tails, where[w])
            tails[k : k + 1] = [where[w]]
    return len(shared) - len(tails)


def canonical(norm: Normalized) -> tuple[str, ...]:
    """The message as the relaxed check compares it: frame, tense and stems."""
    words = [t.text for t in norm.tokens]
    out: list[str] = []
    frame, i = _frame(words)
    if frame:
        out.append(frame)
    tokens = norm.tokens
    for k in range(i, len(tokens)):
        token = tokens[k]
        text = token.text
        if token.kind != WORD:
            out.append(text)
        elif text in _HEDGES:
            continue
        elif text in _AUX:
            out.append(_AUX[text])
        elif text == "which":
            out.append("what")
        elif text == "for" and k + 1 < len(tokens) and tokens[k + 1].text.endswith("ing"):
            out.append("to")  # "a book for learning C" = "a book to learn C"
        elif text in guard.PROTECTED:
            out.append(text)
        else:
            out.append(stem(text))
    return tuple(out)


def _frame(words: list[str]) -> tuple[str, int]:
    """The canonical frame the message opens with and its length in words, or ("", 0)."""
    n = _how_to(words)
    if n:
        return (HOW_TO_YOU if "you" in words[:n] else HOW_TO), n
    n = _can_i(words)
    if n:
        return CAN_I, n
    return "", 0


def _can_i(words: list[str]) -> int:
    if len(words) >= 2 and words[0] in ("can", "could") and words[1] in ("i", "one", "we"):
        return 2
    if words[:4] == ["is", "it", "possible", "to"]:
        return 4
    if words[:6] == ["is", "it", "possible", "for", "me", "to"]:
        return 6
    return 0


def _how_to(words: list[str]) -> int:
    n = len(words)
    if n >= 3 and words[0] == "how" and words[1] in _FRAME_MODALS:
        if words[2] in _FRAME_SUBJECTS:
            return 3
    if n >= 2 and words[0] == "how" and words[1] == "to":
        return 2
    if n >= 1 and words[0] in ("what", "which") and n >= 2 and words[1] in ("is", "are"):
        j = 2
        while j < n and (words[j] in _FRAME_GOOD or words[j] in _HEDGES):
            j += 1
        if j < n and words[j] in _FRAME_NOUNS and j + 1 < n and words[j + 1] == "to":
            return j + 2
    if (
        n >= 5
        and words[0] == "what"
        and words[1] in _FRAME_MODALS
        and words[2] in _FRAME_SUBJECTS
        and words[3] == "do"
        and words[4] == "to"
    ):
        return 5
    if n >= 4 and words[:2] == ["is", "there"]:
        j = 2
        while j < n and words[j] in _HEDGES:
            j += 1
        if j + 1 < n and words[j] == "way" and words[j + 1] == "to":
            return j + 2
    return 0


def _possessives(words: tuple[str, ...]) -> list[str]:
    return sorted(w for w in words if w in POSSESSIVES)


def _without(words: tuple[str, ...], drop: frozenset[str]) -> tuple[str, ...]:
    return tuple(w for w in words if w not in drop)


def stem(word: str) -> str:
    """A light Porter-style stem: plural, -ing, -ly and a silent final e.

    "typing" = "type", "increasing" = "increase", "studies" = "study", but "plan" is not
    "plane" nor "car" "care" (a final e after one consonant-vowel-consonant stays), "news"
    is not "new", "only" not "on", "bully" not "bull".
    """
    if len(word) <= 3 or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        word = word[:-3] + "y"
    elif word.endswith(("sses", "shes", "ches", "xes")):
        word = word[:-2]
    elif word.endswith("s") and not word.endswith(_KEEP_S):
        word = word[:-1]
    if word.endswith("ly"):
        rest = word[:-2]
        if len(rest) >= 4 and rest[-1] != rest[-2]:
            word = rest  # "quickly" = "quick"
    elif word.endswith("ing") and _has_vowel(word[:-3]) and len(word) >= 5:
        word = word[:-3]
        if word[-1] == word[-2] and word[-1] not in "lsz":
            word = word[:-1]  # "swimming" = "swim"
        elif (len(word) == 2 and _vowel(word, 0) and not _vowel(word, 1)) or (
            _measure(word) == 1 and _cvc(word)
        ):
            word += "e"  # "typ(ing)" = "type", "mak(ing)" = "make", "us(ing)" = "use"
    if word.endswith("e") and len(word) > 3:
        rest = word[:-1]
        m = _measure(rest)
        if m > 1 or (m == 1 and not _cvc(rest)):
            word = rest  # "increase" = "increas(ing)"; "plane" keeps its e
    return word


_KEEP_S = ("ss", "us", "is", "os", "ics", "news", "series", "species")


def _vowel(word: str, i: int) -> bool:
    c = word[i]
    return c in "aeiou" or (c == "y" and i > 0 and not _vowel(word, i - 1))


def _has_vowel(word: str) -> bool:
    return any(_vowel(word, i) for i in range(len(word)))


def _measure(word: str) -> int:
    """Porter's m: the number of vowel-consonant sequences."""
    form = "".join("v" if _vowel(word, i) else "c" for i in range(len(word)))
    return form.count("vc") if "vc" in form else 0


def _cvc(word: str) -> bool:
    """Consonant-vowel-consonant at the end, the last not w, x or y (Porter's *o)."""
    return (
        len(word) >= 3
        and not _vowel(word, -3 + len(word))
        and _vowel(word, -2 + len(word))
        and not _vowel(word, len(word) - 1)
        and word[-1] not in "wxy"
    )


def _numbers(norm: Normalized) -> tuple[str, ...]:
    return tuple(t.text for t in norm.tokens if t.kind == NUMBER)


def _negations(norm: Normalized) -> int:
    return sum(1 for t in norm.tokens if t.text in NEGATIONS)
