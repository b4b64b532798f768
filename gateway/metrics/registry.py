"""``Metrics``: every gateway series on one registry per app, its families declared by area
(``traffic``, ``capabilities``, ``protection``).

Dashboards and alerts depend on these names;
``tests/test_admin.py::test_metric_names_are_the_public_contract`` snapshots them.
Constant labels from the policy (``metrics.const_labels``) are added at exposition time, so
a reload can change them without re-registering anything.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest

from gateway.metrics.capabilities import CapabilityFamilies
from gateway.metrics.collectors import Labelled, register_process_collectors
from gateway.metrics.protection import ProtectionFamilies
from gateway.metrics.traffic import TrafficFamilies


class Metrics(TrafficFamilies, CapabilityFamilies, ProtectionFamilies):
    """Every gateway series, registered on a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.const_labels: tuple[tuple[str, str], ...] = ()
        r = self.registry
        self._register_traffic(r)
        self._register_cache(r)
        self._register_batching(r)
        self._register_protection(r)
        self._register_clients(r)
        self._register_process(r)
        register_process_collectors(r)
        self._route_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._request_children: dict[tuple[str, str, int], Any] = {}
        self._token_children: dict[str, tuple[Any, Any]] = {}
        self._tenant_children: dict[tuple[str, int], Any] = {}
        self._tenant_token_children: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._tenant_wait_children: dict[str, Any] = {}

    def count_request(self, route: str, backend: str, status: int) -> None:
        key = (route, backend, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, backend, str(status))
        child.inc()

    def count_tokens(self, backend: str, prompt: int, completion: int) -> None:
        children = self._token_children.get(backend)
        if children is None:
            children = self._token_children[backend] = (
                self.tokens.labels(backend, "prompt"),
                self.tokens.labels(backend, "completion"),
            )
        children[0].inc(prompt)
        children[1].inc(completion)

    def count_tenant(
        self,
        tenant: str,
        status: int,
        source: str,
        tokens: tuple[int, int] | None,
        cost: float = 0.0,
    ) -> None:
        """One answer to a named tenant: its status and, if it had them, its tokens and
        what they cost."""
        key = (tenant, status)
        child = self._tenant_children.get(key)
        if child is None:
            child = self._tenant_children[key] = self.tenant_requests.labels(tenant, str(status))
        child.inc()
        if tokens is not None:
            pair = self._tenant_token_children.get((tenant, source))
            if pair is None:
                pair = self._tenant_token_children[(tenant, source)] = (
                    self.tenant_tokens.labels(tenant, "prompt", source),
                    self.tenant_tokens.labels(tenant, "completion", source),
                )
            pair[0].inc(tokens[0])
            pair[1].inc(tokens[1])
        if cost > 0:
            self.tenant_cost.labels(tenant, source).inc(cost)

    def tenant_waited(self, tenant: str, seconds: float) -> None:
        """A named tenant's call was admitted after ``seconds`` in a backend's queue."""
        child = self._tenant_wait_children.get(tenant)
        if child is None:
            child = self._tenant_wait_children[tenant] = self.tenant_queue_wait.labels(tenant)
        child.observe(seconds)

    def route_series(self, route: str, backend: str) -> tuple[Any, Any]:
        """(request_duration, stream_first_byte) children, cached: labels() is slow."""
        key = (route, backend)
        found = self._route_children.get(key)
        if found is None:
            found = (
                self.request_duration.labels(route, backend),
                self.stream_first_byte.labels(route, backend),
            )
            self._route_children[key] = found
        return found

    def set_policy(
        self, generation: int, digest: str, const_labels: tuple[tuple[str, str], ...]
    ) -> None:
        """Publish the loaded policy's generation, hash and constant labels."""
        self.policy_generation.set(generation)
        self.policy_info.clear()
        self.policy_info.labels(digest).set(1)
        self.const_labels = const_labels

    def exposition(self) -> bytes:
        """The text format of every series, constant labels added."""
        labelled = self.const_labels and Labelled(self.registry, dict(self.const_labels))
        return generate_latest(labelled or self.registry)


def names(metrics: Metrics) -> Iterable[str]:
    """The metric family names registered (for the snapshot test)."""
    return sorted({m.name for m in metrics.registry.collect()})
