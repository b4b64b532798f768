"""Batch adapters: one per array-taking API, found by request path with ``adapter_for``.

    OpenAIEmbeddings   POST /v1/embeddings             input   -> data[i]
    OpenAICompletions  POST /v1/completions            prompt  -> choices[i] (greedy only)
    TEIEmbed           POST /embed                     inputs  -> [vector, ...]
    KServeInfer        POST /v2/models/{m}/infer       inputs  -> outputs (first dimension)
    TFServingPredict   POST /v1/models/{m}:predict     instances -> predictions

An adapter's compat key covers the body only; whoever batches adds the tenant scope, the
route, the backend and the path (the model name of KServe and TF Serving lives in the path).
"""

from __future__ import annotations

import re

from gateway.batching.adapters.base import (
    Adapter,
    apportion,
    canonical,
    split_usage,
    text_or_tokens,
)
from gateway.batching.adapters.kserve import KServeInfer
from gateway.batching.adapters.openai import OpenAICompletions, OpenAIEmbeddings
from gateway.batching.adapters.tei import TEIEmbed
from gateway.batching.adapters.tfserving import TFServingPredict

__all__ = [
    "Adapter",
    "KServeInfer",
    "OpenAICompletions",
    "OpenAIEmbeddings",
    "TEIEmbed",
    "TFServingPredict",
    "adapter_for",
    "apportion",
    "canonical",
    "split_usage",
    "text_or_tokens",
]

_BY_PATH: tuple[tuple[re.Pattern[str], Adapter], ...] = (
    (re.compile(r"(?:/v1)?/embeddings"), OpenAIEmbeddings()),
    (re.compile(r"(?:/v1)?/completions"), OpenAICompletions()),
    (re.compile(r"/embed"), TEIEmbed()),
    (re.compile(r"/v2/models/[^/]+(?:/versions/[^/]+)?/infer"), KServeInfer()),
    (
        re.compile(r"/v1/models/[^/:]+(?:/versions/[^/:]+|/labels/[^/:]+)?:predict"),
        TFServingPredict(),
    ),
)


def adapter_for(path: str) -> Adapter | None:
    """The adapter for a request path (query string excluded), or None if none fits."""
    for pattern, adapter in _BY_PATH:
        if pattern.fullmatch(path):
            return adapter
    return None
