"""A real GPU through a running gateway: the nvml source publishes the device's readings
(skipped unless NVML finds a device; run on a GPU machine with ``-m gpu``)."""

from __future__ import annotations

import httpx
import pytest

from gateway.resilience.gpu import TELEMETRY
from tests.test_gpu_throttle import poll
from tests.test_stage_resilience import Model, metric, metrics_of, policy, write_policy


@pytest.mark.gpu
async def test_a_real_gpu_feeds_the_gateways_gauges(serve_app, start_gateway, tmp_path):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"NVML finds no device here: {exc}")
    pynvml.nvmlShutdown()
    main = Model("main")
    backends = {
        "main": {
            "url": await serve_app(main.app()),
            "telemetry": {"source": "nvml", "index": 0, "interval_ms": 200},
        }
    }
    # A rule that can never fire on a working GPU: the gateway serves as usual.
    rules = [
        {
            "name": "impossible",
            "backend": "main",
            "action": "shed",
            "when": {"signal": "gpu_temperature_c", "above": 200, "clear_below": 150},
        },
    ]
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, throttle=rules)))
    await poll(gw)
    item = gw.gateway.registry.peek(TELEMETRY, "main")
    print(item.telemetry.sample)
    async with httpx.AsyncClient(timeout=10) as client:
        assert (
            await client.post(
                gw.url + "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
        ).status_code == 200
        text = await metrics_of(client, gw)
    temperature = metric(text, "gateway_gpu_temperature_celsius", backend="main")
    assert temperature is not None and 5 <= temperature <= 110
    used = metric(text, "gateway_gpu_memory_used_ratio", backend="main")
    assert used is not None and 0 < used <= 1
    utilization = metric(text, "gateway_gpu_utilization_ratio", backend="main")
    assert utilization is not None and 0 <= utilization <= 1
    age = metric(text, "gateway_telemetry_age_seconds", backend="main")
    assert age is not None and age < 5
    await gw.gateway.shutdown(0.5)
    assert not item.poller.running
