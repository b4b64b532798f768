"""What the stages share across policy generations: metrics, long-lived state, time, and
the transport to the backends."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.state import Registry
from gateway.transport.sizing import Demand
from gateway.transport.upstream import Transport


@dataclass(frozen=True, slots=True)
class Runtime:
    """What stages share across generations: metrics, long-lived state, time, transport;
    ``demand``, the endpoints a forecast says each backend will need (written by the pool
    stage, read by the transport's pool sizing)."""

    metrics: Metrics
    registry: Registry
    clock: Clock
    transport: Transport
    demand: Demand = field(default_factory=dict)
