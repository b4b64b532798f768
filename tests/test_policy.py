"""Policies: typed parsing, errors located by file, key path and line, directory merging,
environment expansion, the JSON Schema and the reference page derived from the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.errors import PolicyError
from gateway.policy import load_policy, parse_policy_text
from gateway.policy.schema import json_schema, reference_markdown
from tests.helpers import problems_of, write_policy

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = """\
backends:
  main:
    url: http://127.0.0.1:8000
    model_version: "llama-3.1-8b@2024-07"
    timeout_s: 120
    warmup: [{path: /v1/chat/completions, body: {model: m, messages: [{role: user, content: hi}], max_tokens: 1}}]
routes:
  - match: {path: "/v1/*", model: "llama*"}
    backend: main
"""


def test_the_issue_minimal_policy_parses_into_frozen_types():
    policy = parse_policy_text(MINIMAL)
    backend = policy.backend("main")
    assert backend.model_version == "llama-3.1-8b@2024-07"
    assert backend.warmup[0].body["max_tokens"] == 1
    assert policy.routes[0].match.model == "llama*"
    with pytest.raises(AttributeError):
        backend.url = "http://elsewhere"  # type: ignore[misc]


def test_unknown_key_is_rejected_with_file_path_line_and_suggestion():
    found = problems_of(MINIMAL.replace("timeout_s: 120", "timout_s: 120"))
    assert found == ["p.yaml:5: backends.main.timout_s: unknown key (did you mean 'timeout_s'?)"]


def test_errors_name_key_paths_inside_lists():
    text = MINIMAL + "  - match: {path: 3, methd: GET}\n    backend: main\n"
    found = problems_of(text)
    assert "p.yaml:10: routes[1].match.methd: unknown key" in found[0]


def test_wrong_types_and_missing_required_keys_are_reported_together():
    found = problems_of("backends:\n  a: {timeout_s: fast}\nroutes: {}\n")
    joined = "\n".join(found)
    assert "backends.a.timeout_s: must be a number, not a string ('fast')" in joined
    assert "backends.a.url: is required" in joined
    assert "routes: must be a list" in joined


def test_a_number_must_be_finite_yamls_nan_and_inf_are_refused():
    """No figure means "not a number" or "without bound": a NaN price would make every
    budget's level NaN, which no comparison refuses."""
    text = "backends:\n  a: {url: 'http://x', timeout_s: .inf, price: {input_per_million: .nan}}\n"
    joined = "\n".join(problems_of(text + "routes: []\n"))
    assert "backends.a.timeout_s: must be a finite number, not inf" in joined
    assert "backends.a.price.input_per_million: must be a finite number, not nan" in joined


def test_route_to_unknown_backend_is_a_cross_reference_error():
    found = problems_of(MINIMAL.replace("backend: main", "backend: mian"))
    assert found == ["p.yaml:9: routes[0].backend: unknown backend 'mian' (known: main)"]


def test_invalid_yaml_is_reported_with_its_line():
    found = problems_of("backends:\n  main: {url: [\n")
    assert found[0].startswith("p.yaml:3: <root>: invalid YAML")


def test_semantic_checks_on_values():
    found = problems_of("backends:\n  a: {url: ftp://x, timeout_s: 0, max_connections: 0}\n")
    joined = "\n".join(found)
    assert "backends.a.url: must start with http:// or https://" in joined
    assert "backends.a.timeout_s: must be greater than 0" in joined
    assert "backends.a.max_connections: must be at least 1" in joined


def test_server_limits_are_checked_with_their_key_paths_and_lines():
    found = problems_of(
        "server:\n"
        "  header_timeout_s: 0\n"
        "  max_connections: -1\n"
        "  max_buffered_body_bytes: 0\n"
        '  trusted_proxies: ["10.0.0.0/8", "not-a-cidr"]\n'
    )
    assert "p.yaml:2: server.header_timeout_s: must be greater than 0" in found
    assert "p.yaml:3: server.max_connections: must be greater than 0" in found
    assert "p.yaml:4: server.max_buffered_body_bytes: must be greater than 0" in found
    assert any("server.trusted_proxies[1]: 'not-a-cidr' is not an IP" in f for f in found)


def test_server_limits_default_to_protect_a_512mi_sidecar():
    server = parse_policy_text("{}").server
    assert (server.header_timeout_s, server.body_timeout_s, server.keepalive_timeout_s) == (
        10.0,
        30.0,
        75.0,
    )
    assert server.client_send_timeout_s == 60.0
    assert server.max_header_bytes == 64 * 1024
    assert server.max_connections * server.max_header_bytes + server.max_buffered_body_bytes <= (
        128 * 1024 * 1024
    )
    assert server.trusted_proxies == ()


