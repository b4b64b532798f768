"""A simulated GPU model server: OpenAI-compatible, with a cost, thermal and memory model.

It stands in for vLLM on one GPU in the gateway's demo, tests and benchmarks: calls cost
``base_ms + items * per_item_ms`` and share ``slots``; outputs are deterministic; load heats
the GPU and fills VRAM, visible on ``/metrics`` under DCGM and vLLM names; faults (errors,
latency, CUDA OOM) switch on at run time through ``POST /sim/config``.

    config.py      SimConfig, the settings (and the `gateway sim` flags)
    gpu.py         cost of a call; GpuModel, temperature/utilisation/VRAM/power on a clock
    engine.py      FIFO slots, counters, fault injection, live reconfiguration
    outputs.py     deterministic answers, logprobs and embeddings
    requests.py    reading OpenAI request bodies
    openai_api.py  /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models
    other_apis.py  /v1/responses (OpenAI's Responses API), /v1/messages (Anthropic's)
    metrics.py     /metrics under DCGM exporter and vLLM names
    server.py      the aiohttp app, control endpoints, start_sim / run_sim
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.lazy import exports

if TYPE_CHECKING:
    from gateway.sim.config import SimConfig
    from gateway.sim.gpu import GpuModel, GpuState, call_cost_ms
    from gateway.sim.server import SimServer, build_app, run_sim, start_sim

_HOMES = {  # each name loads its module on first use (gateway/lazy.py)
    "SimConfig": "config",
    "GpuModel": "gpu",
    "GpuState": "gpu",
    "call_cost_ms": "gpu",
    "SimServer": "server",
    "build_app": "server",
    "run_sim": "server",
    "start_sim": "server",
}


__getattr__ = exports(__name__, _HOMES)


__all__ = [
    "GpuModel",
    "GpuState",
    "SimConfig",
    "SimServer",
    "build_app",
    "call_cost_ms",
    "run_sim",
    "start_sim",
]
