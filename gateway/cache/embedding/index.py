"""``VectorIndex``: the unit vectors of one exact context, and the nearest ones to a query.

Each entry keeps its vector as float16 (2 bytes a dimension) and a binary code of its
signs (1 bit a dimension, in 64-bit words stored column-major so numpy streams each word
of every entry through once).  A search measures the Hamming distance from the query's
code on the first word of every entry (XOR and popcount), keeps those within a bound
derived from the threshold, adds the other words' distances for those only, keeps the
entries within the bound for the whole code, at most ``PREFILTER_ROWS`` of them, nearest
first, and only for those computes the exact cosine.  For two unit vectors at angle ``a``
a random sign bit differs with probability ``a / pi``; a bound allows ``BOUND_SLACK`` times
that plus ``BOUND_MARGIN`` bits.  Measured on the 8k pairs of 17k MiniLM texts in
PAWS and ``gateway/data``: every pair with cosine >= 0.8 is within 89 of 384 bits (bound
134) and 25 of the first 64 (bound 29); at 0.9, 69 of 384 (bound 97) and 19 of 64 (bound
23), while only 3% of unrelated pairs pass the first word's bound.  So the bounds cost no
recall at the thresholds the tier uses and a lookup computes few distances in full.

Storage starts at one row and grows in chunks (by half, at least ``GROW_ROWS``; a context
with one entry costs one row, many small contexts are common) and a removed entry's slot is
filled by the last one, so the arrays stay dense.
"""

from __future__ import annotations

import math

import numpy as np

GROW_ROWS = 4
PREFILTER_ROWS = 64
"""At most this many entries, the nearest by Hamming distance, get an exact cosine."""
BOUND_SLACK = 1.6
BOUND_MARGIN = 8
_WORD_BITS = 64


def sign_code(vectors: np.ndarray) -> np.ndarray:
    """The sign bits of each row, packed into 64-bit words: shape (rows, words)."""
    rows, dims = vectors.shape
    words = -(-dims // _WORD_BITS)
    bits = np.zeros((rows, words * _WORD_BITS), dtype=bool)
    bits[:, :dims] = vectors > 0
    return np.packbits(bits, axis=1).view(np.uint64)


def hamming_bound(threshold: float, dims: int) -> int:
    """How many sign bits may differ between vectors at cosine >= ``threshold``."""
    angle = math.acos(max(-1.0, min(1.0, threshold)))
    return min(dims, math.ceil(BOUND_SLACK * dims * angle / math.pi) + BOUND_MARGIN)


class VectorIndex:
    """Unit vectors of one context under their entry keys."""

    def __init__(self, dims: int) -> None:
        self.dims = dims
        self._words = -(-dims // _WORD_BITS)
        self._codes = np.zeros((self._words, 1), dtype=np.uint64)
        self._vectors = np.zeros((1, dims), dtype=np.float16)
        self._keys: list[str] = []
        self._rows: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._rows

    def keys(self) -> tuple[str, ...]:
        return tuple(self._keys)

    @property
    def capacity(self) -> int:
        return self._vectors.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (allocated capacity, not just the used rows)."""
        return self._vectors.nbytes + self._codes.nbytes

    def add(self, key: str, vector: np.ndarray) -> None:
        """File ``vector`` (unit length, ``dims`` long) under ``key``, replacing any."""
        row = self._rows.get(key)
        if row is None:
            row = len(self._keys)
            if row == self.capacity:
                self._grow()
            self._keys.append(key)
            self._rows[key] = row
        self._vectors[row] = vector
        self._codes[:, row] = sign_code(vector.reshape(1, -1))[0]

    def remove(self, key: str) -> bool:
        """Forget ``key``; False when it was not here."""
        row = self._rows.pop(key, None)
        if row is None:
            return False
        last = len(self._keys) - 1
        moved = self._keys.pop()
        if row != last:
            self._keys[row] = moved
            self._rows[moved] = row
            self._vectors[row] = self._vectors[last]
            self._codes[:, row] = self._codes[:, last]
        return True

    def search(self, query: np.ndarray, threshold: float, limit: int) -> list[tuple[str, float]]:
        """Up to ``limit`` (key, cosine) with cosine >= ``threshold``, the most similar
        first.  ``query`` must be a unit vector of ``dims`` float32."""
        n = len(self._keys)
        if n == 0:
            return []
        if n <= PREFILTER_ROWS:
            rows = np.arange(n)
        else:
            rows = self._prefilter(query, n, threshold)
            if rows.size == 0:
                return []
        scores = self._vectors[rows].astype(np.float32) @ query
        keep = scores >= threshold
        rows, scores = rows[keep], scores[keep]
        order = np.argsort(-scores, kind="stable")[:limit]
        return [(self._keys[int(rows[i])], min(1.0, float(scores[i]))) for i in order]

    def _prefilter(self, query: np.ndarray, n: int, threshold: float) -> np.ndarray:
        code = sign_code(query.reshape(1, -1))[0]
        counts = np.empty(n, dtype=np.uint8)
        _popcount(np.bitwise_xor(self._codes[0, :n], code[0]), counts)
        rows = np.flatnonzero(counts <= hamming_bound(threshold, _WORD_BITS))
        if rows.size == 0 or self._words == 1:
            distance = counts[rows].astype(np.uint16)
        else:
            distance = counts[rows].astype(np.uint16)
            scratch = np.empty(rows.size, dtype=np.uint8)
            for word in range(1, self._words):
                _popcount(np.bitwise_xor(self._codes[word, rows], code[word]), scratch)
                distance += scratch
            keep = distance <= hamming_bound(threshold, self._words * _WORD_BITS)
            rows, distance = rows[keep], distance[keep]
        if rows.size > PREFILTER_ROWS:
            rows = rows[np.argpartition(distance, PREFILTER_ROWS)[:PREFILTER_ROWS]]
        return rows

    def _grow(self) -> None:
        rows = self.capacity + max(GROW_ROWS, self.capacity // 2)
        vectors = np.zeros((rows, self.dims), dtype=np.float16)
        vectors[: self.capacity] = self._vectors
        codes = np.zeros((self._words, rows), dtype=np.uint64)
        codes[:, : self.capacity] = self._codes
        self._vectors, self._codes = vectors, codes

    def __repr__(self) -> str:
        return f"<VectorIndex dims={self.dims} entries={len(self)}/{self.capacity}>"


if hasattr(np, "bitwise_count"):  # numpy >= 2.0

    def _popcount(words: np.ndarray, out: np.ndarray) -> None:
        np.bitwise_count(words, out=out)

else:  # pragma: no cover - numpy 1.x: a byte table, several times slower
    _BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)

    def _popcount(words: np.ndarray, out: np.ndarray) -> None:
        per_byte = _BYTE_BITS[words.view(np.uint8)].reshape(-1, 8)
        np.sum(per_byte, axis=1, dtype=np.uint8, out=out)
