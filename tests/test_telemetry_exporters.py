"""Telemetry from exporters as they are deployed: MIG instances apart, a node-wide exporter
selected by pod and namespace (one ConfigMap for every replica), dcgm-exporter's old
namespace, a warning when several GPUs are read with no selector, and a rule whose signal
the exporter never reports (the stock counters) said to be unknown."""

from __future__ import annotations

import logging
import textwrap

import httpx
import pytest
from aiohttp import web

from gateway.policy import parse_policy_text
from gateway.policy.load import parse_sources
from gateway.resilience.gpu import TELEMETRY
from gateway.telemetry import Selector, parse_exposition, read_series, signals_from
from tests.helpers import until, write_policy


def series(text: str):
    return parse_exposition(textwrap.dedent(text))


MIG = """\
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",device="nvidia0"} 36000
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="1",device="nvidia0"} 4000
DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",device="nvidia0"} 400
DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a",GPU_I_PROFILE="3g.40gb",GPU_I_ID="2",device="nvidia0"} 39600
"""


def test_mig_instances_are_separate_devices_whatever_the_line_order():
    """Series that differ only in GPU_I_ID used to collapse, the last line winning (0.01 or
    0.9 depending on order): each instance is a device of its own."""
    forward = read_series(series(MIG))
    backward = read_series(series("\n".join(reversed(MIG.splitlines()))))
    assert len(forward.devices) == len(backward.devices) == 2
    assert forward.signals["gpu_memory_used_ratio"] == pytest.approx(0.9)
    assert backward.signals == forward.signals
    one = signals_from(series(MIG), Selector(gpu_instance="2"))
    assert one["gpu_memory_used_ratio"] == pytest.approx(0.01)


NODE_WIDE = """\
DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",pod="model-server-7d9f-abc",namespace="ml",container="vllm"} 62
DCGM_FI_DEV_GPU_TEMP{gpu="1",UUID="GPU-b",pod="model-server-7d9f-xyz",namespace="ml",container="vllm"} 91
DCGM_FI_DEV_GPU_TEMP{gpu="2",UUID="GPU-c",pod="trainer-0",namespace="research",container="train"} 88
"""


def test_a_node_wide_exporter_is_read_for_this_pod_alone():
    mine = Selector(labels=(("pod", "model-server-7d9f-abc"), ("namespace", "ml")))
    assert signals_from(series(NODE_WIDE), mine) == {"gpu_temperature_c": 62}
    assert signals_from(series(NODE_WIDE)) == {"gpu_temperature_c": 91}  # the hottest wins
    nobody = Selector(labels=(("pod", "gone"),))
    assert signals_from(series(NODE_WIDE), nobody) == {}


def test_the_old_namespace_and_its_lower_case_uuid_are_read():
    old = """\
    dcgm_gpu_temp{gpu="0",uuid="GPU-a"} 84
    dcgm_fb_used{gpu="0",uuid="GPU-a"} 60000
    dcgm_fb_free{gpu="0",uuid="GPU-a"} 20000
    dcgm_gpu_utilization{gpu="0",uuid="GPU-a"} 50
    dcgm_power_usage{gpu="0",uuid="GPU-a"} 300
    dcgm_power_management_limit{gpu="0",uuid="GPU-a"} 400
    dcgm_clock_throttle_reasons{gpu="0",uuid="GPU-a"} 32
    dcgm_gpu_temp{gpu="1",uuid="GPU-b"} 40
    """
    found = signals_from(series(old), Selector(gpu="GPU-a"))
    assert found == {
        "gpu_temperature_c": 84,
        "gpu_memory_used_ratio": 0.75,
        "gpu_utilization": 0.5,
        "gpu_power_ratio": 0.75,
        "gpu_thermal_throttling": 1.0,
    }


