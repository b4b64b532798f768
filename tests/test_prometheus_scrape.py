"""A real Prometheus (the Debian package's binary) scraping a real gateway's admin port every
second: the series carry the policy's constant labels, the shipped rules file loads and
evaluates healthy, and a rule fires on what the gateway really exports."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.helpers import write_policy
from tests.upstreams import Recorder

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gateway-rules.yml"
PROMETHEUS = shutil.which("prometheus")
JOB = "sidecar-gateway"
CONST_LABELS = {"model_version": "v7", "gpu_type": "h200"}
DEADLINE_S = 30.0
POLL_S = 0.2

pytestmark = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus is not installed (Debian package prometheus)"
)


def _policy_text(url: str) -> str:
    labels = ", ".join(f"{k}: {v}" for k, v in CONST_LABELS.items())
    return f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{name: chat, match: {{path: "*"}}, backend: main}}]
        metrics: {{const_labels: {{{labels}}}}}
        """


@dataclass
class Prometheus:
    """A running Prometheus: a client for its HTTP API, and its log for failure messages."""

    api: httpx.AsyncClient
    log: Path

    async def until(self, path: str, found: Callable[[Any], Any]) -> Any:
        """Poll ``path`` of the API until ``found(data)`` is truthy, and return that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DEADLINE_S
        last: Any = None
        while loop.time() < deadline:
            with contextlib.suppress(httpx.TransportError):
                response = await self.api.get(path)
                if response.status_code == 200:
                    last = response.json()["data"]
                    result = found(last)
                    if result:
                        return result
            await asyncio.sleep(POLL_S)
        log = self.log.read_text(errors="replace")[-2000:]
        raise AssertionError(f"{path}: not there within {DEADLINE_S} s; last {last!r}\n{log}")


@contextlib.asynccontextmanager
async def _prometheus(tmp_path: Path, admin_url: str, port: int) -> AsyncIterator[Prometheus]:
    """Prometheus on 127.0.0.1:``port`` scraping ``admin_url`` and evaluating the shipped
    rules every second; stopped on the way out."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": JOB,
                "scrape_interval": "1s",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [admin_url.removeprefix("http://")]}],
            }
        ],
    }
    config_path = tmp_path / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "prometheus.log"
    assert PROMETHEUS is not None
    with log_path.open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            PROMETHEUS,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
            stdout=log,
            stderr=log,
        )
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as api:
            yield Prometheus(api, log_path)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def test_prometheus_scrapes_the_policys_constant_labels_and_evaluates_the_rules(
    serve_app, start_gateway, tmp_path, unused_tcp_port
):
    url = await serve_app(Recorder().app())
    gw = await start_gateway(policy=write_policy(tmp_path, _policy_text(url)))
    async with _prometheus(tmp_path, gw.admin_url, unused_tcp_port) as prometheus:
        series = await prometheus.until(
            "/api/v1/query?query=gateway_policy_generation", lambda data: data["result"]
        )
        assert len(series) == 1
        labels = series[0]["metric"]
        assert {k: labels.get(k) for k in CONST_LABELS} == CONST_LABELS
        assert labels["job"] == JOB and labels["instance"] == gw.admin_url.removeprefix("http://")
        assert series[0]["value"][1] == "1"

        def evaluated(data: Any) -> Any:
            rules = [rule for group in data["groups"] for rule in group["rules"]]
            done = rules and all(r["lastEvaluation"] > "0001-01-01T00:00:00Z" for r in rules)
            return data["groups"] if done else None

        groups = await prometheus.until("/api/v1/rules", evaluated)
        shipped = yaml.safe_load(RULES.read_text())["groups"]
        assert [g["name"] for g in groups] == [g["name"] for g in shipped]
        assert [r["name"] for g in groups for r in g["rules"]] == [
            r["alert"] for g in shipped for r in g["rules"]
        ]
        unhealthy = [
            (r["name"], r["health"], r.get("lastError"))
            for g in groups
            for r in g["rules"]
            if r["health"] != "ok"
        ]
        assert unhealthy == []


async def test_a_rejected_reload_fires_its_alert_in_a_real_prometheus(
    serve_app, start_gateway, tmp_path, unused_tcp_port, monkeypatch
):
    """GatewayPolicyReloadFailing over real scrapes: the counter read at 0, then at 1 after a
    reload the gateway refused; the alert carries the policy's constant labels."""
    monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
    url = await serve_app(Recorder().app())
    path = write_policy(tmp_path, _policy_text(url))
    gw = await start_gateway(policy=path, watch_interval_s=3600)
    async with _prometheus(tmp_path, gw.admin_url, unused_tcp_port) as prometheus:
        query = "/api/v1/query?query=gateway_policy_reload_failures_total"
        await prometheus.until(query, lambda data: data["result"])
        path.write_text(path.read_text() + "bogus: 1\n")
        async with httpx.AsyncClient() as client:
            assert (await client.post(gw.admin_url + "/reload")).status_code == 422

        def firing(data: Any) -> Any:
            return [
                alert
                for alert in data["alerts"]
                if alert["labels"]["alertname"] == "GatewayPolicyReloadFailing"
                and alert["state"] == "firing"
            ]

        alerts = await prometheus.until("/api/v1/alerts", firing)
        labels = alerts[0]["labels"]
        assert {k: labels.get(k) for k in CONST_LABELS} == CONST_LABELS
        assert labels["severity"] == "warning"
        assert alerts[0]["annotations"]["runbook_url"].endswith("#gatewaypolicyreloadfailing")
