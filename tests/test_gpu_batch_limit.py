"""A throttle rule's ``limit: {batch_max_size}`` caps the batch size while it holds."""

from __future__ import annotations

import asyncio

import httpx

from gateway.batching.aimd import CappedLimit, FixedLimit
from gateway.sim import SimConfig, start_sim
from gateway.testing import FakeClock
from tests.helpers import INTERVAL_MS, metric, poll, write_policy
from tests.upstreams import Exporter


def test_capped_limit_holds_the_inner_limit_under_the_cap_only_while_set():
    cap: list[int | None] = [None]
    limit = CappedLimit(FixedLimit(16), lambda: cap[0])
    assert limit.limit == 16
    cap[0] = 4
    assert limit.limit == 4 and limit.max_size == 16
    limit.backoff_to(2)  # an OOM back-off still reaches the inner limit
    cap[0] = None
    assert limit.limit == 2


async def test_hot_gpu_rule_caps_the_batch_size(serve_app, start_gateway, tmp_path):
    sim = await start_sim(SimConfig(port=0, base_ms=40, per_item_ms=1))
    exporter = Exporter()
    exporter_url = await serve_app(exporter.app())
    try:
        policy = {
            "backends": {
                "main": {
                    "url": sim.url,
                    "telemetry": {
                        "source": "prometheus",
                        "url": exporter_url + "/metrics",
                        "interval_ms": INTERVAL_MS,
                    },
                }
            },
            "routes": [
                {
                    "name": "emb",
                    "match": {"path": "/v1/embeddings"},
                    "backend": "main",
                    "batch": {"max_size": 16, "max_wait_ms": 50},
                }
            ],
            "throttle": [
                {
                    "name": "warm",
                    "backend": "main",
                    "action": "limit",
                    "limit": {"batch_max_size": 2},
                    "when": {"signal": "gpu_temperature_c", "above": 80, "clear_below": 76},
                }
            ],
        }
        gw = await start_gateway(
            policy=write_policy(tmp_path, policy), clock=FakeClock(), watch_interval_s=3600
        )
        exporter.temperature = 90
        await poll(gw)

        async with httpx.AsyncClient() as client:
            answers = await asyncio.gather(
                *(
                    client.post(
                        gw.url + "/v1/embeddings", json={"model": "sim-model", "input": f"text {i}"}
                    )
                    for i in range(12)
                )
            )
        assert [a.status_code for a in answers] == [200] * 12
        text = gw.gateway.metrics.exposition().decode()
        count = metric(text, "gateway_batch_size_count", route="emb")
        at_most_two = metric(text, "gateway_batch_size_bucket", route="emb", le="2.0")
        assert count and count == at_most_two  # no batch above the cap
        assert sim.state()["calls"] >= 6
    finally:
        await sim.close()
