"""Micro-batching of array-taking APIs: adapters per API, the batcher, its merged calls and
the answers they give, and the batch size limit."""

from __future__ import annotations

from gateway.batching.adapters import (
    Adapter,
    KServeInfer,
    OpenAICompletions,
    OpenAIEmbeddings,
    TEIEmbed,
    TFServingPredict,
    adapter_for,
)
from gateway.batching.aimd import AimdLimit, BatchLimit, FixedLimit
from gateway.batching.answer import Answer
from gateway.batching.batcher import Batcher
from gateway.batching.merged_calls import Send
from gateway.batching.observer import BatchObserver, NullObserver

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
