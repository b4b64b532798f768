"""Fakes of the gateway's boundaries, shared by its tests and by its users' tests.

Each boundary (clock, upstream transport, cache store, NVML) has one real implementation in
the package and one fake here.  Nothing in this module fakes the gateway's own logic.
"""

from __future__ import annotations


class FakeClock:
    """A clock that moves only when told: ``advance(seconds)``."""

    def __init__(self, start: float = 1000.0, wall_start: float = 1_700_000_000.0) -> None:
        self._now = start
        self._wall_offset = wall_start - start

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + self._wall_offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time only moves forward")
        self._now += seconds

    def __repr__(self) -> str:
        return f"<FakeClock now={self._now:.3f}>"
