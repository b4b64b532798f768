"""deploy/grafana/gateway.json is an importable Grafana dashboard over names that exist.

Its shape is checked as Grafana's dashboard model has it (unique panel ids, a grid
position each, every query on the `${datasource}` variable), and every PromQL expression
is read token by token: each metric it names must be in a running gateway's `/metrics`,
each label it matches, groups by or shows in a legend must be one that metric carries.
Where a ``prometheus`` binary is installed, a real Prometheus scrapes that gateway and
evaluates every query (Grafana itself cannot be installed here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.metrics.reference import families
from tests.helpers import chat, write_policy
from tests.upstreams import Exporter, Recorder

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "gateway.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
TARGET_LABELS = {"job", "instance"}
"""Labels Prometheus adds to every series it scrapes."""
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk"}
FUNCTIONS = {"rate", "increase", "irate", "histogram_quantile", "vector", "clamp_min", "abs"}
KEYWORDS = {"by", "without", "or", "and", "unless", "bool", "offset", "on", "ignoring"}
GROUPING = {"by", "without", "on", "ignoring"}
TOKEN = re.compile(
    r'(?P<string>"(?:[^"\\]|\\.)*")|(?P<range>\[[^\]]*\])|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)'
    r"|(?P<number>\d+(?:\.\d+)?)|(?P<other>\S)"
)
SUFFIXES = {"_bucket": {"histogram"}, "_sum": {"histogram"}, "_count": {"histogram"}}
"""The series a histogram is exposed as, besides its family's HELP and TYPE lines."""


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", ())  # a collapsed row holds its panels


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(panel title, expression, legend) of every query."""
    for panel in panels(dashboard):
        for target in panel.get("targets", ()):
            yield panel["title"], target["expr"], target.get("legendFormat", "")


class Query:
    """What one PromQL expression names: metrics, each with the labels it matches on, the
    labels it groups by, and the functions it calls."""

    def __init__(self, expr: str) -> None:
        self.metrics: list[tuple[str, set[str]]] = []
        self.grouped: set[str] = set()
        self.functions: set[str] = set()
        tokens = [(m.lastgroup, m.group()) for m in TOKEN.finditer(expr)]
        i = 0
        while i < len(tokens):
            kind, text = tokens[i]
            after = tokens[i + 1][1] if i + 1 < len(tokens) else ""
            if kind != "name" or text in AGGREGATIONS or text in KEYWORDS - GROUPING:
                i += 1
            elif text in GROUPING:
                i = self._label_list(tokens, i + 1, self.grouped)
            elif after == "(":
                self.functions.add(text)
                i += 1
            else:
                matched: set[str] = set()
                i = self._label_list(tokens, i + 1, matched) if after == "{" else i + 1
                self.metrics.append((text, matched))

    @staticmethod
    def _label_list(tokens: list[tuple[str | None, str]], i: int, into: set[str]) -> int:
        """Read `(a, b)` or `{a="x", b=~"y"}` from ``i``: the label names; the index after."""
        close = {"(": ")", "{": "}"}[tokens[i][1]]
        i += 1
        while tokens[i][1] != close:
            kind, text = tokens[i]
            if kind == "name":
                into.add(text)
            i += 1
        return i + 1


def test_the_tokenizer_reads_names_labels_and_functions():
    q = Query(
        'histogram_quantile(0.99, sum by (route, le) (rate(gateway_x_bucket{job=~"$job", '
        'route=~"a|b"}[$__rate_interval]))) / (sum(process_y) or vector(0))'
    )
    assert q.metrics == [("gateway_x_bucket", {"job", "route"}), ("process_y", set())]
    assert q.grouped == {"route", "le"}
    assert q.functions == {"histogram_quantile", "rate", "vector"}


def test_the_dashboard_has_grafanas_shape():
    d = load()
    assert d["schemaVersion"] >= 39 and d["uid"] and d["title"]
    assert [i["pluginId"] for i in d["__inputs"]] == ["prometheus"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("job", "route", "backend"):
        assert variables[name]["type"] == "query"
        assert variables[name]["datasource"] == DATASOURCE
        assert variables[name]["definition"].startswith("label_values(")
    ids = [p["id"] for p in panels(d)]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) for i in ids)
    cells: set[tuple[int, int]] = set()
    for panel in panels(d):
        pos = panel["gridPos"]
        assert {"h", "w", "x", "y"} <= set(pos) and pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {
            (x, y)
            for x in range(pos["x"], pos["x"] + pos["w"])
            for y in range(pos["y"], pos["y"] + pos["h"])
        }
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] == "row":
            assert not panel.get("targets"), panel["title"]
            continue
        assert panel["datasource"] == DATASOURCE, panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == DATASOURCE, panel["title"]


def test_every_expression_uses_only_known_functions_and_names_a_metric():
    for title, expr, _ in expressions(load()):
        query = Query(expr)
        assert query.functions <= FUNCTIONS, (title, query.functions - FUNCTIONS)
        assert query.metrics, (title, expr)
        for name, _ in query.metrics:
            assert re.fullmatch(r"(gateway|process|python)_\w+", name), (title, name)


SERIES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
"""The series names a family of each type is queried by."""


def labels_of(name: str, known: dict[str, tuple[str, set[str]]]) -> set[str]:
    """The labels of a series a query names (``le`` on a histogram's buckets); a name no
    family is queried by (a counter without `_total`, a histogram's bare name) fails."""
    for stem, (kind, labels) in known.items():
        for suffix in SERIES[kind]:
            if name == stem + suffix:
                return labels | ({"le"} if suffix == "_bucket" else set())
    raise AssertionError(f"{name}: no family is queried by this name")


def test_every_label_matched_grouped_or_shown_is_one_the_metric_carries():
    known = {f.name: (f.type, set(f.labels)) for f in families()}
    for title, expr, legend in expressions(load()):
        query = Query(expr)
        carried = set().union(*(labels_of(n, known) for n, _ in query.metrics)) | TARGET_LABELS
        for name, matched in query.metrics:
            assert matched <= labels_of(name, known) | TARGET_LABELS, (title, name, matched)
        assert query.grouped <= carried, (title, query.grouped - carried)
        shown = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert shown <= (query.grouped or carried), (title, shown)


def test_the_variables_read_labels_their_metric_carries():
    known = {f.name: (f.type, set(f.labels)) for f in families()}
    for variable in load()["templating"]["list"]:
        if variable["type"] != "query":
            continue
        found = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["definition"])
        assert found, variable["definition"]
        query = Query(found.group(1))
        assert len(query.metrics) == 1
        assert found.group(2) in labels_of(query.metrics[0][0], known) | TARGET_LABELS


def test_the_rows_cover_what_an_operator_asks_of_a_gateway():
    used = {name for _, expr, _ in expressions(load()) for name, _ in Query(expr).metrics}
    for name in (
        "gateway_requests_total",
        "gateway_request_duration_seconds_bucket",
        "gateway_upstream_duration_seconds_bucket",
        "gateway_cache_lookups_total",
        "gateway_coalesced_requests_total",
        "gateway_batch_size_sum",
        "gateway_queue_depth",
        "gateway_queue_wait_seconds_bucket",
        "gateway_shed_total",
        "gateway_fallbacks_total",
        "gateway_breaker_state",
        "gateway_throttle_active",
        "gateway_gpu_temperature_celsius",
        "gateway_gpu_memory_used_ratio",
        "gateway_kv_cache_usage_ratio",
        "gateway_gpu_power_ratio",
        "gateway_throttle_threshold",
        "gateway_telemetry_age_seconds",
        "gateway_policy_generation",
        "gateway_policy_reload_failures_total",
        "gateway_event_loop_lag_seconds_bucket",
        "gateway_build_info",
        "process_resident_memory_bytes",
    ):
        assert name in used, name


def exposed_names(text: str) -> tuple[set[str], dict[str, str]]:
    """Sample names, and the type of each family named by a TYPE line (a labelled metric
    with no series yet has its HELP and TYPE lines only)."""
    samples: set[str] = set()
    typed: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            typed[name] = kind
        elif line and not line.startswith("#"):
            samples.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return samples, typed


def exposes(name: str, samples: set[str], typed: dict[str, str]) -> bool:
    """Whether a query for ``name`` selects series of this exposition (a histogram's bare
    family name selects none)."""
    if name in samples or typed.get(name) in ("counter", "gauge"):
        return True
    return any(
        name.endswith(suffix) and typed.get(name[: -len(suffix)]) in kinds
        for suffix, kinds in SUFFIXES.items()
    )


def test_exposes_reads_histograms_by_their_family_only():
    samples, typed = exposed_names(
        "# HELP h_seconds t\n# TYPE h_seconds histogram\n# TYPE c_total counter\nc_total 1.0\n"
    )
    assert exposes("h_seconds_bucket", samples, typed) and exposes("c_total", samples, typed)
    assert not exposes("c_bucket", samples, typed) and not exposes("h_total", samples, typed)
    assert not exposes("h_seconds", samples, typed)


def rich_policy(upstream: str, exporter: str) -> dict[str, Any]:
    """Two backends, a cache, a fallback, admission, a breaker, telemetry and a throttle rule,
    so the labelled series the dashboard reads exist."""
    return {
        "backends": {
            "main": {
                "url": upstream,
                "max_concurrency": 4,
                "queue": {"capacity": 8, "timeout_ms": 1000},
                "circuit_breaker": {"failure_rate": 0.5},
                "telemetry": {"source": "prometheus", "url": exporter + "/metrics"},
            },
            "spare": {"url": upstream},
        },
        "routes": [
            {
                "name": "chat",
                "match": {"path": "/v1/chat/*"},
                "backend": "main",
                "fallback": ["spare"],
                "cache": {"ttl_s": 60},
            },
            {"name": "rest", "match": {"path": "*"}, "backend": "main"},
        ],
        "throttle": [
            {
                "name": "hot",
                "backend": "main",
                "when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80},
            }
        ],
    }


async def test_every_metric_the_dashboard_queries_is_in_a_running_gateways_metrics(
    serve_app, start_gateway, tmp_path
):
    upstream = await serve_app(Recorder().app())
    exporter = await serve_app(Exporter().app())
    policy = write_policy(tmp_path, rich_policy(upstream, exporter))
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await client.post(gw.url + "/v1/chat/completions", json=chat())).status_code == 200
        text = (await client.get(gw.admin_url + "/metrics")).text
    samples, typed = exposed_names(text)
    assert "gateway_requests_total" in samples  # labelled series, not only HELP and TYPE
    assert 'gateway_throttle_threshold{backend="main",bound="above"' in text
    d = load()
    queried = {name for _, expr, _ in expressions(d) for name, _ in Query(expr).metrics}
    for variable in d["templating"]["list"]:
        found = re.fullmatch(r"label_values\((.+),\s*\w+\)", variable.get("definition", ""))
        if found:
            queried |= {name for name, _ in Query(found.group(1)).metrics}
    missing = sorted(n for n in queried if not exposes(n, samples, typed))
    assert missing == []


