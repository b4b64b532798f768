"""Whether the shared Redis is up, decided by evidence: the outcomes of its own commands.

One late reply proves nothing on a busy machine (on 2 shared cores the event loop itself
runs late), and a store that answers with an error (a full Redis refusing a write) is up.
So a store goes down only when its commands fail to reach it: ``DOWN_AFTER`` connection
failures or timeouts in a row, or at least ``RATE_MIN_CALLS`` commands in ``WINDOW_S`` of
which ``FAILURE_RATE`` or more failed that way.  Timeouts alone are not conclusive: when the
event loop stalls past the socket timeout (a long callback, a CPU-throttled container),
every command in flight times out in the same turn though the store answered them all, so
the link asks the store once more before it believes them (``failed(conclusive=False)``,
then ``condemn`` or ``recovered``).  A command's time is its own round trip: one that runs
past the caller's budget is still awaited, and its outcome, when it comes, is what counts.
Going up again is the probe's to decide (``link.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from gateway.clock import Clock

DOWN_AFTER = 3
WINDOW_S = 1.0
RATE_MIN_CALLS = 10
FAILURE_RATE = 0.5


class Health:
    """The evidence about one store; ``on_change(up)`` hears every transition."""

    def __init__(self, clock: Clock, on_change: Callable[[bool], None] | None = None) -> None:
        self._clock = clock
        self.on_change = on_change
        self.up = True
        self.transitions = 0
        self.reached = 0
        """Commands that reached the store (whatever they answered), since the start."""
        self.unreached = 0
        """Commands that could not reach it (connection failures, timeouts)."""
        self._in_a_row = 0
        self._recent: deque[tuple[float, bool]] = deque()

    def succeeded(self) -> None:
        """A command reached the store (an error it answered with counts as reaching it)."""
        self._in_a_row = 0
        self.reached += 1
        self._note(True)

    def failed(self, *, conclusive: bool = True) -> bool:
        """A command could not reach the store; True when the evidence now condemns it, and
        then it goes down, unless the failure was not ``conclusive`` (a timeout): that
        verdict is left to ``condemn``."""
        self._in_a_row += 1
        self.unreached += 1
        failures, calls = self._note(False)
        condemned = self.up and (
            self._in_a_row >= DOWN_AFTER
            or (calls >= RATE_MIN_CALLS and failures >= FAILURE_RATE * calls)
        )
        if condemned and conclusive:
            self._move(False)
        return condemned

    def condemn(self) -> bool:
        """Down, on evidence confirmed; True when that is a transition."""
        if not self.up:
            return False
        self._move(False)
        return True

    def recovered(self) -> None:
        """The store's probe reached it: up again, with a clean slate."""
        self._in_a_row = 0
        self._recent.clear()
        if not self.up:
            self._move(True)

    def _note(self, ok: bool) -> tuple[int, int]:
        now = self._clock.now()
        recent = self._recent
        recent.append((now, ok))
        while recent and recent[0][0] < now - WINDOW_S:
            recent.popleft()
        failures = sum(1 for _, good in recent if not good)
        return failures, len(recent)

    def _move(self, up: bool) -> None:
        self.up = up
        self.transitions += 1
        if self.on_change is not None:
            self.on_change(up)

    def __repr__(self) -> str:
        failures = sum(1 for _, good in self._recent if not good)
        state = "up" if self.up else "down"
        return (
            f"<Health {state} in_a_row={self._in_a_row}/{DOWN_AFTER} "
            f"window={failures}/{len(self._recent)} transitions={self.transitions}>"
        )
