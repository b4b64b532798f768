"""One policy generation as requests see it, and what the edge and the admin port need of
the running gateway (``app.Gateway``), as protocols so that neither imports the app.

What the admin port reads of the capabilities it reads through the registry, by keys typed
here with the protocol it needs (``CACHE``, ``THROTTLE``, ``CACHE_OPERATING_POINTS``,
``TENANT_STANDINGS``): a
``Kind`` is equal to another of the same name, so each finds the capability's own piece
without the admin importing its module."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from gateway.metrics import Metrics
from gateway.openai.allowed_models import AllowedModels
from gateway.pipeline import Handler
from gateway.policy.model import Policy
from gateway.policy.routing import Router
from gateway.state import Kind, Registry
from gateway.tenant import NamedTenants
from gateway.transport.forwarding import TrustedProxies

if TYPE_CHECKING:
    from gateway.tracing.otel import Tracer


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a request needs from one policy generation."""

    policy: Policy
    digest: str
    generation: int
    router: Router
    handler: Handler
    trusted: TrustedProxies
    tracer: Tracer | None = None
    """Traces requests while the policy's ``tracing.sample_ratio`` is above 0."""
    tenants: NamedTenants | None = None
    """The policy's named tenants, when it names any (``tenants:``)."""
    models: Mapping[str, AllowedModels] | None = None
    """The models of each named tenant held to some (``tenants.keys[].models``)."""


class Live(Protocol):
    """What the edge reads of the running gateway on every request."""

    snapshot: Snapshot
    metrics: Metrics
    registry: Registry
    access_log: bool
    inflight_requests: int


class Operated(Live, Protocol):
    """What the admin port reads and drives."""

    draining: bool

    @property
    def ready(self) -> bool: ...

    def admin_token(self) -> str | None: ...

    def reload(self, *, force: bool = False) -> bool: ...

    def model_identity(self, name: str) -> str | None: ...


class CachePurge(Protocol):
    """What ``POST /cache/purge`` needs of the cache (its ``CacheState``)."""

    @property
    def kind(self) -> str: ...

    def tenant_scope(self, tenant: str | Mapping[str, str]) -> str: ...

    async def purge(
        self,
        *,
        backend: str | None = None,
        model_version: str | None = None,
        scope: str | None = None,
    ) -> int: ...


class ThrottleSignals(Protocol):
    """What ``GET /policy`` shows of the throttle rules (``GpuControl``)."""

    def signal_status(self) -> list[dict[str, str]]: ...


class OperatingPoints(Protocol):
    """What ``GET /policy`` shows of the embedding cache routes: each one's operating point
    as in force."""

    def in_force(self, policy: Policy) -> dict[str, object]: ...


CACHE: Kind[CachePurge] = Kind("cache-store")
"""The cache's state (``cache.state.CACHE_STATE``), while a route caches."""
THROTTLE: Kind[ThrottleSignals] = Kind("gpu_control")
"""The throttle rules' state (``resilience.gpu.GPU_CONTROL``)."""
CACHE_OPERATING_POINTS: Kind[OperatingPoints] = Kind("cache-operating-points")
"""The embedding tier's operating points (``cache.stage.OPERATING_POINTS``)."""


class TenantStandings(Protocol):
    """What ``GET /tenants`` tells: where each named tenant stands in its limits."""

    async def told(self, policy: Policy) -> list[dict[str, Any]]: ...


TENANT_STANDINGS: Kind[TenantStandings] = Kind("tenant-standings")
"""The named tenants' standings (``resilience.standings.STANDINGS``)."""
