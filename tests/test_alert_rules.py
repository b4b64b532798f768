"""The alert rules (deploy/prometheus/gateway-rules.yml and the PrometheusRule in deploy/k8s/):
promtool accepts them and their unit tests pass, the two files hold the same groups, every
rule is labelled, annotated, documented and tested, and reads only metrics the gateway
exports."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.metrics import Metrics
from gateway.metrics.merged import SupervisorMetrics

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "gateway-rules.yml"
RULE_TESTS = sorted((ROOT / "deploy" / "prometheus" / "tests").glob("*.yml"))
PROMETHEUS_RULE = ROOT / "deploy" / "k8s" / "prometheus-rules.yaml"
KUSTOMIZATION = ROOT / "deploy" / "k8s" / "kustomization.yaml"
DOC = ROOT / "docs" / "observability.md"
SEVERITIES = {"critical", "warning", "info"}
RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
# PromQL words in the expressions that are not metric names.
PROMQL_WORDS = {
    "absent",
    "and",
    "by",
    "count",
    "histogram_quantile",
    "increase",
    "max",
    "on",
    "or",
    "rate",
    "sum",
    "unless",
}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def _groups() -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = yaml.safe_load(RULES.read_text())["groups"]
    return groups


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _groups() for rule in group["rules"]]


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian package prometheus)")
    return subprocess.run(
        [promtool, *args], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False
    )


def _series_names(expr: str) -> set[str]:
    """The metric names an expression selects: what is left once strings, label lists,
    ranges, numbers and PromQL's own words are taken out."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr))
    return words - PROMQL_WORDS


def _exported_series() -> set[str]:
    """Every series name the gateway exposes (``names``, suffixed by each family's type),
    the supervisor's own with ``--workers`` too, and Prometheus' own ``up``."""
    metrics = Metrics()
    families = [*metrics.registry.collect(), *SupervisorMetrics().registry.collect()]
    types = {family.name: family.type for family in families}
    return {"up"} | {name + suffix for name in types for suffix in SUFFIXES.get(types[name], ("",))}


def _heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors for the headings of a Markdown page (enough for these headings)."""
    anchors = set()
    for line in markdown.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


def test_promtool_checks_the_rules_file() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_rules())} rules found" in result.stdout


def test_the_promtool_unit_tests_pass() -> None:
    assert RULE_TESTS
    result = _promtool("test", "rules", *(str(path) for path in RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_TESTS)


def test_the_prometheus_rule_is_an_operator_resource_with_the_plain_files_groups() -> None:
    """The CRD has no bundled schema: its shape is checked as the operator reads it."""
    docs = [doc for doc in yaml.safe_load_all(PROMETHEUS_RULE.read_text()) if doc is not None]
    assert len(docs) == 1
    rule = docs[0]
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["kind"] == "PrometheusRule"
    assert set(rule) == {"apiVersion", "kind", "metadata", "spec"}
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", rule["metadata"]["name"])
    assert set(rule["spec"]) == {"groups"}
    for group in rule["spec"]["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["rules"]
        for item in group["rules"]:
            assert set(item) <= RULE_KEYS and isinstance(item["expr"], str)
    assert rule["spec"]["groups"] == _groups()


def test_the_prometheus_rule_stays_out_of_the_kustomization() -> None:
    """`kubectl apply -k deploy/k8s` must work on a cluster without the operator's CRDs."""
    resources = yaml.safe_load(KUSTOMIZATION.read_text())["resources"]
    assert PROMETHEUS_RULE.name not in resources


def test_every_rule_is_named_labelled_and_annotated_with_a_runbook_in_the_docs() -> None:
    rules = _rules()
    assert len(rules) >= 10
    alerts = [rule["alert"] for rule in rules]
    assert len(set(alerts)) == len(alerts)
    anchors = _heading_anchors(DOC.read_text())
    for rule in rules:
        assert set(rule) <= RULE_KEYS, rule["alert"]
        assert rule["labels"]["severity"] in SEVERITIES, rule["alert"]
        annotations = rule["annotations"]
        assert {"summary", "description", "runbook_url"} <= set(annotations), rule["alert"]
        page, _, anchor = annotations["runbook_url"].partition("#")
        assert page == "docs/observability.md" and anchor == rule["alert"].lower()
        assert anchor in anchors, f"no runbook heading for {rule['alert']}"


def test_every_rule_has_a_promtool_test_that_makes_it_fire() -> None:
    tested: set[str] = set()
    fired: set[str] = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            for check in case.get("alert_rule_test", []):
                tested.add(check["alertname"])
                if check.get("exp_alerts"):
                    fired.add(check["alertname"])
    alerts = {rule["alert"] for rule in _rules()}
    assert alerts <= tested, f"untested: {sorted(alerts - tested)}"
    assert alerts <= fired, f"never shown firing: {sorted(alerts - fired)}"
    assert tested <= alerts, f"tests of no rule: {sorted(tested - alerts)}"


def test_every_metric_a_rule_reads_is_one_the_gateway_exports() -> None:
    exported = _exported_series()
    for rule in _rules():
        read = _series_names(rule["expr"])
        assert read, rule["alert"]
        assert read <= exported, f"{rule['alert']} reads {sorted(read - exported)}"


def test_the_series_names_of_an_expression_are_found() -> None:
    """The name finder the test above relies on: functions, labels and ranges are not names."""
    expr = (
        'histogram_quantile(0.99, sum by (job, le) (rate(a_bucket{status=~"5..", x="y"}[5m])))'
        " > 3 unless on (instance) b or c != c"
    )
    assert _series_names(expr) == {"a_bucket", "b", "c"}
