"""The backend embedder: a policy backend's ``/v1/embeddings`` instead of the local model.

Used when a route sets ``semantic.embedder: <backend>``.  The request goes through the
gateway's own upstream transport (its pool, timeouts and TLS settings for that backend),
with the backend's configured headers; a failed or malformed answer is an
``UpstreamError``, which the tier turns into a miss.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np

from gateway.errors import UpstreamError
from gateway.policy.model import Backend
from gateway.transport.upstream import Transport

EMBEDDINGS_PATH = "/v1/embeddings"


class BackendEmbedder:
    """``await embedder(texts)``: unit vectors from ``backend``'s embeddings endpoint.

    ``model`` is sent as the request's ``model`` when given (servers that host one model,
    such as TEI and vLLM, do not need it).
    """

    def __init__(self, transport: Transport, backend: Backend, *, model: str | None = None):
        self._transport = transport
        self.backend = backend
        self.model = model
        self.name = f"backend:{backend.name}"
        self.calls = 0
        self.errors = 0

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        body: dict[str, Any] = {"input": list(texts)}
        if self.model is not None:
            body["model"] = self.model
        headers = [("Content-Type", "application/json"), *self.backend.headers]
        reply = await self._transport.send(
            self.backend,
            "POST",
            EMBEDDINGS_PATH,
            headers,
            json.dumps(body).encode(),
            streaming=False,
        )
        try:
            if reply.status != 200 or reply.body is None:
                raise self._error(f"answered {reply.status}")
            return _vectors(reply.body, len(texts))
        except ValueError as exc:
            raise self._error(f"answered a malformed embeddings body: {exc}") from exc
        finally:
            if reply.close is not None:
                await reply.close()

    def _error(self, what: str) -> UpstreamError:
        self.errors += 1
        return UpstreamError(
            f"embedder {self.backend.name} {EMBEDDINGS_PATH} {what}", self.backend.name
        )

    def __repr__(self) -> str:
        return (
            f"<BackendEmbedder {self.backend.name} model={self.model} "
            f"calls={self.calls} errors={self.errors}>"
        )


def _vectors(body: bytes, count: int) -> np.ndarray:
    """The answer's vectors in input order (by ``data[i].index``), each of unit length."""
    try:
        data = json.loads(body)["data"]
        rows = sorted(data, key=lambda item: int(item.get("index", 0)))
        matrix = np.array([row["embedding"] for row in rows], dtype=np.float32)
    except (KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise ValueError(f"no data[].embedding ({exc})") from exc
    if matrix.ndim != 2 or matrix.shape[0] != count or matrix.shape[1] == 0:
        raise ValueError(f"expected {count} vectors, got shape {matrix.shape}")
    if not np.isfinite(matrix).all():
        raise ValueError("a vector is not finite")
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    if (norms == 0).any():
        raise ValueError("a vector is zero")
    return matrix / norms
