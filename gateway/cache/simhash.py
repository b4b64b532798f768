"""64-bit SimHash fingerprints of normalised messages, and the band split used to index them.

Features are the content tokens and each adjacent pair of them (so word order counts a
little, although the guard is what rejects reorderings), where each token is first replaced
by its ``guard.typo_key``: a word the guard would accept with a typo is reduced to its first
and last letter, so a typo moves no feature at all.  Filler, case and punctuation edits never
reach the features either (see ``normalize``): every pair the guard accepts has equal
fingerprints, and SimHash distance only widens the candidates.
Feature hashes are blake2b, stable across processes and replicas (Python's ``hash`` is
salted per process).  A fingerprint's bit is set where most features' hashes have it set:
each feature's set bit positions are memoised (the vocabulary of prompts repeats) and one
``numpy.bincount`` over all of them tallies the votes, a handful of array calls whatever
the number of features.

A fingerprint is split into ``BANDS`` bands of ``BAND_BITS`` bits: two fingerprints within
Hamming distance ``BANDS - 1`` agree exactly on at least one band (pigeonhole), so a lookup
reads four buckets instead of scanning.
"""

from __future__ import annotations

import hashlib
import itertools
from functools import lru_cache

from gateway.cache.guard import typo_key
from gateway.cache.normalize import Normalized, normalize

BITS = 64
BANDS = 4
BAND_BITS = BITS // BANDS
MAX_DISTANCE = BANDS - 1
"""The largest Hamming distance the banded index can find without a scan."""

_MASK = (1 << BAND_BITS) - 1
_BAND_SHIFTS = tuple(range(BITS - BAND_BITS, -1, -BAND_BITS))  # most significant band first


@lru_cache(maxsize=1 << 16)
def _feature_bits(feature: str) -> bytes:
    """The positions of the set bits of ``feature``'s 64-bit hash, one byte each, counted
    from the least significant bit."""
    digest = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "big")
    return bytes(i for i in range(BITS) if digest >> i & 1)


def features(norm: Normalized) -> list[str]:
    """The features of a normalised message: its token keys and adjacent pairs of them."""
    words = [typo_key(t) for t in norm.tokens]
    return words + [f"{a} {b}" for a, b in itertools.pairwise(words)]


def fingerprint(text: str | Normalized) -> int:
    """The 64-bit SimHash of ``text`` (a raw message or its normalised form)."""
    norm = normalize(text) if isinstance(text, str) else text
    feats = features(norm)
    if not feats:
        return 0
    import numpy as np  # here: a gateway without a caching route never loads it

    votes = np.frombuffer(b"".join(map(_feature_bits, feats)), dtype=np.uint8)
    ones = np.bincount(votes, minlength=BITS)
    # ones[i] features have bit i set; the fingerprint's bit i is set on a strict majority
    # (ones * 2 > n, which is ones > n // 2), packed least significant bit first.
    majority = np.packbits(ones > len(feats) // 2, bitorder="little")
    return int.from_bytes(majority.tobytes(), "little")


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two fingerprints."""
    return (a ^ b).bit_count()


def bands(fp: int) -> tuple[int, ...]:
    """The ``BANDS`` band values of a fingerprint, most significant first."""
    return tuple([(fp >> shift) & _MASK for shift in _BAND_SHIFTS])