def test_directory_merges_backends_and_concatenates_routes_in_name_order(tmp_path):
    (tmp_path / "10-backends.yaml").write_text("backends:\n  a: {url: http://a}\n")
    (tmp_path / "20-routes.yaml").write_text(
        "backends:\n  b: {url: http://b}\nroutes:\n  - {match: {path: /x}, backend: a}\n"
    )
    (tmp_path / "30-more.yml").write_text("routes:\n  - {match: {path: /y}, backend: b}\n")
    (tmp_path / ".hidden.yaml").write_text("not: [valid")
    (tmp_path / "README.txt").write_text("ignored")
    policy = load_policy(tmp_path).policy
    assert [b.name for b in policy.backends] == ["a", "b"]
    assert [r.match.path for r in policy.routes] == ["/x", "/y"]


def test_directory_rejects_a_backend_or_section_defined_twice(tmp_path):
    (tmp_path / "a.yaml").write_text("backends: {x: {url: http://a}}\nserver: {}\n")
    (tmp_path / "b.yaml").write_text("backends: {x: {url: http://b}}\nserver: {}\n")
    with pytest.raises(PolicyError) as info:
        load_policy(tmp_path)
    text = str(info.value)
    assert "b.yaml:1: backends.x: backend 'x' is defined in another file too" in text
    assert "'server' is already set in" in text


def test_env_values_expand_and_missing_ones_are_errors_when_serving(monkeypatch):
    text = MINIMAL.replace("timeout_s: 120", "headers: {X-Key: '${TEST_KEY}'}")
    monkeypatch.delenv("TEST_KEY", raising=False)
    assert "environment variable TEST_KEY is not set" in problems_of(text)[0]
    monkeypatch.setenv("TEST_KEY", "v1")
    assert parse_policy_text(text).backend("main").headers == (("X-Key", "v1"),)


def test_route_names_default_to_their_match_and_stay_unique():
    policy = parse_policy_text(
        MINIMAL + "  - {match: {path: '/v1/*', model: 'llama*'}, backend: main}\n"
    )
    assert [r.name for r in policy.routes] == ["/v1/* model=llama*", "/v1/* model=llama*#2"]


