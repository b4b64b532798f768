"""The Kubernetes kit in deploy/k8s/: schema-valid objects that agree with each other.

Every manifest is validated offline against the Kubernetes OpenAPI schemas (strict mode,
so a misspelt field fails), and the properties the gateway relies on in a pod are pinned:
the policy mount that hot reload needs, probes on the admin port, the shutdown budget,
the non-root read-only container, and the ports that Dockerfile, Deployment, Service and
policy must share.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

K8S_DIR = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
# The oldest release the kit claims to support and the newest schema bundled with
# kubernetes-validate 1.37; a field too new for the first fails there.
KUBERNETES_VERSIONS = ("1.29", "1.37")
DEFAULT_SHUTDOWN_GRACE_S = 25
GATEWAY_CONTAINER = "gateway"
MODEL_SERVER_CONTAINER = "vllm"

# The Prometheus Operator's custom resources: applied on their own, outside the kustomization,
# so that `kubectl apply -k` works on a cluster without the operator (tests/test_alert_rules.py
# checks them).
OPERATOR_RESOURCES = frozenset({"prometheus-rules.yaml"})
MANIFESTS = sorted(
    path
    for path in K8S_DIR.rglob("*.yaml")
    if path.name != "kustomization.yaml" and path.name not in OPERATOR_RESOURCES
)


def _documents(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _objects() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in _documents(path)]


def _one(kind: str) -> dict[str, Any]:
    found = [obj for obj in _objects() if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _pod_spec() -> dict[str, Any]:
    spec: dict[str, Any] = _one("Deployment")["spec"]["template"]["spec"]
    return spec


def _container(name: str) -> dict[str, Any]:
    spec = _pod_spec()
    containers = spec["containers"] + spec.get("initContainers", [])
    return next(c for c in containers if c["name"] == name)


def _flag(container: dict[str, Any], flag: str) -> str:
    args = container.get("command", []) + container.get("args", [])
    return str(args[args.index(flag) + 1])


def _port_number(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def _prestop_sleep_s(container: dict[str, Any]) -> int:
    pre_stop = container["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        return int(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep", f"preStop is not a sleep: {command}"
    return int(command[1])


def _policy_text() -> str:
    text: str = _one("ConfigMap")["data"]["policy.yaml"]
    return text


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S_DIR)))
def test_every_manifest_holds_only_complete_kubernetes_objects(path: Path) -> None:
    """Each document has apiVersion, kind and metadata.name, as kubectl apply needs."""
    documents = _documents(path)
    assert documents, f"{path.name} is empty"
    for doc in documents:
        assert doc.get("apiVersion") and doc.get("kind"), f"{path.name}: {doc}"
        assert doc.get("metadata", {}).get("name"), f"{path.name}: unnamed {doc['kind']}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S_DIR)))
def test_every_manifest_validates_strictly_against_kubernetes_schemas(
    path: Path, version: str
) -> None:
    """Offline strict validation: unknown fields and wrong types fail; CRDs have no schema."""
    for doc in _documents(path):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{path.name}: {doc['kind']} {where}: {exc.message} (k8s {version})")
        except kubernetes_validate.SchemaNotFoundError as exc:
            pytest.fail(f"{path.name}: {exc.message}; only core kinds belong here")


def test_kustomization_lists_every_manifest_file() -> None:
    """kubectl apply -k deploys exactly the files in deploy/k8s/, none forgotten."""
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    on_disk = {str(path.relative_to(K8S_DIR)) for path in MANIFESTS}
    assert listed == on_disk


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kustomization_builds_with_kubectl() -> None:
    """`kubectl kustomize` renders the kit (no cluster needed) with every object in it."""
    result = subprocess.run(
        ["kubectl", "kustomize", str(K8S_DIR)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    rendered = {(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(result.stdout)}
    kustomization = yaml.safe_load((K8S_DIR / "kustomization.yaml").read_text())
    generated = {("ConfigMap", g["name"]) for g in kustomization.get("configMapGenerator", [])}
    assert rendered == {(o["kind"], o["metadata"]["name"]) for o in _objects()} | generated


def test_the_dcgm_counters_hold_the_stock_fields_and_those_the_signals_need() -> None:
    """Every line is `field, type, help`; the power limit and clock-event reasons the
    gateway's power and throttling signals read are there, beside the stock counters."""
    from gateway.telemetry.prometheus import CLOCK_REASONS, FB_FREE, GPU_TEMP, POWER_LIMITS

    fields = {}
    for line in (K8S_DIR / "dcgm-counters.csv").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        field, kind, help_text = (part.strip() for part in line.split(",", 2))
        assert field.startswith("DCGM_FI_") and kind in ("gauge", "counter", "label")
        assert help_text
        fields[field] = kind
    assert {GPU_TEMP, FB_FREE, "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_GPU_UTIL"} <= set(fields)
    assert any(name in fields for name in POWER_LIMITS)
    assert any(name in fields for name in CLOCK_REASONS)


