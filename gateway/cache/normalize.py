"""Normalisation of a user message for the near-duplicate tier: tokens, quoted spans, code.

What a near-duplicate may differ in is decided here: case, whitespace, most punctuation,
articles and politeness fillers, and contractions (``what's`` = ``what is``, ``dont`` =
``do not``).  Everything that can change an answer is kept as a token: digits (``3`` is not
``4``), symbols (``C++`` is not ``C``, ``-5`` is not ``5``), negations, prepositions,
pronouns, modals and tense.  Quoted spans and fenced code blocks are also kept verbatim so
the guard can require them to be identical.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

WORD, NUMBER, SYMBOL = "word", "number", "symbol"

FILLERS = frozenset("a an the please pls plz kindly actually basically".split())
"""Tokens whose presence never changes what is asked; dropped wherever they stand."""

EDGE_FILLERS = frozenset("hey hi hello thanks thx ty um uh uhm umm hmm er ok okay oh so".split())
"""Greetings and interjections; dropped only at the start or end of a message, where they
cannot be the subject of the question ("how do you say hello" keeps its "hello")."""

_FILLER_PHRASES = re.compile(r"\b(?:thank you(?: (?:so|very) much)?|thanks a lot)\b", re.I)

_NUMBER_WORDS = {
    w: str(i)
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen "
        "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
_NUMBER_WORDS.update(
    {
        w: str(10 * i)
        for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)
    }
)
_NUMBER_WORDS.update({"hundred": "100", "thousand": "1000", "million": "1000000"})
_NUMBER_WORDS["billion"] = "1000000000"
_ORDINALS = {
    w: (str(i), s)
    for i, (w, s) in enumerate(
        [
            ("first", "st"),
            ("second", "nd"),
            ("third", "rd"),
            ("fourth", "th"),
            ("fifth", "th"),
            ("sixth", "th"),
            ("seventh", "th"),
            ("eighth", "th"),
            ("ninth", "th"),
            ("tenth", "th"),
        ],
        1,
    )
}

_CONTRACTIONS = {
    "can't": "can not",
    "cannot": "can not",
    "won't": "will not",
    "shan't": "shall not",
    "ain't": "is not",
    "let's": "let us",
}
# Apostrophe-less spellings that are not also ordinary words.
_BARE = {
    "dont": "do not",
    "doesnt": "does not",
    "didnt": "did not",
    "isnt": "is not",
    "arent": "are not",
    "wasnt": "was not",
    "werent": "were not",
    "couldnt": "could not",
    "wouldnt": "would not",
    "shouldnt": "should not",
    "hasnt": "has not",
    "havent": "have not",
    "hadnt": "had not",
    "mustnt": "must not",
    "neednt": "need not",
    "im": "i am",
    "ive": "i have",
    "youre": "you are",
    "whats": "what is",
    "thats": "that is",
    "theres": "there is",
    "hows": "how is",
    "wheres": "where is",
}
_IS_BEFORE_S = frozenset("what that it there here who where how when why he she this".split())
_SUFFIXES = {"n't": "not", "'re": "are", "'m": "am", "'ve": "have", "'ll": "will", "'d": "would"}

_FENCE = re.compile(r"```.*?```", re.S)
_QUOTE = re.compile(
    r"\"([^\"]+)\"|“([^”]+)”|«([^»]+)»|`([^`]+)`|(?:(?<=^)|(?<=[\s(\[]))'([^']+)'(?=[\s.,;:!?)\]]|$)"
)
_HYPHEN = re.compile(r"(?<=[^\W\d_])-(?=[^\W\d_])")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
# Words first, as most tokens are: the alternatives start with disjoint characters, so their
# order changes no match.
_TOKEN = re.compile(
    r"(?P<word>[^\W\d_]+(?:'[^\W\d_]+)*[+#]*)"
    r"|(?P<num>\d+(?:[.:]\d+)*)"
    "|(?P<sym>[^\\w\\s.,!?;:\"'()\\[\\]{}`\u2026\u2013\u2014\u201c\u201d\u2018\u2019\u00ab\u00bb])"
)
_KEEP_APOSTROPHE = re.compile("[\u2018\u2019]")
_QUOTE_CHARS = frozenset("\"'`\u201c\u00ab")
_SENTENCE_ENDS = frozenset(".!?:\n")
_SPECIAL = (
    frozenset(_CONTRACTIONS) | frozenset(_BARE) | frozenset(_NUMBER_WORDS) | frozenset(_ORDINALS)
)

FORM_VERSION = "n1"
"""Prefix of every ``comparable_form``.  Bump it whenever ``normalize`` changes its output
for any text: forms stored by an older version then never equal a current one, and the guard
falls back to normalising the stored prompt again."""

_FORM_CODES = {
    (kind, cased): code.upper() if cased else code
    for kind, code in ((WORD, "w"), (NUMBER, "n"), (SYMBOL, "s"))
    for cased in (False, True)
}


_tuple_new = tuple.__new__


class Token(NamedTuple):
    """One comparable unit: ``text`` is lower-cased; ``cased`` marks a capital mid-sentence.

    A NamedTuple rather than a frozen dataclass: one is built per word on the lookup path,
    and tuple construction is several times cheaper.
    """

    text: str
    kind: str
    cased: bool = False


@dataclass(frozen=True, slots=True)
class Normalized:
    """A message reduced to what the near-duplicate tier compares."""

    tokens: tuple[Token, ...]
    quoted: tuple[str, ...]
    code: tuple[str, ...]

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(t.text for t in self.tokens)


SHORT_TEXT = 512
"""Texts up to this many characters are remembered by the thousand (``normalize``)."""


def normalize(text: str) -> Normalized:
    """Reduce ``text`` to its comparable tokens, quoted spans and fenced code blocks.

    Remembered: a request's message is normalised for its keys, its tiers and its
    verification, and a cached one for every lookup it is a candidate of.  A result costs
    about 140 bytes a word, so the 4,096 remembered are texts of at most ``SHORT_TEXT``
    characters (about 30 MB at most), and only the last 64 longer ones (12 MB at most for
    the near-duplicate tiers' longest, ``keys.MAX_NEAR_CHARS``): one cache for both had let
    a client's distinct 8 KB messages hold 760 MB.
    """
    return (_remembered if len(text) <= SHORT_TEXT else _remembered_long)(text)


def _normalize(text: str) -> Normalized:
    if not text.isascii():
        text = _KEEP_APOSTROPHE.sub("'", unicodedata.normalize("NFKC", text))
    code: tuple[str, ...] = ()
    quoted: tuple[str, ...] = ()
    if not _QUOTE_CHARS.isdisjoint(text):
        code = tuple(m.group(0) for m in _FENCE.finditer(text))
        quoted = tuple(
            " ".join(next(g for g in m.groups() if g is not None).split())
            for m in _QUOTE.finditer(_FENCE.sub(" ", text) if code else text)
        )
    if "hank" in text:
        text = _FILLER_PHRASES.sub(" ", text)
    if "-" in text:
        text = _HYPHEN.sub(" ", text)
    if "," in text:
        text = _THOUSANDS.sub("", text)
    # The lookup path runs this loop once per word.  ``split`` returns, in one call, each
    # token's groups after the text before it: [gap, word, num, sym, gap, word, ...], a
    # group None where it did not match, and last the text after the last token, which
    # zip leaves over.  Most gaps are one space, which skips the sentence check; tokens
    # are built with tuple.__new__ (NamedTuple's own __new__ is Python).
    tokens: list[Token] = []
    append = tokens.append
    sentence_start = True
    parts = iter(_TOKEN.split(text))
    for gap, raw, number, symbol in zip(parts, parts, parts, parts, strict=False):
        if gap != " " and not _SENTENCE_ENDS.isdisjoint(gap):
            sentence_start = True
        if raw is not None:
            word = raw.lower()
            cased = not sentence_start and word != raw
            if "'" in word or word in _SPECIAL:
                tokens.extend(_word_tokens(word, cased))
            else:
                append(_tuple_new(Token, (word, WORD, cased)))
        elif number is not None:
            append(_tuple_new(Token, (number, NUMBER, False)))
        else:
            append(_tuple_new(Token, (symbol, SYMBOL, False)))
        sentence_start = False
    start, end = 0, len(tokens)
    while start < end and tokens[start].text in EDGE_FILLERS:
        start += 1
    while end > start and tokens[end - 1].text in EDGE_FILLERS:
        end -= 1
    kept = tuple([t for t in tokens[start:end] if t.text not in FILLERS])
    return Normalized(kept, quoted, code)


_remembered = lru_cache(maxsize=4096)(_normalize)
_remembered_long = lru_cache(maxsize=64)(_normalize)


def comparable_form(norm: Normalized) -> str:
    """``norm`` as one string, equal for two messages exactly when their normalised forms
    are equal (every token's text, kind and case flag, every quoted span and code block).

    Each item is written as its length, a one-letter code and its text, so no text can
    forge a boundary.  A stored entry keeps its prompt's form so that a near-duplicate lookup
    whose query has the same form needs no second ``normalize``.
    """
    parts = [FORM_VERSION]
    append = parts.append
    for text, kind, cased in norm.tokens:
        append(f"{len(text)}{_FORM_CODES[kind, cased]}{text}")
    for span in norm.quoted:
        append(f"{len(span)}q{span}")
    for block in norm.code:
        append(f"{len(block)}c{block}")
    return "".join(parts)


def _word_tokens(word: str, cased: bool) -> list[Token]:
    if word in _CONTRACTIONS:
        return [Token(w, WORD) for w in _CONTRACTIONS[word].split()]
    if word in _BARE:
        return [Token(w, WORD) for w in _BARE[word].split()]
    if word in _NUMBER_WORDS:
        return [Token(_NUMBER_WORDS[word], NUMBER)]
    if word in _ORDINALS:
        number, suffix = _ORDINALS[word]
        return [Token(number, NUMBER), Token(suffix, WORD)]
    for suffix, expansion in _SUFFIXES.items():
        if word.endswith(suffix) and len(word) > len(suffix):
            return [Token(word[: -len(suffix)], WORD, cased), Token(expansion, WORD)]
    if word.endswith("'s") and len(word) > 2:
        stem = word[:-2]
        tail = "is" if stem in _IS_BEFORE_S else "'s"
        return [Token(stem, WORD, cased), Token(tail, WORD)]
    return [Token(word, WORD, cased)]
