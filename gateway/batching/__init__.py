"""Micro-batching of array-taking APIs: adapters per API, the batcher, and its size limit."""

from __future__ import annotations

from .adapters import (
    Adapter,
    KServeInfer,
    OpenAICompletions,
    OpenAIEmbeddings,
    TEIEmbed,
    TFServingPredict,
    adapter_for,
)
from .aimd import AimdLimit, BatchLimit, FixedLimit
from .batcher import Answer, Batcher, BatchObserver, NullObserver, Send

__all__ = [
    "Adapter",
    "AimdLimit",
    "Answer",
    "BatchLimit",
    "BatchObserver",
    "Batcher",
    "FixedLimit",
    "KServeInfer",
    "NullObserver",
    "OpenAICompletions",
    "OpenAIEmbeddings",
    "Send",
    "TEIEmbed",
    "TFServingPredict",
    "adapter_for",
]