def test_policy_configmap_is_mounted_as_a_directory_without_subpath() -> None:
    """The gateway reads the ConfigMap as a directory (subPath never updates) at --policy."""
    config_map = _one("ConfigMap")["metadata"]["name"]
    volumes = [
        v["name"]
        for v in _pod_spec()["volumes"]
        if v.get("configMap", {}).get("name") == config_map
    ]
    assert len(volumes) == 1
    gateway = _container(GATEWAY_CONTAINER)
    mounts = [m for m in gateway["volumeMounts"] if m["name"] == volumes[0]]
    assert len(mounts) == 1
    assert "subPath" not in mounts[0] and "subPathExpr" not in mounts[0]
    assert mounts[0]["mountPath"] == _flag(gateway, "--policy")
    assert mounts[0].get("readOnly") is True


def test_gateway_probes_use_healthz_and_readyz_on_the_admin_port() -> None:
    """Liveness is GET /healthz and readiness GET /readyz, both on --admin-port."""
    gateway = _container(GATEWAY_CONTAINER)
    admin_port = int(_flag(gateway, "--admin-port"))
    data_port = int(_flag(gateway, "--port"))
    assert admin_port != data_port
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        http_get = gateway[probe]["httpGet"]
        assert http_get["path"] == path
        assert _port_number(gateway, http_get["port"]) == admin_port


def test_prometheus_scrapes_the_admin_port_metrics() -> None:
    """Pod annotations point prometheus.io scraping at <admin port>/metrics."""
    annotations = _one("Deployment")["spec"]["template"]["metadata"]["annotations"]
    gateway = _container(GATEWAY_CONTAINER)
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == int(_flag(gateway, "--admin-port"))
    assert annotations["prometheus.io/path"] == "/metrics"


def test_gateway_runs_non_root_on_a_read_only_root_filesystem() -> None:
    """runAsNonRoot with a numeric uid, read-only root, no escalation, no caps, seccomp."""
    pod_context = _pod_spec().get("securityContext", {})
    context = {**pod_context, **_container(GATEWAY_CONTAINER)["securityContext"]}
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] > 0
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["seccompProfile"]["type"] == "RuntimeDefault"
    tmp = next(m for m in _container(GATEWAY_CONTAINER)["volumeMounts"] if m["mountPath"] == "/tmp")
    assert any(v["name"] == tmp["name"] and "emptyDir" in v for v in _pod_spec()["volumes"])


def _shutdown_grace_s() -> float:
    """The policy's drain budget: the gateway's own reading when its loader is importable."""
    try:
        from gateway.policy.load import parse_policy_text
    except ImportError:
        server = yaml.safe_load(_policy_text()).get("server") or {}
        return float(server.get("shutdown_grace_s", DEFAULT_SHUTDOWN_GRACE_S))
    return parse_policy_text(_policy_text(), "configmap-policy.yaml").server.shutdown_grace_s


def test_the_grace_periods_add_up() -> None:
    """SIGKILL never cuts a drain short: the gateway exits by preStop sleep +
    shutdown_grace_s + 1 s (the drain's own bound); the model server's hook waits longer
    than that; and terminationGracePeriodSeconds leaves vLLM time to exit after it."""
    sleep_s = _prestop_sleep_s(_container(GATEWAY_CONTAINER))
    assert sleep_s >= 1
    gateway_gone_s = sleep_s + _shutdown_grace_s() + 1
    hook = _container(MODEL_SERVER_CONTAINER)["lifecycle"]["preStop"]["exec"]["command"][2]
    found = re.search(r"deadline = time.monotonic\(\) \+ (\d+)", hook)
    assert found, "the model server's hook has no deadline"
    hook_s = int(found.group(1))
    assert hook_s > gateway_gone_s
    assert _pod_spec()["terminationGracePeriodSeconds"] >= hook_s + 5


