"""The cross-encoder the learned verifier reads candidates with (``embedding/cross.py``):
the shipped file is the pinned one and loads with the network cut off, a pair's logit does
not depend on its batch, it tells a near miss from a paraphrase, the process loads it once,
and a lookup reads at most ``MAX_CROSS`` candidates with it.  Skipped, saying why, where
the ``embedding`` extra is not installed."""

from __future__ import annotations

import hashlib
import random
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import EmbeddingTier, cross, local
from gateway.cache.embedding.learned import (
    MAX_CROSS,
    TOO_LONG,
    UNREAD,
    LearnedVerifier,
    shipped,
)
from gateway.cache.embedding.tier import MESSAGE_TOO_LONG
from gateway.cache.guard import Verdict
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


def test_it_reads_the_tokens_the_tokenizer_cuts_a_pair_to(encoder: cross.CrossEncoder) -> None:
    """Each text is cut alone, then the pair: the same tokens as the tokenizer's cut of the
    whole pair, around the cut too (which text keeps the odd token), and "whole" exactly
    where that cut took nothing."""
    rng = random.Random(26)
    words = "how do i learn python fast what is the best way to cook rice at home".split()
    pairs = [("How do I learn Python?", "How can I learn Python?"), ("", "hi")]
    for _ in range(300):
        first, second = (" ".join(rng.choices(words, k=rng.randint(1, 140))) for _ in "ab")
        pairs += [(first, second), (first, first)]
    for n in range(120, 134):
        pairs += [("cat " * n, "dog " * m) for m in (1, 2, 60, n - 1, n, n + 1)]
    pairwise = local.tokenizer(cross.MAX_PAIR_TOKENS)
    encodings, whole = encoder.encode(pairs)
    for pair, got, read_whole in zip(pairs, encodings, whole, strict=True):
        want = pairwise.encode(*pair)
        assert (got.ids, got.type_ids) == (want.ids, want.type_ids), pair
        assert read_whole == (not want.overflowing), pair


def test_a_pair_too_long_to_read_whole_is_not_run_when_asked(encoder: cross.CrossEncoder) -> None:
    short = ("How do I learn Python?", "How can I learn Python?")
    long = ("word " * 100, "word " * 30)  # 130 tokens and three special ones
    cut, whole = encoder.logits([short, long]), encoder.logits([short, long], whole=True)
    assert np.isfinite(cut).all()
    assert whole[0] == cut[0] and np.isnan(whole[1])


def test_two_long_texts_are_read_in_time_linear_in_their_length(
    encoder: cross.CrossEncoder,
) -> None:
    """The tokenizer's own cut of a pair pairs every overflow of one text with every one of
    the other: two texts of 100,000 characters took 89 s, two of a million all the memory.
    Cut alone first, they take a moment; whole, they are not run."""
    text = "how do I configure the kubernetes cluster for my model server " * 3300
    assert len(text) > 200_000
    assert np.isfinite(encoder.logits([(text, text + " now")]))[0]
    assert np.isnan(encoder.logits([(text, text + " now")], whole=True))[0]


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

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        return np.stack([self.vectors[t] for t in texts])


def chat_key(text: str) -> Any:
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}
    return request_key(body, scope="s", route="r", backend="b", model_version="v", path=CHAT)


async def test_a_pair_alike_where_it_is_read_but_not_after_is_refused_too_long() -> None:
    """A long document, then two different questions: the models read the document only,
    so the cosine is 1 and the cross-encoder would read two equal texts.  The verifier
    vouches only for what it reads whole: refused, ``TOO_LONG``, by its words before any
    feature is computed, or by the reader's own count of tokens; and the tier neither
    embeds nor indexes a message no pair with it could be read whole."""
    document = " ".join(
        f"Section {chr(65 + i % 26)}: the supplier shall deliver the goods to the buyer "
        "within the agreed period, and the buyer shall pay the price stated in the order."
        for i in range(40)
    )
    cached = document + " Question: what is the termination clause?"
    asked = document + " Question: who are the parties to this contract?"
    reader = cross.CrossReader(threads=1)
    verifier = LearnedVerifier(shipped(), shipped().operating_point(0.01).min_score, reader)
    assert verifier.unreadable(cached)
    assert verifier.assess(cached, asked, 1.0)[0] == Verdict(False, TOO_LONG)
    assert await verifier.check(cached, asked, 1.0) == (Verdict(False, TOO_LONG), -1.0, False)
    assert verifier("How do I learn Python fast?", "How can I learn Python quickly?", 0.95).ok
    # few words, many tokens: 32 words, 63 tokens a side
    wordy = "Is " + "internationalization " * 30 + "hard?"
    also = wordy.replace("hard?", "hard, really?")
    assert not verifier.too_long(wordy, also)
    assert verifier.assess(wordy, also, 1.0)[0] == Verdict(False, TOO_LONG)

    vector = np.ones(8, np.float32)
    table = TableEmbedder({wordy: vector, also: vector})
    store = MemoryStore()
    tier = EmbeddingTier(store, table, verifier=verifier)
    entry = CachedResponse(200, (), b"{}", None, 0.0, "b", "v", "r", "s")
    for text in (wordy, cached):
        await ResponseCache(store).put(chat_key(text), entry, 60)
        await tier.add(chat_key(text), text, chat_key(text).exact)
    assert len(tier) == 1  # the document was not indexed (nor embedded: not in the table)
    assert await tier.lookup(chat_key(also), also) is None
    assert tier.rejections[TOO_LONG] == 1 and reader.runs == 1
    assert await tier.lookup(chat_key(asked), asked) is None
    assert tier.rejections[MESSAGE_TOO_LONG] == 1


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
