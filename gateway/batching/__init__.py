"""Micro-batching of array-taking APIs: adapters per API, the batcher, its merged calls and
the answers they give, and the batch size limit."""

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
from .answer import Answer
from .batcher import Batcher
from .merged_calls import Send
from .observer import BatchObserver, NullObserver

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
