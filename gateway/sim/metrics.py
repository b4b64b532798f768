"""The sim's ``/metrics``: the GPU as DCGM exporter and vLLM would report it.

Values are computed at scrape time from the engine, on a registry of the sim's own (never the
process-wide default), so many sims can run in one process.  Names and labels follow
dcgm-exporter (``DCGM_FI_DEV_*`` with ``gpu``, ``UUID``, ``device``, ``modelName``,
``Hostname``) and vLLM (``vllm:*`` with ``model_name``).  vLLM counts every prompt as a
request, so its running/waiting gauges count items, not calls.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.sim.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
HOSTNAME = "sim"

DCGM_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")
VLLM_LABELS = ("model_name",)


def gpu_uuid(seed: int) -> str:
    """A stable GPU UUID in NVIDIA's format, derived from the seed."""
    digest = hashlib.sha256(f"sim-gpu-{seed}".encode()).digest()
    return "GPU-" + str(uuid.UUID(bytes=digest[:16]))


class SimCollector:
    """Reads the engine whenever the registry is scraped."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        config = engine.config
        s = engine.gpu.state()
        dcgm_values = [
            ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", s.temperature_c),
            ("DCGM_FI_DEV_MEMORY_TEMP", "Memory temperature (in C).", s.memory_temperature_c),
            ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", round(s.vram_used_mib)),
            ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", round(s.vram_free_mib)),
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", round(100 * s.utilization)),
            ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", s.power_w),
        ]
        labels = ["0", gpu_uuid(config.seed), "nvidia0", config.gpu_name, HOSTNAME]
        for name, doc, value in dcgm_values:
            family = GaugeMetricFamily(name, doc, labels=DCGM_LABELS)
            family.add_metric(labels, value)
            yield family
        model = [config.model_names[0]]
        vllm_values = [
            ("vllm:num_requests_running", "Requests running on the GPU.", s.running_items),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", s.waiting_items),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", s.kv_cache_usage),
        ]
        for name, doc, value in vllm_values:
            family = GaugeMetricFamily(name, doc, labels=VLLM_LABELS)
            family.add_metric(model, value)
            yield family
        n = engine.counters
        sim_totals = [
            ("sim_calls", "GPU calls the sim ran.", n.calls),
            ("sim_items", "Input items in the calls the sim ran.", n.items),
            ("sim_injected_errors", "Requests answered with an injected error.", n.injected_errors),
            ("sim_ooms", "Requests answered with a simulated CUDA OOM.", n.ooms),
        ]
        for name, doc, total in sim_totals:
            yield CounterMetricFamily(name, doc, value=total)


def build_registry(engine: Engine) -> CollectorRegistry:
    """A registry of the sim's own, holding only its collector."""
    registry = CollectorRegistry()
    registry.register(SimCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format (version 0.0.4)."""
    return generate_latest(registry)
