"""The policy of a throttle rule (``throttle[]``): a telemetry signal with hysteresis, and
what the rule does to its backend while it fires."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.policy.metadata import doc
from gateway.telemetry.signals import Signal


@dataclass(frozen=True, slots=True)
class When:
    """A threshold with hysteresis: fires above `above`, clears only below `clear_below`."""

    signal: Signal = field(metadata=doc("The normalised telemetry signal."))
    above: float = field(metadata=doc("Fires when the signal rises above this."))
    clear_below: float = field(metadata=doc("Clears only when it falls below this."))


@dataclass(frozen=True, slots=True)
class ThrottleLimit:
    """What a `limit` rule caps."""

    max_concurrency: int | None = field(default=None, metadata=doc("Calls in flight."))
    rps: float | None = field(default=None, metadata=doc("Requests per second."))
    batch_max_size: int | None = field(default=None, metadata=doc("Batch size."))


@dataclass(frozen=True, slots=True)
class ThrottleRule:
    """A rule protecting a backend's GPU."""

    name: str = field(metadata=doc("Rule name (metrics label)."))
    backend: str = field(metadata=doc("Backend whose telemetry it watches and protects."))
    when: When = field(metadata=doc("The signal and its thresholds."))
    action: Literal["reroute", "shed", "limit"] = field(
        default="reroute",
        metadata=doc(
            "`reroute` to the route's fallback, `shed` (503 + "
            "Retry-After, lowest priority first) or `limit`."
        ),
    )
    limit: ThrottleLimit | None = field(default=None, metadata=doc("For `limit`."))
