"""The cross-encoder the learned verifier reads candidates with (``embedding/cross.py``):
the shipped file is the pinned one and loads with the network cut off, a pair's logit does
not depend on its batch, it tells a near miss from a paraphrase, the process loads it once,
and a lookup reads at most ``MAX_CROSS`` candidates with it.  Skipped, saying why, where
the ``embedding`` extra is not installed."""

from __future__ import annotations

import hashlib
import socket
from typing import Any

import numpy as np
import pytest

from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import EmbeddingTier, cross, local
from gateway.cache.embedding.learned import MAX_CROSS, UNREAD, LearnedVerifier, shipped
from gateway.cache.stores import MemoryStore

OK, REASON = local.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"local embedding model unavailable: {REASON}")
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def encoder() -> cross.CrossEncoder:
    return cross.CrossEncoder()


def test_the_shipped_file_is_the_pinned_one() -> None:
    data = cross.path().read_bytes()
    assert len(data) == cross.MODEL.size_bytes
    assert hashlib.sha256(data).hexdigest() == cross.MODEL.sha256


def test_it_loads_and_reads_with_the_network_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    logits = cross.CrossEncoder(threads=1).logits([("How do I learn Python?", "hi")])
    assert logits.shape == (1,) and logits.dtype == np.float32


def test_a_pairs_logit_does_not_depend_on_its_batch(encoder: cross.CrossEncoder) -> None:
    pairs = [
        ("How do I learn Python?", "How can I learn Python?"),
        ("What is the capital of France?", "What is the capital of Germany?"),
        ("hi", "hello there, how are you today?"),
        ("word " * 400, "word " * 300),  # cut at MAX_PAIR_TOKENS, not refused
    ]
    together = encoder.logits(pairs)
    alone = np.concatenate([encoder.logits([p]) for p in pairs])
    assert np.array_equal(together, alone) and np.isfinite(together).all()
    assert encoder.logits([]).shape == (0,)


def test_it_tells_a_near_miss_from_a_paraphrase(encoder: cross.CrossEncoder) -> None:
    """(It misses some: "the best gift you've ever given" / "... received" reads as the
    same question, one of the false hits docs/adjudicated_qqp_dev.tsv lists.)"""
    same, language, capital = encoder.logits(
        [
            ("How can I learn Python quickly?", "What is the fastest way to learn Python?"),
            ("How can I learn Python quickly?", "How can I learn Java quickly?"),
            ("What is the capital of France?", "What is the capital of Germany?"),
        ]
    )
    assert same > 0 > max(language, capital)


async def test_the_process_loads_it_once_and_reads_off_the_loop() -> None:
    reader = cross.CrossReader(threads=1)
    assert "not loaded" in repr(reader)
    await reader.load()
    logit = await reader.logit("How do I learn Python?", "How can I learn Python?")
    assert isinstance(logit, float) and "loaded runs=1" in repr(reader)
    assert cross.shared() is cross.shared()


class TableEmbedder:
    """Answers from a fixed text -> vector table."""

    def __init__(self, vectors: dict[str, np.ndarray]) -> None:
        self.vectors = vectors

    async def __call__(self, texts: list[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])


@pytest.mark.parametrize("needed", [0.0, 1.01])
async def test_a_lookup_reads_at_most_max_cross_candidates(needed: float) -> None:
    """At most ``MAX_CROSS`` candidates are read, the others refused unread; and none is
    read when no logit could lift its score to what is needed (``Model.cross_max``)."""
    stored = [f"How do I learn {lang} fast?" for lang in ("Python", "Rust", "Go", "Java", "C")]
    asked = "How can I pick up Haskell fast?"
    base = np.ones(8, np.float32)
    vectors = {t: base + 0.05 * i * np.eye(8, dtype=np.float32)[i] for i, t in enumerate(stored)}
    vectors[asked] = base
    store = MemoryStore()
    cache = ResponseCache(store)
    reader = cross.CrossReader(threads=1)
    never = LearnedVerifier(shipped(), 1.01, reader, needed=needed)  # no score reaches 1.01
    tier = EmbeddingTier(store, TableEmbedder(vectors), verifier=never)

    def key(text: str) -> Any:
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}
        return request_key(body, scope="s", route="r", backend="b", model_version="v", path=CHAT)

    entry = CachedResponse(200, (), b"{}", None, 0.0, "b", "v", "r", "s")
    for text in stored:
        k = key(text)
        await cache.put(k, entry, 60)
        await tier.add(k, text, k.exact)
    k = key(asked)
    assert await tier.lookup(k, asked) is None
    if needed > 1:
        assert reader.runs == 0 and tier.rejections["score"] == len(stored)
        return
    assert reader.runs == MAX_CROSS
    assert tier.rejections["score"] == MAX_CROSS
    assert tier.rejections[UNREAD] == len(stored) - MAX_CROSS
