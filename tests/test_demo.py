"""`gateway demo` end to end (short phases): it measures both paths and reports them."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


async def test_demo_runs_end_to_end_and_its_json_holds_the_numbers(tmp_path):
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "--log-level",
        "error",
        "demo",
        "--duration",
        "1.5",
        "--clients",
        "8",
        "--json",
        cwd=tmp_path,  # any directory: the policy ships inside
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    for phase in ("direct", "gateway"):
        numbers = result[phase]
        assert numbers["requests"] > 0 and numbers["errors"] == 0
        for key in (
            "avg_latency_ms",
            "p95_latency_ms",
            "qps",
            "upstream_calls",
            "gpu_utilization_pct",
            "peak_gpu_temperature_c",
        ):
            assert numbers[key] > 0, key
    cold = result["coldstart"]  # the pool keeps replicas warm; without it a burst waits
    assert cold["with"]["cold_waits"] == 0 and cold["with"]["requests"] > 0
    assert cold["without"]["cold_waits"] > 0
    assert cold["with"]["p99_ms"] < cold["without"]["p99_ms"]


def test_shipped_demo_policy_is_the_one_in_policies():
    from gateway.demo.run import demo_policy_text

    assert demo_policy_text() == (ROOT / "policies" / "demo.yaml").read_text()


def test_each_backend_has_its_own_defaults_unless_given():
    from gateway.demo.run import DemoOptions

    sim = DemoOptions.given(None, None, None, False)
    llama = DemoOptions.given("llama", None, 4, True)
    assert (sim.backend, sim.duration_s, sim.clients) == ("sim", 8.0, 32)
    assert (llama.backend, llama.duration_s, llama.clients, llama.as_json) == (
        "llama",
        30.0,
        4,
        True,
    )


@pytest.mark.llm
async def test_the_demo_on_a_real_model_measures_both_paths(tmp_path):
    """``gateway demo --backend llama``: the chat workload straight at llama.cpp's server and
    through the gateway, each path's answers and the model's own work counted."""
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "gateway", "--log-level", "error", "demo"),
        *("--backend", "llama", "--duration", "4", "--clients", "3", "--json"),
        cwd=tmp_path,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode == 0, err.decode()
    result = json.loads(out)
    assert result["backend"] == "llama"
    for phase in ("direct", "gateway"):
        numbers = result[phase]
        assert numbers["requests"] > 0 and numbers["errors"] == 0, numbers
        assert numbers["tokens_generated"] > 0 and numbers["prompt_tokens_computed"] > 0
    assert {"cache_hits", "coalesced"} <= result["gateway"].keys()
