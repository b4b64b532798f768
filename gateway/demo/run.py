"""The demo's scenes: the same workload straight at the simulated GPU and through the
gateway with the demo policy, each on a fresh simulated GPU, compared in one table."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

from gateway.app import Gateway
from gateway.demo.coldstart import format_coldstart, run_coldstart
from gateway.demo.thermal import format_thermal, run_thermal
from gateway.demo.workload import drive
from gateway.policy.load import parse_policy_text
from gateway.policy.model import Policy
from gateway.policy.watch import PolicySource
from gateway.sim import SimConfig, start_sim

DEMO_POLICY = "demo.yaml"
SIM_DEFAULTS = (8.0, 32)
LLAMA_DEFAULTS = (30.0, 6)
"""Each backend's phase length (s) and clients, when not given."""


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """How long and how hard the demo drives."""

    duration_s: float = SIM_DEFAULTS[0]
    clients: int = SIM_DEFAULTS[1]
    time_scale: float = 15.0
    as_json: bool = False
    backend: Literal["sim", "llama"] = "sim"

    @classmethod
    def given(
        cls, backend: str | None, duration_s: float | None, clients: int | None, as_json: bool
    ) -> DemoOptions:
        """The options asked for; what is not given is the backend's default (a real model
        on a CPU answers a few requests a second: longer phases, fewer clients)."""
        defaults = LLAMA_DEFAULTS if backend == "llama" else SIM_DEFAULTS
        return cls(
            duration_s=defaults[0] if duration_s is None else duration_s,
            clients=defaults[1] if clients is None else clients,
            as_json=as_json,
            backend="llama" if backend == "llama" else "sim",
        )


def demo_policy_text() -> str:
    return resources.files("gateway.data").joinpath(DEMO_POLICY).read_text(encoding="utf-8")


def demo_policy(backend_url: str) -> Policy:
    """The demo policy with its backend pointed at ``backend_url``."""
    policy = parse_policy_text(demo_policy_text(), DEMO_POLICY)
    backends = tuple(dataclasses.replace(b, url=backend_url) for b in policy.backends)
    return dataclasses.replace(policy, backends=backends)


def sim_config(options: DemoOptions) -> SimConfig:
    return SimConfig(port=0, token_ms=1.0, time_scale=options.time_scale)


async def _phase(options: DemoOptions, through_gateway: bool) -> dict[str, Any]:
    sim = await start_sim(sim_config(options))
    gateway = None
    try:
        url = sim.url
        if through_gateway:
            gateway = Gateway(PolicySource(fixed=demo_policy(sim.url)))
            url, _ = await gateway.start("127.0.0.1", 0, "127.0.0.1", 0, warmup=False)
        before = sim.state()
        stats = await drive(url, clients=options.clients, duration_s=options.duration_s)
        after = sim.state()
        savings = gateway_savings(gateway) if gateway is not None else {}
    finally:
        if gateway is not None:
            await gateway.shutdown(1.0)
        await sim.close()
    busy_ms = after["modelled_ms"] - before["modelled_ms"]
    return {
        **stats.summary(),
        "upstream_calls": after["calls"] - before["calls"],
        "gpu_utilization_pct": round(100 * busy_ms / (stats.elapsed_s * 1000 * after["slots"]), 1),
        "peak_gpu_temperature_c": round(after["peak_temperature_c"], 1),
        "by_kind": stats.by_kind,
        **savings,
    }


def gateway_savings(gateway: Gateway) -> dict[str, Any]:
    """Where the gateway's saved GPU calls came from, read off its own metrics."""
    registry = gateway.metrics.registry

    def total(name: str, **labels: str) -> float:
        value = 0.0
        for metric in registry.collect():
            for sample in metric.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    value += sample.value
        return value

    batches = total("gateway_batch_size_count")
    return {
        "cache_hits": int(total("gateway_cache_lookups_total", result="hit")),
        "cache_hits_simhash": int(
            total("gateway_cache_lookups_total", result="hit", match="simhash")
        ),
        "coalesced": int(total("gateway_coalesced_requests_total")),
        "batched_calls": int(batches),
        "mean_batch_size": round(total("gateway_batch_size_sum") / batches, 1) if batches else 0.0,
    }


ROWS = (
    ("requests answered", "requests", "{:.0f}"),
    ("errors", "errors", "{:.0f}"),
    ("average latency (ms)", "avg_latency_ms", "{:.1f}"),
    ("p95 latency (ms)", "p95_latency_ms", "{:.1f}"),
    ("achieved QPS", "qps", "{:.1f}"),
    ("upstream (GPU) calls", "upstream_calls", "{:.0f}"),
    ("GPU utilisation (%)", "gpu_utilization_pct", "{:.1f}"),
    ("peak GPU temperature (C)", "peak_gpu_temperature_c", "{:.1f}"),
)


def compared(
    direct: dict[str, Any], gateway: dict[str, Any], rows: tuple[tuple[str, str, str], ...]
) -> list[str]:
    """The before/after lines: each row's label, both figures and their ratio."""
    width = max(28, *(len(label) + 2 for label, _, _ in rows))
    lines = [f"{'':{width}}{'direct':>12}{'via gateway':>14}{'change':>10}"]
    for label, key, fmt in rows:
        a, b = direct[key], gateway[key]
        change = f"{b / a:.2f}x" if a else ""
        lines.append(f"{label:{width}}{fmt.format(a):>12}{fmt.format(b):>14}{change:>10}")
    return lines


def format_table(result: dict[str, Any]) -> str:
    direct, gateway = result["direct"], result["gateway"]
    o = result["options"]
    lines = [
        f"sidecar-gateway demo: {o['clients']} clients, {o['duration_s']:g} s per phase, "
        "simulated GPU (1 slot; 46 ms + 4 ms per item; thermal time x"
        f"{o['time_scale']:g})",
        "workload: repeated, near-duplicate and fresh chat prompts (temperature 0) and "
        "single-input embedding calls",
        "",
        *compared(direct, gateway, ROWS),
    ]
    if "cache_hits" in gateway:
        lines += [
            "",
            f"where the GPU calls went: {gateway['cache_hits']} answers from the cache "
            f"({gateway['cache_hits_simhash']} of them near-duplicates), "
            f"{gateway['coalesced']} requests joined an identical one in flight, and "
            f"embeddings went in {gateway['batched_calls']} batched calls of "
            f"{gateway['mean_batch_size']:g} inputs on average",
        ]
    if "thermal" in result:
        lines += ["", format_thermal(result["thermal"])]
    if "coldstart" in result:
        lines += ["", format_coldstart(result["coldstart"])]
    lines += ["", "Every number above was measured in this run."]
    return "\n".join(lines)


async def run_demo(options: DemoOptions) -> dict[str, Any]:
    """Run every scene; returns the measured numbers."""
    direct = await _phase(options, through_gateway=False)
    via = await _phase(options, through_gateway=True)
    thermal = await run_thermal()
    coldstart = await run_coldstart()
    return {
        "options": dataclasses.asdict(options),
        "direct": direct,
        "gateway": via,
        "thermal": thermal,
        "coldstart": coldstart,
    }


def render(result: dict[str, Any], as_json: bool) -> str:
    return json.dumps(result, indent=2) if as_json else format_table(result)
