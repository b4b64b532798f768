"""Time as a parameter: the clock every time-dependent part takes (TTLs, breakers, AIMD)."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds; ``wall()`` only where a timestamp is shown to people."""

    def now(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``time.time``."""

    def now(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "<SystemClock>"


SYSTEM_CLOCK = SystemClock()
