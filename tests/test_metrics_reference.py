"""docs/metrics.md is generated from the registry (`gateway metrics --markdown`), so it names
every metric family with its type, labels and meaning and cannot drift from the code."""

from __future__ import annotations

import json
from pathlib import Path

from gateway.cli import main
from gateway.metrics import Metrics, names
from gateway.metrics.reference import NOTES, families, reference_markdown, supervisor_families
from gateway.testing import json_reply
from gateway.testing.harness import Pipeline
from tests.helpers import chat

ROOT = Path(__file__).resolve().parent.parent
POLICY = """
backends:
  main: {url: "http://main.test", max_concurrency: 4, circuit_breaker: {failure_rate: 0.5}}
routes: [{name: chat, match: {path: "/v1/*"}, backend: main, cache: {ttl_s: 60}}]
"""


def test_docs_metrics_md_is_generated_from_the_registry():
    """Regenerate it with `gateway metrics --markdown > docs/metrics.md`."""
    assert (ROOT / "docs" / "metrics.md").read_text() == reference_markdown()


def test_the_page_has_every_family_and_notes_only_families_that_exist():
    page = reference_markdown()
    every = families()
    assert [f.name for f in every] != [] and sorted(f.name for f in every) == names(Metrics())
    for family in every:
        assert f"| `{family.exposed}` | {family.type} | {', '.join(family.labels)} |" in page
        assert family.help.strip(), family.name
    assert set(NOTES) <= {f.name for f in every}


def test_the_page_ends_with_the_supervisors_own_families():
    page = reference_markdown()
    shown = supervisor_families()
    assert [f.exposed for f in shown] == ["gateway_workers", "gateway_worker_restarts_total"]
    table = page[page.index("## The supervisor") :]
    for family in shown:
        assert f"| `{family.exposed}` | {family.type} |  |" in table


def test_counters_are_shown_by_their_exposed_name():
    shown = {f.name: f.exposed for f in families()}
    assert shown["gateway_requests"] == "gateway_requests_total"
    assert shown["process_cpu_seconds"] == "process_cpu_seconds_total"
    assert shown["gateway_request_duration_seconds"] == "gateway_request_duration_seconds"


async def test_the_labels_shown_are_the_labels_the_series_carry():
    """Labels come from the metric objects even before a series exists; once series exist,
    each carries exactly the labels the page shows (``le`` aside)."""
    declared = {f.name: set(f.labels) for f in families()}
    assert declared["gateway_shed"] == {"backend", "reason"}
    assert declared["gateway_cache_embedding_shared"] == {"route", "event"}
    assert declared["gateway_event_loop_lag_seconds"] == set()
    async with Pipeline(POLICY, {"main": lambda sent: json_reply({"id": "c"})}) as gw:
        for _ in range(2):  # a miss, then a hit
            assert (await gw.post("/v1/chat/completions", chat("hello"))).status_code == 200
        collected = list(gw.gateway.metrics.registry.collect())
    checked = 0
    for family in collected:
        for sample in family.samples:
            assert set(sample.labels) - {"le"} == declared[family.name], sample
            checked += 1
    assert checked > 50


def test_gateway_metrics_prints_the_page_or_the_families_as_json(capsys):
    assert main(["metrics", "--markdown"]) == 0
    assert capsys.readouterr().out == reference_markdown()
    assert main(["metrics"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [f["name"] for f in printed] == [f.name for f in families()]
    assert printed[0] == {
        "name": "gateway_requests",
        "exposed": "gateway_requests_total",
        "type": "counter",
        "labels": ["route", "backend", "status"],
        "help": "Requests answered, by route, backend and HTTP status.",
    }
