"""The simulated GPU server's settings: one frozen value, also the source of `gateway sim` flags.

Every field has a default and a ``metadata["help"]``; the CLI turns each into a flag
(``base_ms`` -> ``--base-ms``, typed by the default's type), so field types stay plain
``int``, ``float``, ``str`` and ``bool``.  ``POST /sim/config`` changes fields at run time
through :func:`apply_changes`; the listening address cannot change that way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MODELS = "sim-model"
DEFAULT_BASE_MS = 46.0
DEFAULT_PER_ITEM_MS = 4.0
DEFAULT_TOKEN_MS = 2.0
DEFAULT_ANSWER_TOKENS = 16
DEFAULT_DIMENSIONS = 384
DEFAULT_AMBIENT_C = 40.0
DEFAULT_MAX_STEADY_C = 92.0
DEFAULT_MEMORY_OFFSET_C = 4.0
DEFAULT_THERMAL_TAU_S = 60.0
DEFAULT_UTIL_WINDOW_S = 1.0
DEFAULT_VRAM_TOTAL_MIB = 81559
DEFAULT_WEIGHTS_RATIO = 0.40
DEFAULT_KV_POOL_RATIO = 0.50
DEFAULT_KV_CAPACITY_ITEMS = 64
DEFAULT_POWER_IDLE_W = 70.0
DEFAULT_POWER_MAX_W = 690.0
DEFAULT_POWER_LIMIT_W = 700.0
DEFAULT_GPU_NAME = "NVIDIA H100 80GB HBM3"
DEFAULT_CONFIDENCE = 0.9
DEFAULT_FAIL_STATUS = 500

FROZEN_AT_RUNTIME = frozenset({"host", "port"})


def _opt(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, slots=True)
class SimConfig:
    """How the simulated GPU server listens, costs calls, heats up and fails."""

    host: str = _opt(DEFAULT_HOST, "address to listen on")
    port: int = _opt(DEFAULT_PORT, "port to listen on (0 picks a free one)")
    models: str = _opt(DEFAULT_MODELS, "comma-separated model names listed by /v1/models")
    weights: str = _opt(
        "",
        "the weights served, as /v1/models (root) and /api/tags (digest) name them; other "
        "weights give other answers",
    )
    base_ms: float = _opt(DEFAULT_BASE_MS, "fixed cost of one GPU call (ms)")
    per_item_ms: float = _opt(DEFAULT_PER_ITEM_MS, "extra cost per input item in a call (ms)")
    slots: int = _opt(1, "GPU calls that run at once; the rest wait in FIFO order")
    token_ms: float = _opt(DEFAULT_TOKEN_MS, "decode cost per generated token (ms)")
    answer_tokens: int = _opt(
        DEFAULT_ANSWER_TOKENS, "length of an answer unless max_tokens cuts it"
    )
    dimensions: int = _opt(DEFAULT_DIMENSIONS, "embedding size unless the request sets dimensions")
    confidence: float = _opt(
        DEFAULT_CONFIDENCE, "typical token probability behind logprobs (lower = less sure)"
    )
    ambient_c: float = _opt(DEFAULT_AMBIENT_C, "GPU temperature when idle for long (C)")
    max_steady_c: float = _opt(DEFAULT_MAX_STEADY_C, "steady GPU temperature at full load (C)")
    memory_offset_c: float = _opt(DEFAULT_MEMORY_OFFSET_C, "memory runs this much hotter (C)")
    thermal_tau_s: float = _opt(DEFAULT_THERMAL_TAU_S, "thermal time constant (s)")
    time_scale: float = _opt(1.0, "speeds up heating and cooling by this factor (demo, tests)")
    util_window_s: float = _opt(DEFAULT_UTIL_WINDOW_S, "window utilisation is averaged over (s)")
    vram_total_mib: int = _opt(DEFAULT_VRAM_TOTAL_MIB, "framebuffer size (MiB)")
    weights_ratio: float = _opt(DEFAULT_WEIGHTS_RATIO, "share of VRAM the weights hold")
    kv_pool_ratio: float = _opt(DEFAULT_KV_POOL_RATIO, "share of VRAM a full KV cache holds")
    kv_reserved_ratio: float = _opt(
        0.0, "KV-cache share held by other work (long contexts): usage never reports below it"
    )
    kv_capacity_items: int = _opt(
        DEFAULT_KV_CAPACITY_ITEMS, "admitted items that fill the KV cache"
    )
    power_idle_w: float = _opt(DEFAULT_POWER_IDLE_W, "power draw when idle (W)")
    power_max_w: float = _opt(DEFAULT_POWER_MAX_W, "power draw at full utilisation (W)")
    power_limit_w: float = _opt(DEFAULT_POWER_LIMIT_W, "enforced power limit (W)")
    gpu_name: str = _opt(DEFAULT_GPU_NAME, "modelName label on DCGM metrics")
    error_rate: float = _opt(0.0, "share of model calls answered with an injected error (0..1)")
    fail_status: int = _opt(DEFAULT_FAIL_STATUS, "HTTP status of injected errors")
    added_latency_ms: float = _opt(0.0, "extra time every GPU call holds its slot (ms)")
    cold_start_ms: float = _opt(
        0.0,
        "time the model takes to warm up: the first calls after start, or after "
        "cold_idle_s without a call, wait for it (ms; 0 = always warm)",
    )
    cold_idle_s: float = _opt(60.0, "idle time after which the model is cold again (s)")
    oom_above: int = _opt(0, "calls with more items than this fail with CUDA OOM (0 = off)")
    healthy: bool = _opt(True, "whether /health answers 200 (else 503)")
    seed: int = _opt(0, "seed of the fault-injection RNG")

    def __post_init__(self) -> None:
        problems = list(_problems(self))
        if problems:
            raise ValueError("invalid sim config: " + "; ".join(problems))

    @property
    def model_names(self) -> tuple[str, ...]:
        """The served model names, first one the default."""
        return tuple(name.strip() for name in self.models.split(",") if name.strip())


def _problems(c: SimConfig) -> list[str]:
    checks = [
        (0 <= c.port <= 65535, "port must be 0..65535"),
        (bool(c.model_names), "models must name at least one model"),
        (c.base_ms >= 0 and c.per_item_ms >= 0, "base_ms and per_item_ms must be >= 0"),
        (c.token_ms >= 0 and c.added_latency_ms >= 0, "token_ms, added_latency_ms must be >= 0"),
        (c.cold_start_ms >= 0 and c.cold_idle_s > 0, "cold_start_ms >= 0, cold_idle_s > 0"),
        (c.slots >= 1, "slots must be >= 1"),
        (c.answer_tokens >= 1, "answer_tokens must be >= 1"),
        (c.dimensions >= 1, "dimensions must be >= 1"),
        (0 < c.confidence <= 1, "confidence must be in (0, 1]"),
        (c.max_steady_c >= c.ambient_c, "max_steady_c must be >= ambient_c"),
        (c.thermal_tau_s > 0 and c.time_scale > 0, "thermal_tau_s and time_scale must be > 0"),
        (c.util_window_s > 0, "util_window_s must be > 0"),
        (c.vram_total_mib >= 1, "vram_total_mib must be >= 1"),
        (
            c.weights_ratio >= 0
            and c.kv_pool_ratio >= 0
            and c.weights_ratio + c.kv_pool_ratio <= 1,
            "weights_ratio and kv_pool_ratio must be >= 0 and sum to <= 1",
        ),
        (c.kv_capacity_items >= 1, "kv_capacity_items must be >= 1"),
        (0 <= c.kv_reserved_ratio <= 1, "kv_reserved_ratio must be in [0, 1]"),
        (0 <= c.power_idle_w <= c.power_max_w, "need 0 <= power_idle_w <= power_max_w"),
        (c.power_limit_w > 0, "power_limit_w must be > 0"),
        (0 <= c.error_rate <= 1, "error_rate must be in 0..1"),
        (400 <= c.fail_status <= 599, "fail_status must be a 4xx or 5xx status"),
        (c.oom_above >= 0, "oom_above must be >= 0"),
    ]
    return [message for ok, message in checks if not ok]


def apply_changes(config: SimConfig, changes: Mapping[str, Any]) -> SimConfig:
    """``config`` with ``changes`` applied; ValueError names the first bad key or value."""
    types = {f.name: type(f.default) for f in dataclasses.fields(SimConfig)}
    clean: dict[str, Any] = {}
    for name, value in changes.items():
        if name not in types:
            raise ValueError(f"unknown sim config field {name!r}")
        if name in FROZEN_AT_RUNTIME:
            raise ValueError(f"{name} cannot change while the sim runs")
        clean[name] = _coerce(name, types[name], value)
    return dataclasses.replace(config, **clean)


def _coerce(name: str, kind: type, value: Any) -> Any:
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, kind) and (kind is bool or not isinstance(value, bool)):
        return value
    raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")
