"""Deterministic model outputs: answers, logprobs and embeddings derived from the input.

The same input always gives the same output, in any process, so tests and caches can rely on
it.  Embeddings are a hashed bag of words and bigrams: identical texts map to the same unit
vector, texts sharing words point in similar directions, unrelated texts are near orthogonal.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import random
import re
from functools import lru_cache

import numpy as np

WORDS = (
    "the model answers with a short deterministic reply about gpu load heat memory batch "
    "queue cache token stream latency budget signal sidecar gateway request policy route "
    "backend slot prefill decode tensor kernel warp cluster node pod sample metric window "
    "limit retry breaker throttle shed admit merge split vector matrix layer weight score "
    "stable quick calm steady bright clear plain simple exact fair"
).split()

_WORD_RE = re.compile(r"[a-z0-9]+")
_BIGRAM_WEIGHT = 0.5
_LOGPROB_SPREAD = 0.2
_FEATURE_CACHE = 65536


def count_tokens(text: str) -> int:
    """Whitespace tokens: the sim's stand-in for a tokenizer."""
    return len(text.split())


def answer_tokens(model: str, prompt: str, count: int, weights: str = "") -> list[str]:
    """``count`` answer tokens for ``prompt`` on ``model`` (with ``weights`` other than the
    default, other tokens); the first has no leading space."""
    rng = random.Random(_digest("answer", model, prompt, *([weights] if weights else [])))
    words = [rng.choice(WORDS) for _ in range(count)]
    return [word if i == 0 else " " + word for i, word in enumerate(words)]


def token_logprobs(
    prompt: str, tokens: list[str], confidence: float, top: int = 0
) -> list[dict[str, object]]:
    """OpenAI ``logprobs.content`` entries; their mean is about ``log(confidence) - 0.1``."""
    rng = random.Random(_digest("logprobs", prompt))
    entries: list[dict[str, object]] = []
    for token in tokens:
        logprob = math.log(confidence) - _LOGPROB_SPREAD * rng.random()
        alternatives = [{"token": token, "logprob": logprob, "bytes": list(token.encode())}]
        for rank in range(1, top):
            other = " " + WORDS[rng.randrange(len(WORDS))]
            lower = logprob - rank - rng.random()
            alternatives.append({"token": other, "logprob": lower, "bytes": list(other.encode())})
        entries.append({**alternatives[0], "top_logprobs": alternatives[:top]})
    return entries


def embedding(text: str, dimensions: int) -> np.ndarray:
    """A unit float32 vector for ``text``: same text, same vector."""
    words = _WORD_RE.findall(text.lower())
    return _embed(tuple(words), dimensions)


def token_embedding(tokens: list[int], dimensions: int) -> np.ndarray:
    """A unit float32 vector for a list of token ids."""
    return _embed(tuple(f"#{t}" for t in tokens), dimensions)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """The vector as OpenAI sends it: a list of floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in vector]


def _embed(features: tuple[str, ...], dimensions: int) -> np.ndarray:
    total = np.zeros(dimensions, dtype=np.float64)
    for feature in features:
        total += _feature_vector(feature, dimensions)
    for left, right in itertools.pairwise(features):
        total += _BIGRAM_WEIGHT * _feature_vector(left + " " + right, dimensions)
    norm = float(np.linalg.norm(total))
    if norm == 0.0:
        total = _feature_vector("", dimensions).copy()
        norm = float(np.linalg.norm(total))
    result: np.ndarray = (total / norm).astype(np.float32)
    return result


@lru_cache(maxsize=_FEATURE_CACHE)
def _feature_vector(feature: str, dimensions: int) -> np.ndarray:
    seed = int.from_bytes(_digest("feature", feature)[:8], "little")
    vector: np.ndarray = np.random.default_rng(seed).standard_normal(dimensions)
    vector.setflags(write=False)
    return vector


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("\x00".join(parts).encode()).digest()
