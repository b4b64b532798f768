"""The embedding tier: a verified paraphrase in the same exact context is a hit; another
context or tenant, a changed number, negation, entity, direction or order, a similarity
under the threshold, a stale pointer, a failing embedder or store are misses; the index is
bounded, least recently used out.  The embedder here is a deterministic stand-in (a bag of
seeded random word vectors); the local model has its own tests."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import (
    EMBEDDING,
    RULES_THRESHOLD,
    BackendEmbedder,
    EmbeddingTier,
    LocalEmbedder,
    available,
    from_semantic,
)
from gateway.cache.embedding.index import PREFILTER_ROWS, VectorIndex, hamming_bound
from gateway.cache.embedding.local import ModelFile, verified
from gateway.cache.embedding.local import available as local_available
from gateway.cache.embedding_seam import EmbeddingContext
from gateway.cache.keys import RequestKey
from gateway.cache.stores import MemoryStore
from gateway.errors import UpstreamError
from gateway.policy.load import parse_policy_text
from gateway.testing import FakeClock, FlakyStore

PATH = "/v1/chat/completions"
THRESHOLD = 0.6  # the stand-in embedder's paraphrases score about 0.7-0.9


class WordsEmbedder:
    """A deterministic embedder: the normalised sum of a seeded random vector per word."""

    name = "words"

    def __init__(self, dims: int = 256) -> None:
        self.dims = dims
        self.calls = 0
        self.texts: list[str] = []
        self.failing: Exception | None = None

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        self.texts.extend(texts)
        if self.failing is not None:
            raise self.failing
        return np.stack([self.vector(t) for t in texts])

    def vector(self, text: str) -> np.ndarray:
        total = np.zeros(self.dims)
        for word in re.findall(r"[a-z0-9+#$]+", text.lower()):
            seed = int.from_bytes(hashlib.blake2b(word.encode(), digest_size=8).digest(), "big")
            total += np.random.default_rng(seed).standard_normal(self.dims)
        return total / (np.linalg.norm(total) or 1.0)


def chat(text: str, system: str = "You are helpful.") -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
    }


def key_for(text: str, *, scope: str = "tenant-a", system: str = "You are helpful.") -> RequestKey:
    return request_key(
        chat(text, system), scope=scope, route="chat", backend="main", model_version="v1", path=PATH
    )


class Harness:
    def __init__(self, **kwargs: Any) -> None:
        self.clock = FakeClock()
        self.store = MemoryStore(clock=self.clock)
        self.cache = ResponseCache(self.store, clock=self.clock)
        self.embed = WordsEmbedder()
        kwargs.setdefault("threshold", THRESHOLD)
        self.tier = EmbeddingTier(self.store, self.embed, **kwargs)

    async def cached(self, text: str, ttl_s: float = 60, **where: str) -> RequestKey:
        key = key_for(text, **where)
        entry = CachedResponse(
            200, (), b'{"answer": 1}', None, 0.0, "main", "v1", "chat", key.scope
        )
        assert await self.cache.put(key, entry, ttl_s)
        assert key.prompt is not None
        await self.tier.add(key, key.prompt, key.exact)
        return key

    async def ask(self, text: str, **where: str) -> Any:
        key = key_for(text, **where)
        assert key.prompt is not None
        return await self.tier.lookup(key, key.prompt)


async def test_a_reworded_question_in_the_same_context_is_a_hit() -> None:
    h = Harness()
    stored = await h.cached("How do I learn Python?")
    hit = await h.ask("How can I learn Python?")
    assert hit is not None and hit.match == EMBEDDING == "embedding"
    assert hit.key == stored.exact and hit.entry.prompt == "How do I learn Python?"
    assert THRESHOLD <= hit.similarity < 1.0
    assert h.tier.results[EMBEDDING] == 1


async def test_frames_that_ask_the_same_thing_hit() -> None:
    h = Harness(threshold=0.2)  # the stand-in scores few shared words low
    await h.cached("What is the best way to learn Python?")
    assert await h.ask("How should I learn Python?") is not None


async def test_never_across_contexts() -> None:
    h = Harness()
    await h.cached("How do I learn Python?", system="You are a pirate.")
    assert await h.ask("How can I learn Python?") is None
    assert await h.ask("How can I learn Python?", system="You are a pirate.") is not None


async def test_never_across_tenants() -> None:
    h = Harness()
    await h.cached("How do I learn Python?", scope="tenant-a")
    assert await h.ask("How do I learn Python?", scope="tenant-b") is None
    assert await h.ask("How can I learn Python?", scope="tenant-b") is None


async def test_an_entry_of_another_scope_under_the_same_context_is_refused() -> None:
    """Even if the index were wrong about a context, the entry's own scope decides."""
    h = Harness()
    stored = await h.cached("How do I learn Python?", scope="tenant-a")
    forged = RequestKey("tenant-b", "other", stored.context, "How can I learn Python?")
    assert await h.tier.lookup(forged, "How can I learn Python?") is None
    assert h.tier.rejections["scope"] == 1


