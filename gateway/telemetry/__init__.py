"""Telemetry sources (NVML, Prometheus) reduced to normalised signals, and their polling.

``signals`` holds the signal names, ``Sample`` and the per-backend ``Telemetry``; ``nvml`` and
``prometheus`` are the interchangeable sources; ``poller`` reads a source on a schedule.
"""

from gateway.telemetry.nvml import NvmlSource
from gateway.telemetry.poller import (
    Source,
    TelemetryPoller,
    TelemetrySettings,
    make_source,
    telemetry_for,
)
from gateway.telemetry.prometheus import (
    PrometheusSource,
    Selector,
    parse_exposition,
    read_series,
    signals_from,
)
from gateway.telemetry.signals import SIGNALS, STALE_INTERVALS, Sample, Signal, Telemetry

__all__ = [
    "SIGNALS",
    "STALE_INTERVALS",
    "NvmlSource",
    "PrometheusSource",
    "Sample",
    "Selector",
    "Signal",
    "Source",
    "Telemetry",
    "TelemetryPoller",
    "TelemetrySettings",
    "make_source",
    "parse_exposition",
    "read_series",
    "signals_from",
    "telemetry_for",
]