@pytest.mark.parametrize("path", sorted((ROOT / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_policy_passes_gateway_check(path, capsys):
    assert main(["check", str(path)]) == 0
    assert capsys.readouterr().out.startswith("ok:")


def test_gateway_check_exits_non_zero_naming_file_path_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL.replace("backend: main", "backend: nope"))
    assert main(["check", str(bad)]) == 1
    assert f"error: {bad}:9: routes[0].backend: unknown backend 'nope'" in capsys.readouterr().err


def test_gateway_check_says_where_to_set_only_of_an_unset_variable(tmp_path, capsys):
    """An unset ``${NAME}`` is a warning that it must be set where the gateway runs; a
    warning of another kind (a throttle rule whose signal the stock exporter lacks) is said
    as it is."""
    text = MINIMAL.replace(
        "    timeout_s: 120\n",
        "    timeout_s: 120\n"
        "    telemetry: {source: prometheus, url: 'http://127.0.0.1:9400/metrics'}\n",
    ) + (
        "throttle:\n  - {name: power, backend: main, action: shed,\n"
        "     when: {signal: gpu_power_ratio, above: 0.95, clear_below: 0.9}}\n"
        'admin: {token: "${GATEWAY_UNSET_IN_TESTS}"}\n'
    )
    policy = tmp_path / "p.yaml"
    policy.write_text(text)
    assert main(["check", str(policy)]) == 0
    said = capsys.readouterr().err.splitlines()
    [unset] = [line for line in said if "GATEWAY_UNSET_IN_TESTS" in line]
    [power] = [line for line in said if "gpu_power_ratio" in line]
    assert unset.endswith("(it must be set where the gateway runs)")
    assert "must be set" not in power


def test_schema_is_valid_json_schema_that_accepts_the_examples(capsys):
    import jsonschema
    import yaml

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for path in (ROOT / "policies").glob("*.yaml"):
        validator.validate(yaml.safe_load(path.read_text()))
    assert list(validator.iter_errors({"backends": {"a": {"url": "x", "bogus": 1}}}))
    assert schema == json_schema()


def test_docs_policy_md_is_generated_from_the_model():
    """docs/policy.md documents every key with its default; regenerate it with
    `gateway schema --markdown > docs/policy.md`."""
    assert (ROOT / "docs" / "policy.md").read_text() == reference_markdown()


REFUSED = """\
backends:
  main:
    url: http://127.0.0.1:8000
    {backend}
routes:
  - match: {{path: /v1/*}}
    backend: main
    {route}
{top}
"""


@pytest.mark.parametrize(
    ("backend", "route", "top", "message"),
    [
        ("circuit_breaker: {failure_rate: 0}", "", "", "circuit_breaker.failure_rate"),
        ("circuit_breaker: {half_open_calls: 0}", "", "", "half_open_calls must be at least"),
        ("circuit_breaker: {consecutive_failures: -1}", "", "", "must not be negative"),
        ("queue: {capacity: -1}", "", "", "backends.main.queue: capacity must be >= 0"),
        ("telemetry: {source: prometheus}", "", "", "needs a metrics URL"),
        ("telemetry: {source: snmp}", "", "", "backends.main.telemetry.source"),
        ("telemetry: {source: nvml, interval_ms: 10}", "", "", "must be at least 50"),
        (
            "",
            "rate_limit: {}",
            "",
            "set at least one of requests_per_s, tokens_per_min, requests_per_day, tokens_per_day",
        ),
        ("", "rate_limit: {requests_per_s: 0}", "", "rate_limit.requests_per_s: must be"),
        ("", "rate_limit: {tokens_per_min: 9, burst: -1}", "", "rate_limit.burst: must be"),
        ("", "rate_limit: {requests_per_s: 5, replicas: 0}", "", "rate_limit.replicas: must be"),
        ("", "rate_limit: {requests_per_s: 5, store: etcd}", "", "rate_limit.store"),
        (
            "",
            "cache: {semantic: {method: embedding, max_false_hit_rate: 0}}",
            "",
            "cache.semantic.max_false_hit_rate: must be in (0, 1)",
        ),
        (
            "",
            "cache: {semantic: {method: embedding, min_score: 1.5}}",
            "",
            "cache.semantic.min_score: must be in [0, 1]",
        ),
        ("", "", "retry_budget: {window_s: 0}", "retry_budget.window_s: must be greater"),
        ("", "", "retry_budget: {ratio: -0.1}", "retry_budget.ratio: must not be negative"),
        ("", "", "tracing: {sample_ratio: 1.5}", "tracing.sample_ratio: must be between 0 and 1"),
        ("", "", "tracing: {sample_ratio: -0.1}", "tracing.sample_ratio: must be between 0 and 1"),
        (
            "",
            "",
            "throttle: [{name: r, backend: main, when: {signal: fan, above: 1, clear_below: 0}}]",
            "throttle[0].when.signal",
        ),
        (
            "",
            "",
            "throttle: [{name: r, backend: main, when: "
            "{signal: gpu_temperature_c, above: 80, clear_below: 85}}]",
            "throttle[0].when.clear_below: must not be above",
        ),
        (
            "",
            "",
            "throttle: [{name: r, backend: main, action: limit, when: "
            "{signal: gpu_temperature_c, above: 85, clear_below: 80}}]",
            "a `limit` rule needs `limit:",
        ),
    ],
)
def test_settings_a_component_cannot_work_with_are_refused_at_load(
    backend: str, route: str, top: str, message: str
) -> None:
    """The runtime takes the policy's types as they are: what it cannot work with never
    gets past the loader (and so never reaches a reload)."""
    found = problems_of(REFUSED.format(backend=backend, route=route, top=top))
    assert any(message in p for p in found), found


def test_every_telemetry_selector_expands_env_and_a_literal_elsewhere_is_refused(
    tmp_path, monkeypatch
):
    """``telemetry.gpu: "${NVIDIA_VISIBLE_DEVICES}"`` stayed literal (only ``select``
    expanded), so the signal stayed unknown and a pod's GPU at 91 C still got traffic."""
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-1234")
    monkeypatch.setenv("EXPORTER", "http://10.0.0.9:9400/metrics")
    monkeypatch.setenv("MIG", "3")
    policy = parse_policy_text(
        'backends: {m: {url: "http://m", telemetry: {source: prometheus, url: "${EXPORTER}",'
        ' extra_urls: ["${EXPORTER}"], gpu: "${NVIDIA_VISIBLE_DEVICES}",'
        ' gpu_instance: "${MIG}"}}}\n'
    )
    telemetry = policy.backend("m").telemetry
    assert telemetry is not None
    assert (telemetry.url, telemetry.gpu, telemetry.gpu_instance) == (
        "http://10.0.0.9:9400/metrics",
        "GPU-1234",
        "3",
    )
    assert telemetry.extra_urls == ("http://10.0.0.9:9400/metrics",)
    literal = write_policy(
        tmp_path, 'backends: {m: {url: "http://m"}}\nroutes: [{name: "${ROUTE}", backend: m}]\n'
    )
    with pytest.raises(PolicyError, match=r"routes\[0\]\.name: \$\{ROUTE\} is not expanded"):
        load_policy(literal)