@pytest.mark.parametrize(
    ("cached", "asked", "reason"),
    [
        ("How do I learn Python?", "How do I learn Java?", "content"),
        ("How do I upload files to S3?", "How do I download files to S3?", "direction"),
        ("Flights from Paris to London", "Flights from London to Paris", "order"),
        ("How do I reset my password?", "How do I reset your password?", "pronoun"),
    ],
)
async def test_a_similar_question_that_asks_something_else_is_rejected(
    cached: str, asked: str, reason: str
) -> None:
    h = Harness(threshold=0.3)
    await h.cached(cached)
    assert await h.ask(asked) is None
    assert h.tier.rejections[reason] == 1, h.tier.rejections


@pytest.mark.parametrize(
    ("cached", "asked"),
    [
        ("How many calories are in 2 eggs?", "How many calories are in 3 eggs?"),
        ("Is coffee good for you?", "Is coffee not good for you?"),
        ('Translate "good morning" into German', 'Translate "good night" into German'),
    ],
)
async def test_a_changed_number_negation_or_quote_is_a_miss(cached: str, asked: str) -> None:
    """Whether the context key already separates them or verification rejects them."""
    h = Harness(threshold=0.3)
    await h.cached(cached)
    assert await h.ask(asked) is None and h.tier.results[EMBEDDING] == 0


async def test_a_paraphrase_under_the_threshold_is_a_miss() -> None:
    h = Harness(threshold=0.99)
    await h.cached("How do I learn Python?")
    assert await h.ask("How can I learn Python?") is None
    assert not h.tier.rejections  # never got as far as verification


def test_threshold_defaults_and_is_validated() -> None:
    store = MemoryStore()
    assert EmbeddingTier(store, WordsEmbedder()).threshold == RULES_THRESHOLD == 0.90
    assert EmbeddingTier(store, WordsEmbedder(), threshold=0.8).threshold == 0.8
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="threshold"):
            EmbeddingTier(store, WordsEmbedder(), threshold=bad)


async def test_an_expired_entry_is_a_miss_and_its_pointer_is_dropped() -> None:
    h = Harness()
    await h.cached("How do I learn Python?", ttl_s=10)
    assert len(h.tier) == 1
    h.clock.advance(11)
    assert await h.ask("How can I learn Python?") is None
    assert len(h.tier) == 0 and h.tier.contexts == 0 and h.tier.results["stale"] == 1


async def test_a_deleted_entry_is_a_miss() -> None:
    h = Harness()
    stored = await h.cached("How do I learn Python?")
    await h.store.delete(stored.exact)
    assert await h.ask("How can I learn Python?") is None
    assert len(h.tier) == 0


async def test_the_index_is_bounded_least_recently_used_first_out() -> None:
    h = Harness(max_entries=2)
    await h.cached("How do I learn Python?")
    await h.cached("How do I bake bread?")
    assert await h.ask("How can I learn Python?") is not None  # Python is now the newest
    await h.cached("How do I tie a tie?")
    assert len(h.tier) == 2 and h.tier.results["evicted"] == 1
    assert await h.ask("How can I bake bread?") is None
    assert await h.ask("How can I learn Python?") is not None
    assert await h.ask("How can I tie a tie?") is not None