def test_the_selector_expands_the_downward_api_from_the_environment(monkeypatch):
    monkeypatch.setenv("POD_NAME", "model-server-7d9f-abc")
    monkeypatch.setenv("POD_NAMESPACE", "ml")
    policy = parse_policy_text(
        textwrap.dedent(
            """\
            backends:
              main:
                url: http://127.0.0.1:8000
                telemetry:
                  source: prometheus
                  url: http://dcgm-exporter:9400/metrics
                  select: {pod: "${POD_NAME}", namespace: "${POD_NAMESPACE}"}
            """
        )
    )
    assert policy.backends[0].telemetry.select == (
        ("pod", "model-server-7d9f-abc"),
        ("namespace", "ml"),
    )


@pytest.fixture
async def exporter(serve_app):
    pages: dict[str, str] = {}

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=pages.get(request.match_info["page"], ""))

    app = web.Application()
    app.router.add_get("/{page}", metrics)
    return pages, await serve_app(app)


async def test_several_gpus_and_no_selector_warn_once(exporter, start_gateway, tmp_path, caplog):
    pages, url = exporter
    pages["node"] = textwrap.dedent(NODE_WIDE)
    policy = write_policy(
        tmp_path,
        f"""
        backends:
          main:
            url: "{url}"
            telemetry: {{source: prometheus, url: "{url}/node", interval_ms: 50}}
        routes: [{{backend: main}}]
        """,
    )
    with caplog.at_level(logging.WARNING, logger="gateway.telemetry"):
        gw = await start_gateway(policy=policy)
        telemetry = gw.gateway.registry.peek(TELEMETRY, "main").telemetry
        await until(lambda: telemetry.samples >= 4)
    warnings = [r.getMessage() for r in caplog.records if "sees 3 GPUs" in r.getMessage()]
    assert len(warnings) == 1 and "hottest GPU of the node wins" in warnings[0]


STOCK = 'DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a"} 60\nDCGM_FI_DEV_POWER_USAGE{gpu="0",UUID="GPU-a"} 300\n'


async def test_a_rule_whose_signal_is_never_seen_is_said_to_be_unknown(
    exporter, start_gateway, tmp_path, caplog
):
    """The stock dcgm-exporter counters have no power limit: a rule on gpu_power_ratio can
    never fire.  It is a warning at load, and once the exporter has been read a few times,
    a warning again, a metric of 0 and `unknown` in GET /policy."""
    pages, url = exporter
    pages["stock"] = STOCK
    text = f"""
        backends:
          main:
            url: "{url}"
            telemetry: {{source: prometheus, url: "{url}/stock", interval_ms: 50}}
          spare: {{url: "{url}"}}
        routes: [{{backend: main, fallback: [spare]}}]
        throttle:
          - {{name: power, backend: main, when: {{signal: gpu_power_ratio, above: 0.95, clear_below: 0.9}}, action: reroute}}
          - {{name: heat, backend: main, when: {{signal: gpu_temperature_c, above: 85, clear_below: 80}}, action: reroute}}
        """
    loaded = parse_sources([("p.yaml", textwrap.dedent(text))])
    [warning] = loaded.warnings
    assert "throttle[0].when.signal" in str(warning) and "dcgm-counters.csv" in str(warning)
    with caplog.at_level(logging.WARNING):
        gw = await start_gateway(policy=write_policy(tmp_path, text))
        telemetry = gw.gateway.registry.peek(TELEMETRY, "main").telemetry
        await until(lambda: telemetry.samples >= 4)
    seen = gw.gateway.metrics.throttle_signal_seen
    assert seen.labels("power", "main")._value.get() == 0
    assert seen.labels("heat", "main")._value.get() == 1
    said = [r.getMessage() for r in caplog.records if "cannot fire" in r.getMessage()]
    assert len(said) == 1 and "'power'" in said[0] and "DCGM_FI_DEV_POWER_MGMT_LIMIT" in said[0]
    async with httpx.AsyncClient() as client:
        shown = (await client.get(gw.admin_url + "/policy")).json()["throttle_signals"]
    assert {s["rule"]: s["status"] for s in shown} == {"power": "unknown", "heat": "seen"}
