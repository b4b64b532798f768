"""The gateway's Prometheus metrics: the series every app registers (``registry.Metrics``,
its families by area in ``traffic``, ``capabilities`` and ``protection``), the custom
collectors (``collectors``), the event-loop lag timer (``loop_lag``), the supervisor's merge
of its workers' series (``merged``) and the reference page generated from them all
(``reference``).

Names are public surface: dashboards and alerts depend on them.
"""

from gateway.metrics.buckets import LAG_BUCKETS, LATENCY_BUCKETS
from gateway.metrics.collectors import EmbeddingFigures, RateLimitFigures, RedisFigures
from gateway.metrics.registry import Metrics, names

__all__ = [
    "LAG_BUCKETS",
    "LATENCY_BUCKETS",
    "EmbeddingFigures",
    "Metrics",
    "RateLimitFigures",
    "RedisFigures",
    "names",
]
