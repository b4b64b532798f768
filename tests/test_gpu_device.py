"""A real GPU through a gateway (without sockets): the nvml source publishes the device's readings
(skipped unless NVML finds a device; run on a GPU machine with ``-m gpu``)."""

from __future__ import annotations

import pytest

from gateway.resilience.gpu import TELEMETRY
from tests.backends import Model, post
from tests.helpers import policy, poll


@pytest.mark.gpu
async def test_a_real_gpu_feeds_the_gateways_gauges(pipeline):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        pytest.skip(f"NVML finds no device here: {exc}")
    pynvml.nvmlShutdown()
    main = Model("main")
    backends = {
        "main": {
            "url": "http://main.test",
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
    gw = await pipeline(policy(backends, throttle=rules), main)
    await poll(gw)
    item = gw.gateway.registry.peek(TELEMETRY, "main")
    print(item.telemetry.sample)
    assert (await post(gw, "hi")).status_code == 200
    temperature = gw.metric("gateway_gpu_temperature_celsius", backend="main")
    assert temperature is not None and 5 <= temperature <= 110
    used = gw.metric("gateway_gpu_memory_used_ratio", backend="main")
    assert used is not None and 0 < used <= 1
    utilization = gw.metric("gateway_gpu_utilization_ratio", backend="main")
    assert utilization is not None and 0 <= utilization <= 1
    age = gw.metric("gateway_telemetry_age_seconds", backend="main")
    assert age is not None and age < 5
    await gw.gateway.shutdown(0.5)
    assert not item.poller.running
