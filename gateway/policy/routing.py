"""Route tables compiled from a policy: first match wins, on path glob, body ``model``, the
caller's named tenant and request headers.  A table whose routes match on headers is not
cached: a client's header values would fill the cache."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.errors import NoRoute
from gateway.policy.match import takes
from gateway.policy.model import Policy, Route, glob_regex

OPENAI_JSON_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",  # OpenAI's Responses API
        "/v1/messages",  # Anthropic's Messages API (vLLM and llama.cpp serve it too)
        "/v1/messages/count_tokens",
    }
)
"""The endpoints whose JSON bodies the gateway always reads and validates, and routes on
their ``model``."""
OPENAI_PATHS = OPENAI_JSON_PATHS | {"/v1/models"}
INFERENCE_PATH = re.compile(
    r"/v1/(chat/completions|completions|embeddings|messages(/count_tokens)?|moderations)"
    r"|/v2/models/[^/]+(/versions/[^/]+)?/(infer|generate|generate_stream)"  # KServe, Triton
    r"|/v1/models/[^/]+(/versions/[^/]+)?:(predict|classify|regress)"  # TF Serving
    r"|/(embed|embed_all|embed_sparse|rerank|predict|similarity|decode)"  # TEI
    r"|/(generate|generate_stream|chat_tokenize|encode|classify)"  # TGI, SGLang
    r"|/(completion|completions|infill|embedding|embeddings|apply-template)"  # llama.cpp
    r"|/(v1/|v2/)?(rerank|reranking|score)|/pooling"  # llama.cpp, vLLM
    r"|/(tokenize|detokenize)"  # llama.cpp, vLLM, TGI, TEI
    r"|/api/(generate|chat|embed|embeddings|show)"  # Ollama
    r"|/"  # TGI's compatibility route (where its Python clients post); an inference root
    r"|/invocations|/vertex"  # SageMaker's route (vLLM's, TGI's); TGI's Vertex AI route
    r"|/inference/v1/generate"  # vLLM's tokens in, tokens out
)
"""POSTs that run a model (or its tokenizer) and change nothing on the server: safe to send
twice.  Not among them: what stores (OpenAI's files, batches and responses), or changes a
server (llama.cpp's ``/slots`` and ``/lora-adapters``, Ollama's ``/api/pull``, vLLM's
``/v1/load_lora_adapter``)."""

_Matcher = Callable[[str], object]


@dataclass(frozen=True, slots=True)
class _Entry:
    path: _Matcher
    model: _Matcher | None
    route: Route
    narrow: bool  # matches on the tenant or headers too


class Router:
    """Finds the route of a request in a compiled table."""

    __slots__ = ("_by_headers", "_by_tenant", "_cache", "_entries", "needs_model")

    def __init__(self, policy: Policy) -> None:
        self._entries = tuple(
            _Entry(
                glob_regex(r.match.path).match,
                glob_regex(r.match.model).match if r.match.model is not None else None,
                r,
                bool(r.match.tenants or r.match.headers),
            )
            for r in policy.routes
        )
        self.needs_model = any(e.model is not None for e in self._entries)
        self._by_headers = any(r.match.headers for r in policy.routes)
        self._by_tenant = any(r.match.tenants for r in policy.routes)
        self._cache: dict[tuple[str, str | None, str], Route] = {}

    def route(
        self,
        path: str,
        model: str | None,
        tenant: str = "",
        headers: Sequence[tuple[str, str]] = (),
    ) -> Route:
        """The first route matching ``path``, ``model``, the caller's ``tenant`` and its
        request ``headers``; NoRoute if none does."""
        key = (path, model, tenant if self._by_tenant else "")
        found = self._cache.get(key)
        if found is not None:
            return found
        for entry in self._entries:
            if entry.path(path) is None:
                continue
            if entry.model is not None and (model is None or entry.model(model) is None):
                continue
            if entry.narrow and not takes(entry.route.match, tenant, headers):
                continue
            if not self._by_headers and len(self._cache) < 4096:
                self._cache[key] = entry.route
            return entry.route
        what = f"path {path!r}" + (f" and model {model!r}" if model is not None else "")
        raise NoRoute(f"no route matches {what}")

    def __repr__(self) -> str:
        return f"<Router routes={len(self._entries)} cached={len(self._cache)}>"
