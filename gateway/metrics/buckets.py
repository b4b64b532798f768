"""Histogram buckets the gateway's series share."""

from __future__ import annotations

# Seconds; dense below 10 ms where the gateway's own overhead lives, up to long generations.
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
LATENCY_BUCKETS += (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
LAG_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
"""Seconds an event-loop wake-up comes late: 0.1 ms (idle) to 1 s (a blocked loop)."""
