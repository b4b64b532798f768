"""A real model on a real GPU for the batching bench: a MiniLM-sized transformer encoder
(6 layers, 384 wide, random weights from a fixed seed: nothing is downloaded) behind an
OpenAI-style ``/v1/embeddings``, one forward pass at a time, as a single-worker model
server (TEI, a Triton instance) runs them.

    python -m bench.gpu_model PORT [--device cuda] [--layers 6] [--hidden 384]

Needs PyTorch.  Tokens are words hashed into the vocabulary (no tokenizer to download);
a batch is padded to its longest input and the padding is masked, so an input's vector is
the same, up to float rounding, whether it came alone or in a batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from aiohttp import web

VOCAB = 30522
MAX_TOKENS = 128


class Encoder(torch.nn.Module):
    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, hidden, padding_idx=0)
        layer = torch.nn.TransformerEncoderLayer(
            hidden, nhead=max(1, hidden // 32), dim_feedforward=4 * hidden, batch_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pad = ids == 0
        out = self.encoder(self.embed(ids), src_key_padding_mask=pad)
        keep = (~pad).unsqueeze(-1).to(out.dtype)
        pooled = (out * keep).sum(1) / keep.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled.float(), dim=-1)


def tokens(text: str) -> list[int]:
    words = text.lower().split()[:MAX_TOKENS] or [""]
    return [zlib.crc32(w.encode()) % (VOCAB - 1) + 1 for w in words]


class Model:
    def __init__(self, device: str, layers: int, hidden: int) -> None:
        torch.manual_seed(0)
        self.device = device
        dtype = torch.float16 if device.startswith("cuda") else torch.float32
        self.net = Encoder(layers, hidden).to(device=device, dtype=dtype).eval()
        self.calls = 0
        self.name = torch.cuda.get_device_name(device) if device.startswith("cuda") else device
        self.embed(["warm up the kernels"] * 16)  # the case study's cold-start lesson

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> list[list[float]]:
        rows = [tokens(t) for t in texts]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=self.device)
        self.calls += 1
        vectors: list[list[float]] = self.net(ids).cpu().tolist()
        return vectors


def app(model: Model) -> web.Application:
    worker = ThreadPoolExecutor(1)  # one forward pass at a time on the GPU

    async def embeddings(request: web.Request) -> web.Response:
        body = await request.json()
        given = body.get("input")
        texts = [given] if isinstance(given, str) else list(given)
        vectors = await asyncio.get_running_loop().run_in_executor(worker, model.embed, texts)
        data = [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)]
        usage = {"prompt_tokens": sum(len(tokens(t)) for t in texts)}
        usage["total_tokens"] = usage["prompt_tokens"]
        answer = {"object": "list", "data": data, "model": body.get("model", ""), "usage": usage}
        return web.Response(text=json.dumps(answer), content_type="application/json")

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"calls": model.calls, "device": model.name})

    application = web.Application(client_max_size=64 * 2**20)
    application.router.add_post("/v1/embeddings", embeddings)
    application.router.add_get("/stats", stats)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("port", type=int)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    args = parser.parse_args()
    model = Model(args.device, args.layers, args.hidden)
    web.run_app(app(model), host="127.0.0.1", port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
