"""The local embedder (the ``embedding`` extra): loads with the network cut off, gives the
same unit vectors for the same text whatever it is batched with, matches pinned reference
similarities, and serves the tier at its default threshold.  Skipped, saying why, where the
extra is not installed; and a gateway route with ``semantic.method: embedding`` serves a
paraphrase from it, never to another tenant."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import numpy as np
import pytest

from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import EMBEDDING, EmbeddingTier, LocalEmbedder, LocalModel, local
from gateway.cache.stores import MemoryStore
from gateway.sim import SimConfig, start_sim

CHAT = "/v1/chat/completions"
OK, REASON = local.available()
pytestmark = pytest.mark.skipif(not OK, reason=f"local embedding model unavailable: {REASON}")


@pytest.fixture(scope="module")
def model() -> LocalModel:
    return LocalModel()


def test_available_names_the_model_and_where_it_comes_from() -> None:
    assert "all-MiniLM-L6-v2" in REASON and "from sidecar-gateway" in REASON


def test_it_loads_and_embeds_with_the_network_cut_off(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise OSError("network access in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    model = LocalModel(threads=1)
    vectors = model.encode(["Is the model shipped in the wheel?"])
    assert vectors.shape == (1, 384) and vectors.dtype == np.float32


def test_vectors_are_unit_length_and_deterministic(model: LocalModel) -> None:
    texts = ["How do I learn Python?", "What is the capital of France?", "hi", ""]
    first = model.encode(texts)
    assert first.shape == (4, 384)
    assert np.allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(first, model.encode(texts))
    alone = np.stack([model.encode([t])[0] for t in texts])
    assert np.array_equal(first, alone)  # the batch never changes a text's vector
    assert model.encode([]).shape == (0, 384)


def test_reference_similarities(model: LocalModel) -> None:
    """Pins the model files and the pipeline (no padding, mean pooling, L2); the fp32 model
    answers 0.987 and 0.128, its int8 file within 0.01."""
    a, b, c = model.encode(
        ["How do I learn Python?", "How can I learn Python?", "What is the capital of France?"]
    )
    assert float(a @ b) == pytest.approx(0.981, abs=0.003)
    assert float(a @ c) == pytest.approx(0.134, abs=0.01)


def test_long_texts_are_truncated_not_refused(model: LocalModel) -> None:
    vector = model.encode(["word " * 2000])[0]
    assert np.isfinite(vector).all()


async def test_the_async_embedder_runs_off_the_loop_and_is_shared() -> None:
    embedder = LocalEmbedder(threads=1)
    assert "not loaded" in repr(embedder)
    await embedder.load()
    vectors = await embedder(["How do I learn Python?", "hi"])
    assert vectors.shape == (2, 384)
    assert "loaded calls=1 texts=2" in repr(embedder)
    assert local.shared() is local.shared()


async def test_the_tier_hits_a_paraphrase_at_the_default_threshold() -> None:
    store = MemoryStore()
    cache = ResponseCache(store)
    tier = EmbeddingTier(store, local.shared())

    def key(text: str) -> Any:
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}
        return request_key(
            body, scope="s", route="chat", backend="main", model_version="v1", path=CHAT
        )

    stored = key("What is the best way to learn Python?")
    entry = CachedResponse(200, (), b"{}", None, 0.0, "main", "v1", "chat", "s")
    await cache.put(stored, entry, 60)
    await tier.add(stored, stored.prompt, stored.exact)
    asked = key("How can I learn Python?")
    hit = await tier.lookup(asked, asked.prompt)
    assert hit is not None and hit.match == EMBEDDING and hit.similarity >= 0.9
    other = key("How can I learn Java?")
    assert await tier.lookup(other, other.prompt) is None


POLICY = """
backends:
  gpu: {{url: "{sim}"}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    backend: gpu
    cache: {{ttl_s: 60, semantic: {{method: embedding}}}}
"""


async def test_a_gateway_route_serves_a_paraphrase_from_the_embedding_tier(
    start_gateway: Any, tmp_path: Any
) -> None:
    sim = await start_sim(SimConfig(port=0, base_ms=1.0, token_ms=0.0))
    try:
        policy = tmp_path / "p.yaml"
        policy.write_text(POLICY.format(sim=sim.url))
        gw = await start_gateway(policy=policy, warmup=False)
        url = gw.url + "/v1/chat/completions"

        def ask(text: str) -> dict[str, Any]:
            return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}

        async with httpx.AsyncClient(headers={"Authorization": "Bearer a"}, timeout=30) as client:
            first = await client.post(url, json=ask("What is the best way to learn Python?"))
            assert first.headers["X-Gateway-Cache"] == "miss"
            para = await client.post(url, json=ask("How can I learn Python?"))
            assert para.headers["X-Gateway-Cache"] == "hit"
            assert para.headers["X-Gateway-Cache-Match"] == "embedding"
            assert float(para.headers["X-Gateway-Cache-Similarity"]) >= 0.9
            assert para.json()["id"] == first.json()["id"]
            other = await client.post(url, json=ask("How can I learn Java?"))
            assert other.headers["X-Gateway-Cache"] == "miss"
            bob = await client.post(
                url, json=ask("How should I learn Python?"), headers={"Authorization": "Bearer b"}
            )
            assert bob.headers["X-Gateway-Cache"] == "miss"
    finally:
        await sim.close()
