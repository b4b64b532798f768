"""The pipeline's stages, in order: cache lookup, single flight, batching, then admission,
throttling, breakers and fallback around the forward to a backend.

``build`` makes the stage list for one policy generation.  Stages keep per-request rules
from the policy snapshot they are built with, and take their long-lived state (stores,
batchers, breakers, queues) from the runtime's registry so it survives reloads.  A stage
whose route does not use its capability passes the call straight on.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.clock import Clock
from gateway.metrics import Metrics
from gateway.pipeline import Stage
from gateway.policy.model import Policy
from gateway.state import Registry
from gateway.upstream import Transport


@dataclass(frozen=True, slots=True)
class Runtime:
    """What stages share across generations: metrics, long-lived state, time, transport."""

    metrics: Metrics
    registry: Registry
    clock: Clock
    transport: Transport


def build(policy: Policy, runtime: Runtime) -> list[Stage]:
    """The stages for ``policy``, in pipeline order."""
    stages: list[Stage] = []
    from gateway.stages.cache import cache_stages  # 1. cache lookup (issue 4)

    stages.extend(cache_stages(policy, runtime))
    from gateway.stages import batch, coalesce  # 2. single flight, 3. batching (issue 5)

    stages += coalesce.build(policy, runtime) + batch.build(policy, runtime)
    # 4. admission, throttling, breakers and fallback (issue 6)
    from gateway.stages.resilience import resilience_stages

    stages.extend(resilience_stages(policy, runtime))
    return stages
