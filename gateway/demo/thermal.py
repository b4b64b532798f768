"""The demo's thermal scene: a simulated GPU heats under sustained load; alone it passes the
85 C limit, behind the gateway with a ``gpu-hot`` reroute rule it holds below it while a
spare backend takes the overflow.

The rule fires at 83 C, not at 85: a rule reacts to a sample, and heat keeps coming between
the crossing and the end of the call the GPU is running then (up to one polling interval
plus one call: about 1 C at the scene's heating rate).  The margin is that overshoot.  The
gateway holds the queue (``max_concurrency: 1``) rather than the GPU, so calls still waiting
when the rule fires are rerouted too instead of heating the GPU further.

Both sides run at once for ``duration_s``, each against GPUs of its own, with the thermal
time constant scaled down (``thermal_tau_s / time_scale``, 2 s by default) so that minutes
of heating fit in seconds.  The gateway reads the GPU's temperature from the sim's
``/metrics`` (DCGM names) as it would read a DCGM exporter in a pod.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.app import Gateway
from gateway.policy.load import parse_policy_text
from gateway.policy.watch import PolicySource
from gateway.sim import SimConfig, SimServer, start_sim

CHAT = {
    "model": "sim-model",
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "Summarise today's orders."}],
}


@dataclass(frozen=True, slots=True)
class ThermalOptions:
    """How long and how hard the scene heats, and the rule it runs under."""

    duration_s: float = 8.0
    clients: int = 4
    time_scale: float = 30.0
    thermal_tau_s: float = 60.0
    interval_ms: int = 200
    limit_c: float = 85.0
    above_c: float = 83.0
    clear_c: float = 79.0
    sample_s: float = 0.1


def thermal_policy(primary: str, spare: str, options: ThermalOptions) -> str:
    """The scene's policy: telemetry from the primary's /metrics, one reroute rule."""
    return f"""
backends:
  gpu:
    url: {primary}
    max_concurrency: 1
    queue: {{capacity: 64, timeout_ms: 10000}}
    telemetry: {{source: prometheus, url: "{primary}/metrics", interval_ms: {options.interval_ms}}}
  spare:
    url: {spare}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    backend: gpu
    fallback: [spare]
throttle:
  - name: gpu-hot
    backend: gpu
    when: {{signal: gpu_temperature_c, above: {options.above_c}, clear_below: {options.clear_c}}}
    action: reroute
"""


def sim_config(options: ThermalOptions) -> SimConfig:
    return SimConfig(
        port=0,
        token_ms=1.0,
        time_scale=options.time_scale,
        thermal_tau_s=options.thermal_tau_s,
    )


async def _load(url: str, clients: int, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """Closed-loop clients sending chat requests until ``stop``."""

    async def client(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/chat/completions", json=CHAT) as response:
                    await response.read()
                    key = "ok" if response.status == 200 else "errors"
            except (aiohttp.ClientError, TimeoutError):
                key = "errors"
            counts[key] = counts.get(key, 0) + 1

    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))


async def run_thermal(options: ThermalOptions = ThermalOptions()) -> dict[str, Any]:
    """Run the scene; returns the per-second series and the peaks."""
    config = sim_config(options)
    alone, primary, spare = [await start_sim(config) for _ in range(3)]
    gateway = Gateway(
        PolicySource(fixed=parse_policy_text(thermal_policy(primary.url, spare.url, options)))
    )
    try:
        url, _ = await gateway.start("127.0.0.1", 0, "127.0.0.1", 0, warmup=False)
        return await _measure(options, alone, primary, spare, url)
    finally:
        await gateway.shutdown(1.0)
        for sim in (alone, primary, spare):
            await sim.close()


async def _measure(
    options: ThermalOptions, alone: SimServer, primary: SimServer, spare: SimServer, url: str
) -> dict[str, Any]:
    stop = asyncio.Event()
    direct_counts: dict[str, int] = {}
    gateway_counts: dict[str, int] = {}
    load = [
        asyncio.create_task(_load(alone.url, options.clients, stop, direct_counts)),
        asyncio.create_task(_load(url, options.clients, stop, gateway_counts)),
    ]
    series: list[dict[str, float]] = []
    peaks = {"without": 0.0, "with": 0.0}
    started = time.perf_counter()
    second = 1
    last_calls = (primary.state()["calls"], spare.state()["calls"])
    try:
        while (elapsed := time.perf_counter() - started) < options.duration_s:
            await asyncio.sleep(options.sample_s)
            without = alone.state()["temperature_c"]
            with_policy = primary.state()["temperature_c"]
            peaks["without"] = max(peaks["without"], without)
            peaks["with"] = max(peaks["with"], with_policy)
            if elapsed + options.sample_s >= second:
                calls = (primary.state()["calls"], spare.state()["calls"])
                served = (calls[0] - last_calls[0], calls[1] - last_calls[1])
                last_calls = calls
                series.append(
                    {
                        "t_s": second,
                        "temp_without_c": round(without, 1),
                        "temp_with_c": round(with_policy, 1),
                        "spare_share": round(served[1] / max(1, sum(served)), 2),
                    }
                )
                second += 1
    finally:
        stop.set()
        await asyncio.gather(*load)
    primary_calls, spare_calls = primary.state()["calls"], spare.state()["calls"]
    return {
        "options": dataclasses.asdict(options),
        "series": series,
        "peak_without_c": round(alone.state()["peak_temperature_c"], 1),
        "peak_with_c": round(primary.state()["peak_temperature_c"], 1),
        "peak_spare_c": round(spare.state()["peak_temperature_c"], 1),
        "spare_share": round(spare_calls / max(1, primary_calls + spare_calls), 2),
        "requests_without": sum(direct_counts.values()),
        "requests_with": sum(gateway_counts.values()),
        "errors_without": direct_counts.get("errors", 0),
        "errors_with": gateway_counts.get("errors", 0),
    }


def format_thermal(result: dict[str, Any]) -> str:
    """The scene as a few lines: one per second, then the peaks."""
    o = result["options"]
    lines = [
        f"thermal scene: {o['clients']} clients for {o['duration_s']:g} s on each side, "
        f"thermal time constant {o['thermal_tau_s'] / o['time_scale']:g} s",
        f"limit {o['limit_c']:g} C; rule gpu-hot: reroute to the spare above {o['above_c']:g} C, "
        f"clear below {o['clear_c']:g} C (telemetry every {o['interval_ms']} ms)",
        f"{'second':>8}{'GPU alone (C)':>16}{'GPU + policy (C)':>19}{'served by spare':>18}",
    ]
    for row in result["series"]:
        lines.append(
            f"{row['t_s']:>8}{row['temp_without_c']:>16.1f}{row['temp_with_c']:>19.1f}"
            f"{row['spare_share']:>18.0%}"
        )
    lines.append(
        f"{'peak':>8}{result['peak_without_c']:>16.1f}{result['peak_with_c']:>19.1f}"
        f"{result['spare_share']:>18.0%}"
    )
    lines.append(
        f"errors: {result['errors_without']} alone, {result['errors_with']} through the gateway"
    )
    return "\n".join(lines)