def test_model_server_prestop_waits_for_the_gateway_to_exit() -> None:
    """vLLM's SIGTERM waits while the gateway's admin port is open, and not when it is shut."""
    gateway = _container(GATEWAY_CONTAINER)
    admin_port = int(_flag(gateway, "--admin-port"))
    command = _container(MODEL_SERVER_CONTAINER)["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["python3", "-c"]
    script = command[2]
    run = [sys.executable, "-c", script]

    listener = socket.socket()
    try:
        listener.bind(("127.0.0.1", admin_port))
    except OSError:
        listener.close()
        pytest.skip(f"port {admin_port} is in use on this machine")
    with listener:
        listener.listen(16)
        hook = subprocess.Popen(run)
        try:
            with pytest.raises(subprocess.TimeoutExpired):
                hook.wait(timeout=0.5)
        finally:
            listener.close()
        assert hook.wait(timeout=10) == 0
    # With no gateway listening the hook returns at once.
    assert subprocess.run(run, timeout=10, check=False).returncode == 0


def test_model_server_holds_the_gpu_and_listens_on_loopback_only() -> None:
    """vLLM gets nvidia.com/gpu: 1 and binds 127.0.0.1; the gateway requests no GPU."""
    vllm = _container(MODEL_SERVER_CONTAINER)
    assert str(vllm["resources"]["limits"]["nvidia.com/gpu"]) == "1"
    assert vllm["image"].startswith("vllm/vllm-openai:")
    assert _flag(vllm, "--host") == "127.0.0.1"
    gateway = _container(GATEWAY_CONTAINER)
    for section in ("requests", "limits"):
        assert "nvidia.com/gpu" not in gateway["resources"].get(section, {})
        assert {"cpu", "memory"} <= set(gateway["resources"][section])


def test_policy_backend_url_is_the_model_server_in_the_same_pod() -> None:
    """Every backend URL in the ConfigMap's policy is vLLM's loopback host and port."""
    vllm = _container(MODEL_SERVER_CONTAINER)
    policy = yaml.safe_load(_policy_text())
    for name, backend in policy["backends"].items():
        url = urlsplit(backend["url"])
        assert (url.hostname, url.port) == (_flag(vllm, "--host"), int(_flag(vllm, "--port"))), name


def test_configmap_policy_is_accepted_by_the_gateway_loader() -> None:
    """The policy in configmap-policy.yaml loads with the gateway's own parser."""
    try:
        from gateway.policy.load import parse_policy_text
    except ImportError as exc:
        pytest.skip(f"gateway.policy.load.parse_policy_text is not available yet: {exc}")
    from gateway.errors import PolicyError

    try:
        parse_policy_text(_policy_text(), "deploy/k8s/configmap-policy.yaml#policy.yaml")
    except PolicyError as exc:
        pytest.fail(f"the ConfigMap's policy is rejected:\n{exc}")


def test_service_and_disruption_budget_select_the_pods_and_expose_the_data_port() -> None:
    """The Service sends port 8080 to the gateway's --port; selectors match the pod labels."""
    labels = _one("Deployment")["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")
    budget = _one("PodDisruptionBudget")
    assert service["spec"]["selector"].items() <= labels.items()
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    gateway = _container(GATEWAY_CONTAINER)
    (port,) = service["spec"]["ports"]
    assert port["port"] == 8080
    assert _port_number(gateway, port["targetPort"]) == int(_flag(gateway, "--port"))


def test_admin_token_comes_from_the_secret() -> None:
    """GATEWAY_ADMIN_TOKEN is read from a key the Secret manifest defines in stringData."""
    secret = _one("Secret")
    assert "data" not in secret and "stringData" in secret
    env = {e["name"]: e for e in _container(GATEWAY_CONTAINER)["env"]}
    ref = env["GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"]
    assert ref["key"] in secret["stringData"]
    assert not ref.get("optional", False)


def _dockerfile_instructions() -> dict[str, str]:
    """The last value of each Dockerfile instruction, continuation lines joined."""
    text = (K8S_DIR / "Dockerfile").read_text().replace("\\\n", " ")
    instructions: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions[keyword.upper()] = rest.strip()
    return instructions


def test_dockerfile_runs_the_gateway_as_the_deployments_non_root_user() -> None:
    """python:3.11-slim, ENTRYPOINT gateway, CMD = the Deployment's args, USER = runAsUser."""
    instructions = _dockerfile_instructions()
    gateway = _container(GATEWAY_CONTAINER)
    assert instructions["FROM"] == "python:3.11-slim"
    assert json.loads(instructions["ENTRYPOINT"]) == ["gateway"]
    assert json.loads(instructions["CMD"]) == gateway["args"]
    uid, _, gid = instructions["USER"].partition(":")
    assert int(uid) == gateway["securityContext"]["runAsUser"]
    assert int(gid) == gateway["securityContext"]["runAsGroup"]
