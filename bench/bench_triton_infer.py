"""Bounds on Triton's ``infer`` (a route's ``generation``): what reading its tensors costs a
call, a generation's and any other model's.

    python -m bench.bench_triton_infer [--duration 5] [--rounds 3] [--connections 8]

A backend answers each ``infer`` after ``SERVICE_MS`` with a small JSON answer.  The
calls, built by Triton's own client library (``tritonclient.http``) in the binary tensor
extension, as its clients send them by default:

- a TensorRT-LLM call asking ``max_tokens`` 5,000: through the bounded gateway its tensor
  is rewritten in place to the route's 64;
- the same call asking 32, within the bound: read, sent as it came;
- an image model's call, one 3 x 224 x 224 float32 tensor (602 KB): its JSON names no
  bounded tensor, so it is never parsed, only scanned.

The paths take turns in each round: direct, the gateway without bounds, the gateway with
``generation: {max_tokens: 64}``.  Each row gives answers a second and latency.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import tritonclient.http as triton
from aiohttp import web

from bench.common import machine, update_section
from bench.plumbing import (
    ANSWERS_S,
    P50_MS,
    P99_MS,
    Runs,
    closed_loop,
    figures_of,
    gateway,
    medians,
    rounds_command,
    rounds_of,
    run_rounds,
    serving,
)

SERVICE_MS = 2.0
BOUND = 64
PATH = "/v2/models/ensemble/infer"
ANSWER = {"model_name": "ensemble", "outputs": [{"name": "text_output", "datatype": "BYTES",
          "shape": [1], "data": ["ok"]}]}  # fmt: skip


def _tensor(name: str, array: Any, datatype: str) -> triton.InferInput:
    one = triton.InferInput(name, list(array.shape), datatype)
    one.set_data_from_numpy(array, binary_data=True)
    return one


def _call(inputs: list[triton.InferInput]) -> tuple[bytes, dict[str, str]]:
    body, length = triton.InferenceServerClient.generate_request_body(inputs)
    return body, {"Inference-Header-Content-Length": str(length)}


def trtllm(max_tokens: int) -> tuple[bytes, dict[str, str]]:
    """TensorRT-LLM's ensemble call asking ``max_tokens``."""
    text = np.array([[b"Which of our jackets keeps the rain out?"]], dtype=object)
    return _call(
        [
            _tensor("text_input", text, "BYTES"),
            _tensor("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32"),
        ]
    )


def image() -> tuple[bytes, dict[str, str]]:
    """An image model's call: one 3 x 224 x 224 float32 tensor."""
    pixels = np.random.default_rng(7).random((1, 3, 224, 224), dtype=np.float32)
    return _call([_tensor("images", pixels, "FP32")])


CALLS = {
    f"TensorRT-LLM, `max_tokens` 5000 (clamped to {BOUND})": trtllm(5000),
    "TensorRT-LLM, `max_tokens` 32 (within)": trtllm(32),
    "an image model, 602 KB (not parsed)": image(),
}


class Triton:
    """A backend answering every ``infer`` after ``SERVICE_MS``."""

    def __init__(self) -> None:
        self.calls = 0

    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_post(PATH, self.infer)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        await asyncio.sleep(SERVICE_MS / 1000)
        return web.json_response(ANSWER)


def loading(body: bytes, headers: dict[str, str]) -> Any:
    """A closed loop posting ``body`` with ``headers`` to ``PATH``."""

    async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
        latencies, elapsed, failed = await closed_loop(
            urls, PATH, lambda: body, duration_s, connections, headers
        )
        if failed:
            raise RuntimeError(f"{failed} calls failed")
        return figures_of(latencies, elapsed)

    return load


def policy(url: str, bounded: bool) -> dict[str, Any]:
    route: dict[str, Any] = {"match": {"path": "/v2/*"}, "backend": "triton"}
    if bounded:
        route["generation"] = {"max_tokens": BOUND}
    return {"backends": {"triton": {"url": url}}, "routes": [route]}


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    backend = Triton()
    async with serving(backend.app()) as (url,):
        async with gateway(policy(url, False)) as plain, gateway(policy(url, True)) as bounded:
            runs: Runs = {}
            for name, (body, headers) in CALLS.items():
                paths = {
                    f"{name}: direct": [url],
                    f"{name}: gateway, no bounds": [plain],
                    f"{name}: gateway, `max_tokens: {BOUND}`": [bounded],
                }
                runs |= await rounds_of(
                    paths,
                    loading(body, headers),
                    lambda: backend.calls,
                    duration_s,
                    rounds,
                    connections,
                )
    return medians(runs, (ANSWERS_S, P50_MS, P99_MS))


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 5.0, 8, main)
    update_section(
        "triton_infer",
        "## Bounds on Triton's `infer` (`generation`)\n\n"
        f"`{rounds_command('bench_triton_infer', args)}` on {machine()}. A backend answers "
        f"each `infer` after {SERVICE_MS:g} ms; the calls are built by `tritonclient` in the "
        "binary tensor extension; gateways as processes of their own; "
        f"{args.connections} connections each sending as fast as it is answered; medians "
        "over the rounds, in which the paths take turns. The clamped call has its "
        "`max_tokens` tensor rewritten in place; the call within the bound is read and sent "
        "as it came; the image model's is scanned for the tensors' names and never "
        "parsed.\n\n" + "\n".join(lines),
    )
