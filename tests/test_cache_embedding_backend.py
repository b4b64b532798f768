"""``semantic.embedder: <backend>``: the tier embeds through that backend's
``/v1/embeddings`` over the gateway's own upstream pool (a real aiohttp server here), with
the backend's headers, in input order whatever order the answer lists them; an error or a
malformed answer is a miss, never an exception out of the tier."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from gateway.cache import CachedResponse, ResponseCache, request_key
from gateway.cache.embedding import EMBEDDING, BackendEmbedder, EmbeddingTier
from gateway.cache.stores import MemoryStore
from gateway.errors import UpstreamError
from gateway.metrics import Metrics
from gateway.policy.model import Backend
from gateway.transport.backends import Upstreams

from .conftest import ServeApp
from .test_cache_embedding import WordsEmbedder

CHAT = "/v1/chat/completions"


class EmbeddingsServer:
    """An OpenAI-style /v1/embeddings that answers with the stand-in's vectors, listed in
    reverse order (clients must use ``index``), or as told by ``status`` / ``body``."""

    def __init__(self) -> None:
        self.words = WordsEmbedder(dims=128)
        self.requests: list[tuple[dict[str, str], dict[str, Any]]] = []
        self.status = 200
        self.body: bytes | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.embeddings)
        return app

    async def embeddings(self, request: web.Request) -> web.Response:
        payload = await request.json()
        self.requests.append((dict(request.headers), payload))
        if self.body is not None:
            return web.Response(status=self.status, body=self.body)
        if self.status != 200:
            return web.json_response({"error": {"message": "down"}}, status=self.status)
        data = [
            {"object": "embedding", "index": i, "embedding": (3 * self.words.vector(t)).tolist()}
            for i, t in enumerate(payload["input"])
        ]
        return web.json_response({"object": "list", "data": data[::-1], "model": "m"})


@pytest.fixture
async def upstreams() -> AsyncIterator[Upstreams]:
    pools = Upstreams(Metrics())
    yield pools
    await pools.aclose()


@pytest.fixture
async def server(serve_app: ServeApp) -> tuple[EmbeddingsServer, Backend]:
    emb = EmbeddingsServer()
    url = await serve_app(emb.app())
    return emb, Backend("tei", url, headers=(("Authorization", "Bearer t0ken"),))


async def test_vectors_come_back_in_input_order_and_unit_length(
    server: tuple[EmbeddingsServer, Backend], upstreams: Upstreams
) -> None:
    emb, backend = server
    embedder = BackendEmbedder(upstreams, backend)
    texts = ["How do I learn Python?", "What is love?", "hi"]
    vectors = await embedder(texts)
    assert vectors.shape == (3, 128)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0)
    for text, vector in zip(texts, vectors, strict=True):
        assert np.allclose(vector, emb.words.vector(text), atol=1e-6)
    headers, payload = emb.requests[0]
    assert payload == {"input": texts} and headers["Authorization"] == "Bearer t0ken"
    assert repr(embedder) == "<BackendEmbedder tei model=None calls=1 errors=0>"


async def test_the_model_is_sent_when_configured(
    server: tuple[EmbeddingsServer, Backend], upstreams: Upstreams
) -> None:
    emb, backend = server
    await BackendEmbedder(upstreams, backend, model="bge-small")(["x"])
    assert emb.requests[0][1] == {"input": ["x"], "model": "bge-small"}


@pytest.mark.parametrize(
    ("status", "body", "message"),
    [
        (503, None, "answered 503"),
        (200, b"not json", "malformed"),
        (200, json.dumps({"data": [{"index": 0}]}).encode(), "malformed"),
        (200, json.dumps({"data": []}).encode(), "expected 1 vectors"),
        (200, json.dumps({"data": [{"index": 0, "embedding": [0, 0]}]}).encode(), "zero"),
    ],
)
async def test_a_failed_or_malformed_answer_is_an_upstream_error(
    server: tuple[EmbeddingsServer, Backend],
    upstreams: Upstreams,
    status: int,
    body: bytes | None,
    message: str,
) -> None:
    emb, backend = server
    emb.status, emb.body = status, body
    embedder = BackendEmbedder(upstreams, backend)
    with pytest.raises(UpstreamError, match=message) as caught:
        await embedder(["x"])
    assert caught.value.backend == "tei" and embedder.errors == 1


async def test_the_tier_hits_and_misses_through_the_backend(
    server: tuple[EmbeddingsServer, Backend], upstreams: Upstreams
) -> None:
    emb, backend = server
    store = MemoryStore()
    cache = ResponseCache(store)
    tier = EmbeddingTier(store, BackendEmbedder(upstreams, backend), threshold=0.6)

    def key(text: str) -> Any:
        body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}
        return request_key(
            body, scope="s", route="chat", backend="main", model_version="v1", path=CHAT
        )

    stored = key("How do I learn Python?")
    await cache.put(
        stored, CachedResponse(200, (), b"{}", None, 0.0, "main", "v1", "chat", "s"), 60
    )
    await tier.add(stored, stored.prompt, stored.exact)
    asked = key("How can I learn Python?")
    hit = await tier.lookup(asked, asked.prompt)
    assert hit is not None and hit.match == EMBEDDING and hit.key == stored.exact
    assert [payload["input"] for _, payload in emb.requests] == [
        ["How do I learn Python?"],
        ["How can I learn Python?"],
    ]
    emb.status = 500
    other = key("How should I learn Python?")
    assert await tier.lookup(other, other.prompt) is None
    assert tier.results["embed_error"] == 1
    assert "embedder=backend:tei" in repr(tier)
