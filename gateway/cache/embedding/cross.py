"""The cross-encoder: the learned verifier's reader of a candidate pair, both texts at once.

A bi-encoder (``local.py``) sees each question alone, so "the capital of France" and "...
of Germany" land close; a cross-encoder reads the pair together and can see the word that
differs.  This one is all-MiniLM-L6-v2's transformer fine-tuned on the labelled Quora
pairs of ``qqp_train.tsv`` (both labels: the non-duplicates teach the near misses; one
question-disjoint tenth is left to fit the verifier's weights) by
``bench/train_cross_encoder.py``, exported to ONNX and quantized to int8:
``gateway/data/cross_encoder.onnx``, package data, pinned by sha256 and size (``MODEL``).
It reads ``[CLS] cached [SEP] asked [SEP]`` (the bi-encoder's WordPiece vocabulary, from the
same ``tokenizer.json``; at most ``MAX_PAIR_TOKENS``, the longer text cut first),
mean-pools the last layer and answers one logit: the model's log-odds that one answer
serves both.  The verifier asks for pairs read whole only (``logits(..., whole=True)``): a
longer pair is not run, and refused.

A lookup reads at most ``learned.MAX_CROSS`` candidates with it, one pair a run, on the
reader's own thread (off the event loop), on one onnxruntime thread (``local.THREADS``):
about 3.5 ms for a pair of short questions.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from gateway.cache.embedding.local import (
    THREADS,
    ModelFile,
    same_length,
    session,
    tokenizer,
    verified,
)
from gateway.cache.embedding.resident import Once, Resident

MAX_PAIR_TOKENS = 128
PAIR_MARKERS = 3
"""``[CLS]`` and two ``[SEP]``: a pair is read whole when its texts' tokens number at most
``MAX_PAIR_TOKENS - PAIR_MARKERS``."""
FILE = "cross_encoder.onnx"


MODEL = ModelFile(
    "sidecar-gateway",
    "gateway.data",
    FILE,
    "1b183f5fe22d0537a656a54f1bf10670efb91c34563b7214a0632c39de4b0d54",
    22_891_228,
)
"""The shipped file's pin, what the calibration was measured with; written by
``bench/train_cross_encoder.py`` with the file it exports."""


def path() -> Path:
    """Where the package's cross-encoder file is."""
    return Path(str(resources.files("gateway.data").joinpath(FILE)))


class CrossEncoder:
    """The tokenizer (pairs) and the onnxruntime session: synchronous, thread-safe.

    ``model_path`` replaces the shipped file (the training script scores a file it has just
    written; its pin is not checked).
    """

    def __init__(self, threads: int | None = None, model_path: Path | None = None) -> None:
        self.threads = threads or THREADS
        self._tokenizer = tokenizer(MAX_PAIR_TOKENS)
        self._texts = tokenizer(MAX_PAIR_TOKENS + 1)
        self.path = model_path or verified(MODEL)
        self._session = session(self.path, self.threads)

    def encode(self, pairs: Sequence[tuple[str, str]]) -> tuple[list[Any], list[bool]]:
        """Each pair as the model reads it, ``[CLS] cached [SEP] asked [SEP]`` cut to
        ``MAX_PAIR_TOKENS`` (the longer text first), and whether it was read whole.

        Each text is tokenised alone and cut first, then the two are joined and cut as a
        pair: the same tokens as cutting the pair at once (the cut keeps at most
        ``MAX_PAIR_TOKENS`` of either text), without the tokenizer's pairing of every
        overflow of one text with every overflow of the other, which grows with the product
        of their lengths (two 100,000-character texts took 89 s; a million, all the memory).
        """
        texts = self._texts.encode_batch(
            [text for pair in pairs for text in pair], add_special_tokens=False
        )
        encodings, whole = [], []
        for first, second in zip(texts[::2], texts[1::2], strict=True):
            cut = bool(first.overflowing or second.overflowing)
            if cut:  # the pair's cut gives the longer text the odd token: keep which it is
                lengths = _length(first), _length(second)
                shorter = first if lengths[0] < lengths[1] else second
                if lengths[0] != lengths[1] and len(shorter.ids) > MAX_PAIR_TOKENS:
                    shorter.truncate(MAX_PAIR_TOKENS)
            joined = self._tokenizer.post_process(first, second)
            encodings.append(joined)
            whole.append(not cut and not joined.overflowing)
        return encodings, whole

    def logits(self, pairs: Sequence[tuple[str, str]], *, whole: bool = False) -> np.ndarray:
        """The model's logit for each (cached, asked) pair, float32; with ``whole``, NaN
        for a pair too long to be read whole (not run).

        Pairs of equal token count run together (no padding), so a pair's logit is the
        same whatever it is batched with.
        """
        out = np.full(len(pairs), np.nan, np.float32)
        if not pairs:
            return out
        encodings, read_whole = self.encode(pairs)
        run = [i for i, ok in enumerate(read_whole) if ok or not whole]
        for group in same_length([encodings[i] for i in run]):
            rows = [run[g] for g in group]
            ids = np.array([encodings[i].ids for i in rows], dtype=np.int64)
            types = np.array([encodings[i].type_ids for i in rows], dtype=np.int64)
            feeds: dict[str, Any] = {
                "input_ids": ids,
                "attention_mask": np.ones_like(ids),
                "token_type_ids": types,
            }
            out[rows] = self._session.run(None, feeds)[0].reshape(-1)
        return out

    def __repr__(self) -> str:
        return f"<CrossEncoder {self.path.name} threads={self.threads}>"


def _length(encoding: Any) -> int:
    """A text's token count before the tokenizer cut it (its pieces do not overlap)."""
    return len(encoding.ids) + sum(len(piece.ids) for piece in encoding.overflowing)


class CrossReader:
    """The process's cross-encoder, loaded once on its own thread (``resident.Resident``):
    ``await reader.logit(cached, asked)`` off the event loop, ``logits`` synchronously (for
    evaluation)."""

    def __init__(self, threads: int | None = None) -> None:
        self._resident = Resident(lambda: CrossEncoder(threads), "gateway-cross")
        self.runs = 0

    async def logit(self, cached: str, asked: str) -> float:
        """The pair's logit, or NaN when it is too long to be read whole (not run)."""
        self.runs += 1
        return await self._resident.run(
            lambda model: float(model.logits([(cached, asked)], whole=True)[0])
        )

    def logits(self, pairs: Sequence[tuple[str, str]], *, whole: bool = False) -> np.ndarray:
        return self._resident.model().logits(pairs, whole=whole)

    def start_loading(self) -> None:
        self._resident.start_loading()

    async def load(self) -> CrossEncoder:
        return await self._resident.load()

    def __repr__(self) -> str:
        return f"<CrossReader {FILE} {self._resident.state} runs={self.runs}>"


shared = Once(CrossReader)
"""``shared()``: the process's one cross-encoder."""
