"""One policy generation as requests see it, and what the edge and the admin port need of
the running gateway (``app.Gateway``), as protocols so that neither imports the app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gateway.metrics import Metrics
from gateway.pipeline import Handler
from gateway.policy.model import Policy
from gateway.routing import Router
from gateway.state import Registry
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


class Live(Protocol):
    """What the edge reads of the running gateway on every request."""

    snapshot: Snapshot
    metrics: Metrics
    access_log: bool
    inflight_requests: int


class Operated(Live, Protocol):
    """What the admin port reads and drives."""

    registry: Registry
    draining: bool

    @property
    def ready(self) -> bool: ...

    def admin_token(self) -> str | None: ...

    def reload(self, *, force: bool = False) -> bool: ...