async def test_a_context_with_nothing_cached_costs_no_embedding() -> None:
    h = Harness()
    assert await h.ask("How can I learn Python?") is None
    assert h.embed.calls == 0


async def test_a_miss_then_its_store_embed_the_text_once() -> None:
    h = Harness()
    await h.cached("How do I bake bread?")
    assert await h.ask("How do I learn Python?") is None
    calls = h.embed.calls
    await h.cached("How do I learn Python?")
    assert h.embed.calls == calls


async def test_re_adding_an_entry_keeps_one_row() -> None:
    h = Harness()
    await h.cached("How do I learn Python?")
    await h.cached("How do I learn Python?")
    assert len(h.tier) == 1


async def test_a_failing_embedder_is_a_miss() -> None:
    h = Harness()
    await h.cached("How do I learn Python?")
    h.embed.failing = UpstreamError("embedder down", "emb")
    assert await h.ask("How can I learn Python?") is None
    assert h.tier.results["embed_error"] == 1
    await h.tier.add(key_for("How to bake?"), "How to bake?", "k")  # no raise, not indexed
    assert len(h.tier) == 1


async def test_a_failing_store_is_a_miss() -> None:
    h = Harness()
    await h.cached("How do I learn Python?")
    flaky = FlakyStore(h.store)
    h.tier.store = flaky
    flaky.failing = True
    assert await h.ask("How can I learn Python?") is None
    flaky.failing = False
    assert await h.ask("How can I learn Python?") is not None


async def test_a_request_without_a_context_is_ignored() -> None:
    h = Harness()
    key = RequestKey("tenant-a", "exact-only")
    await h.tier.add(key, "How do I learn Python?", "exact-only")
    assert await h.tier.lookup(key, "How do I learn Python?") is None
    assert len(h.tier) == 0 and h.embed.calls == 0


async def test_forget_and_clear() -> None:
    h = Harness()
    stored = await h.cached("How do I learn Python?")
    await h.cached("How do I bake bread?")
    assert h.tier.forget(stored.exact) and not h.tier.forget(stored.exact)
    assert len(h.tier) == 1
    h.tier.clear()
    assert len(h.tier) == 0 and h.tier.nbytes() == 0


async def test_repr_shows_live_state() -> None:
    h = Harness(max_entries=10)
    await h.cached("How do I learn Python?")
    await h.ask("How can I learn Python?")
    assert repr(h.tier) == (
        "<EmbeddingTier embedder=words threshold=0.60 verifier=rules entries=1/10 contexts=1 rejected=0 "
        "embedding=1>"
    )


