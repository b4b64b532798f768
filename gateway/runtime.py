"""What the stages share across policy generations: metrics, long-lived state, time, and
the transport to the backends."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.state import Registry
from gateway.transport.upstream import Transport


@dataclass(frozen=True, slots=True)
class Runtime:
    """What stages share across generations: metrics, long-lived state, time, transport."""

    metrics: Metrics
    registry: Registry
    clock: Clock
    transport: Transport
