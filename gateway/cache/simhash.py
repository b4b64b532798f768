"""64-bit SimHash fingerprints of normalised messages, and the band split used to index them.

Features are the content tokens and each adjacent pair of them (so word order counts a
little, although the guard is what rejects reorderings), where each token is first replaced
by its ``guard.typo_key``: a word the guard would accept with a typo is reduced to its first
and last letter, so a typo moves no feature at all.  Filler, case and punctuation edits never
reach the features either (see ``normalize``): every pair the guard accepts has equal
fingerprints, and SimHash distance only widens the candidates.
Feature hashes are blake2b, stable across processes and replicas (Python's ``hash`` is
salted per process), and memoised.

A fingerprint is split into ``BANDS`` bands of ``BAND_BITS`` bits: two fingerprints within
Hamming distance ``BANDS - 1`` agree exactly on at least one band (pigeonhole), so a lookup
reads four buckets instead of scanning.
"""

from __future__ import annotations

import hashlib
import itertools
from functools import lru_cache

import numpy as np

from .guard import typo_key
from .normalize import Normalized, normalize

BITS = 64
BANDS = 4
BAND_BITS = BITS // BANDS
MAX_DISTANCE = BANDS - 1
"""The largest Hamming distance the banded index can find without a scan."""

_MASK = (1 << BAND_BITS) - 1


@lru_cache(maxsize=1 << 16)
def _feature_hash(feature: str) -> int:
    return int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "big")


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
    # Big-endian bytes unpacked give each hash's bits most significant first; the majority
    # bits packed back, read big-endian, are the fingerprint.
    hashes = np.array([_feature_hash(f) for f in feats], dtype=">u8")
    bits = np.unpackbits(hashes.view(np.uint8)).reshape(len(feats), BITS)
    ones = bits.sum(axis=0, dtype=np.int32)
    return int.from_bytes(np.packbits(ones * 2 > len(feats)).tobytes(), "big")


def hamming(a: int, b: int) -> int:
    """Number of differing bits between two fingerprints."""
    return (a ^ b).bit_count()


def bands(fp: int) -> tuple[int, ...]:
    """The ``BANDS`` band values of a fingerprint, most significant first."""
    return tuple((fp >> (BITS - BAND_BITS * (i + 1))) & _MASK for i in range(BANDS))
