"""The autoscaling examples (deploy/autoscaling/): the HPA validates strictly against the
Kubernetes schemas, the KEDA ScaledObject (a CRD, no bundled schema) has the shape KEDA's
Prometheus scaler reads, both scale the kit's model-server Deployment on a metric the
gateway exports, for the backend the kit's policy names."""

from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gateway.metrics import Metrics, names

ROOT = Path(__file__).resolve().parent.parent
HERE = ROOT / "deploy" / "autoscaling"
DEPLOYMENT = yaml.safe_load((ROOT / "deploy" / "k8s" / "deployment.yaml").read_text())


def load(name: str) -> dict:
    return yaml.safe_load((HERE / name).read_text())


@pytest.mark.parametrize("version", ("1.29", "1.37"))
def test_the_hpa_validates_strictly(version: str) -> None:
    kubernetes_validate.validate(load("hpa-external.yaml"), version, strict=True)


def test_both_scale_the_model_server_on_the_desired_endpoints_of_the_kits_backend() -> None:
    kit_policy = yaml.safe_load(
        yaml.safe_load((ROOT / "deploy" / "k8s" / "configmap-policy.yaml").read_text())["data"][
            "policy.yaml"
        ]
    )
    backend = next(iter(kit_policy["backends"]))
    exported = set(names(Metrics()))
    hpa = load("hpa-external.yaml")
    keda = load("keda-scaledobject.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == DEPLOYMENT["metadata"]["name"]
    assert keda["spec"]["scaleTargetRef"]["name"] == DEPLOYMENT["metadata"]["name"]
    external = hpa["spec"]["metrics"][0]["external"]["metric"]
    assert external["name"] in exported
    assert external["selector"]["matchLabels"] == {"backend": backend}
    assert keda["apiVersion"] == "keda.sh/v1alpha1" and keda["kind"] == "ScaledObject"
    trigger = keda["spec"]["triggers"][0]
    assert trigger["type"] == "prometheus"
    assert set(trigger["metadata"]) >= {"serverAddress", "query", "threshold"}
    queried = set(re.findall(r"gateway_[a-z_]+", trigger["metadata"]["query"]))
    assert queried and queried <= exported
    assert f'backend="{backend}"' in trigger["metadata"]["query"]
    assert keda["spec"]["minReplicaCount"] <= keda["spec"]["maxReplicaCount"]