def promql(expr: str, **values: str) -> str:
    """An expression with Grafana's variables filled in as the dashboard's defaults do."""
    given = {"job": "gateway", "route": ".*", "backend": ".*", **values}
    return re.sub(r"\$(\w+)", lambda m: given[m.group(1)], expr)


@pytest.mark.prometheus
async def test_every_query_evaluates_on_a_prometheus_scraping_a_running_gateway(
    serve_app, start_gateway, tmp_path, unused_tcp_port
):
    """Grafana cannot be installed here, Prometheus can: it scrapes a gateway with traffic,
    and every query of every panel must evaluate without error, the main ones to series."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary on PATH (Debian: apt-get install prometheus)")
    upstream = await serve_app(Recorder().app())
    exporter = await serve_app(Exporter().app())
    gw = await start_gateway(policy=write_policy(tmp_path, rich_policy(upstream, exporter)))
    config = tmp_path / "prometheus.yml"
    target = gw.admin_url.removeprefix("http://")
    every = {"scrape_interval": "250ms", "scrape_timeout": "250ms"}
    jobs = [{"job_name": "gateway", **every, "static_configs": [{"targets": [target]}]}]
    config.write_text(json.dumps({"global": every, "scrape_configs": jobs}))
    with (tmp_path / "prometheus.log").open("wb") as log:
        server = await asyncio.create_subprocess_exec(
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{unused_tcp_port}",
            stdout=log,
            stderr=log,
        )
    prometheus = f"http://127.0.0.1:{unused_tcp_port}"
    try:
        async with httpx.AsyncClient(timeout=10) as client:

            async def query(expr: str) -> dict[str, Any]:
                answer = await client.get(prometheus + "/api/v1/query", params={"query": expr})
                assert answer.json()["status"] == "success", (expr, answer.text)
                return answer.json()["data"]

            async def ready() -> bool:
                with contextlib.suppress(httpx.TransportError):
                    return (await client.get(prometheus + "/-/ready")).status_code == 200
                return False

            scraped = 'count_over_time(up{job="gateway"}[1m]) >= 8'  # enough for rate()
            async with asyncio.timeout(30):  # a guard, not a measure
                while not await ready():
                    await asyncio.sleep(0.05)
                while not (await query(scraped))["result"]:
                    for tag in ("same", "same", "other"):  # cacheable: misses, then hits
                        sent = chat(tag, temperature=0)
                        await client.post(gw.url + "/v1/chat/completions", json=sent)
                    await asyncio.sleep(0.05)
            answered: dict[str, int] = {}
            for title, expr, _ in expressions(load()):
                data = await query(promql(expr, __rate_interval="2s", __range="1m"))
                answered[title] = answered.get(title, 0) + len(data["result"])
    finally:
        server.terminate()
        await server.wait()
    for title in (
        "Version",
        "Requests per second by route",
        "Request latency by route (p50, p99)",
        "Cache hits by tier",
        "GPU temperature",
        "Event-loop lag (p50, p99)",
        "Resident memory",
    ):
        assert answered[title] > 0, title
