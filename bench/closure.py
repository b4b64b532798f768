"""The pairs a labelled set implies: its transitive closure (``train_cross_encoder --closure``).

Two questions labelled duplicates of a third ask the same question, so they are duplicates
of each other; a question labelled different from one of a group of duplicates differs
from all of them.  Quora's labels name a tree of pairs in each group (23,086 duplicates in
``qqp_train.tsv`` join 120,410 questions into groups of up to 58); the closure holds tens
of thousands more.  A large group would give most of them (58 questions, 1,653 pairs), so
each group gives at most as many implied duplicates as it has questions, drawn with a
fixed seed.  A group that a pair labelled different falls inside (the labels contradict
each other: 5 in ``qqp_train.tsv``) implies nothing.  Every implied pair is new: no pair
the labels name, either way, is given again.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence

from gateway.cache.evaluate import Pair

SEED = 2026


class Groups:
    """Questions joined into groups by the pairs that name them (union-find)."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        """The question naming ``x``'s group."""
        parent = self._parent
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def join(self, a: str, b: str) -> None:
        """One group of ``a``'s and ``b``'s (named by ``b``'s)."""
        self._parent[self.find(a)] = self.find(b)

    def questions(self) -> list[str]:
        """Every question seen, sorted."""
        return sorted(self._parent)


def implied(pairs: Sequence[Pair], seed: int = SEED) -> list[Pair]:
    """The duplicates and differences ``pairs`` imply and do not name, in a fixed order."""
    joined = Groups()
    find = joined.find
    for p in pairs:
        find(p.first), find(p.second)
        if p.label:
            joined.join(p.first, p.second)
    groups: dict[str, list[str]] = defaultdict(list)
    for question in joined.questions():
        groups[find(question)].append(question)
    named = {frozenset((p.first, p.second)) for p in pairs}
    broken = {find(p.first) for p in pairs if not p.label and find(p.first) == find(p.second)}
    rng = random.Random(seed)
    out: list[Pair] = []
    for root in sorted(groups):
        members = groups[root]
        if len(members) < 3 or root in broken:
            continue
        fresh = [
            (a, b)
            for i, a in enumerate(members)
            for b in members[i + 1 :]
            if frozenset((a, b)) not in named
        ]
        out += [Pair(1, a, b) for a, b in rng.sample(fresh, min(len(fresh), len(members)))]
    differ: set[tuple[str, str]] = set()
    for p in pairs:
        first, second = find(p.first), find(p.second)
        if p.label or first == second or first in broken or second in broken:
            continue
        for a in groups[first]:
            for b in groups[second]:
                if frozenset((a, b)) not in named:
                    differ.add((a, b) if a < b else (b, a))
    out += [Pair(0, a, b) for a, b in sorted(differ)]
    return out