def test_vector_index_adds_replaces_removes_and_grows() -> None:
    rng = np.random.default_rng(3)
    vectors = rng.standard_normal((100, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(32)
    for i, v in enumerate(vectors):
        index.add(f"k{i}", v)
    assert len(index) == 100 and index.capacity >= 100 and "k7" in index
    assert index.search(vectors[7], 0.99, 5)[0][0] == "k7"
    assert index.remove("k7") and not index.remove("k7") and "k7" not in index
    assert all(key != "k7" for key, _ in index.search(vectors[7], -1.0, 100))
    assert index.search(vectors[99], 0.99, 1)[0][0] == "k99"  # moved into k7's row
    index.add("k0", vectors[1])
    assert {key for key, _ in index.search(vectors[1], 0.99, 5)} == {"k0", "k1"}
    assert repr(index).startswith("<VectorIndex dims=32 entries=99/")


@pytest.mark.parametrize("dims", [64, 200, 384])
def test_vector_index_prefilter_finds_the_nearest_among_many(dims: int) -> None:
    rng = np.random.default_rng(4)
    n = PREFILTER_ROWS * 50
    vectors = rng.standard_normal((n, dims)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = VectorIndex(dims)
    for i, v in enumerate(vectors):
        index.add(str(i), v)
    for target in (0, n // 2, n - 1):
        noise = rng.standard_normal(dims).astype(np.float32)
        query = vectors[target] + 0.3 * noise / np.linalg.norm(noise)  # cosine about 0.95
        query /= np.linalg.norm(query)
        found = index.search(query, 0.9, 3)
        assert found and found[0][0] == str(target) and found[0][1] >= 0.9
    assert index.search(-vectors[0], 0.9, 3) == []


def test_hamming_bound_widens_as_the_threshold_drops() -> None:
    assert hamming_bound(1.0, 384) == 8
    assert hamming_bound(0.9, 384) < hamming_bound(0.8, 384) < 384 // 2
    assert hamming_bound(-1.0, 384) == 384


def test_available_without_an_embedder_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    ok, reason = available()
    assert not ok
    assert "onnxruntime" in reason and "pip install 'sidecar-gateway[embedding]'" in reason
    ok, reason = available("tei")
    assert ok and "tei" in reason


def test_available_names_missing_model_files() -> None:
    gone = ModelFile("sidecar-gateway", "gateway.data", "gone.onnx", "0" * 64, 1)
    elsewhere = ModelFile("absent-dist", "absent_package_of_models", "tokenizer.json", "0" * 64, 1)
    ok, reason = local_available((gone, elsewhere))
    assert not ok and "sidecar-gateway (gone.onnx)" in reason
    assert "absent-dist (tokenizer.json)" in reason and "sidecar-gateway[embedding]" in reason


def test_a_model_file_that_is_not_the_pinned_one_is_refused() -> None:
    """A file of the right name but other bytes (a broken or altered install) never loads."""
    altered = ModelFile("sidecar-gateway", "gateway.data", "demo.yaml", "0" * 64, 1)
    with pytest.raises(ImportError, match="not the pinned file of sidecar-gateway"):
        verified(altered)


POLICY = """
backends:
  main: {url: "http://127.0.0.1:9"}
  tei: {url: "http://127.0.0.1:9"}
routes:
  - name: chat
    match: {path: /v1/chat/completions}
    backend: main
    cache: {ttl_s: 60, semantic: {method: embedding, embedder: tei, threshold: 0.93}}
"""


def test_from_semantic_builds_a_backend_embedder_tier() -> None:
    policy = parse_policy_text(POLICY)
    semantic = policy.routes[0].cache.semantic  # type: ignore[union-attr]
    store = MemoryStore()
    context = EmbeddingContext("chat", store, policy, transport=None, clock=FakeClock())  # type: ignore[arg-type]
    tier = from_semantic(semantic, context)
    assert isinstance(tier, EmbeddingTier) and tier.store is store and tier.threshold == 0.93
    assert tier.name == "backend:tei"
    assert isinstance(tier._embed, BackendEmbedder) and tier._embed.backend.name == "tei"


def test_from_semantic_without_the_extra_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tokenizers", None)
    policy = parse_policy_text(POLICY.replace("embedder: tei, ", ""))
    semantic = policy.routes[0].cache.semantic  # type: ignore[union-attr]
    context = EmbeddingContext("chat", MemoryStore(), policy, transport=None, clock=FakeClock())  # type: ignore[arg-type]
    with pytest.raises(ImportError, match=r"tokenizers.*sidecar-gateway\[embedding\]"):
        from_semantic(semantic, context)


async def test_a_local_model_that_cannot_load_is_a_miss_and_not_retried(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "onnxruntime", None)
    embedder = LocalEmbedder(threads=1)
    embedder.start_loading()
    with pytest.raises(ImportError, match="sidecar-gateway\\[embedding\\]") as first:
        await embedder.load()
    with pytest.raises(ImportError) as second:
        await embedder(["How do I learn Python?"])
    assert second.value is first.value and "failed to load" in repr(embedder)
    h = Harness()
    await h.cached("How do I learn Python?")
    h.tier._embed = embedder
    h.tier._memo.clear()
    assert await h.ask("How can I learn Python?") is None
    assert h.tier.results["embed_error"] == 1
