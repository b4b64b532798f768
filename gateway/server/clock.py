"""The one timer of a client connection.

A connection has one deadline at a time (the head's, a body's silence, keep-alive, an
unread answer, the lingering close), which moves on almost every read.  Re-arming a timer
per read would cost a timer per packet, so the timer is moved lazily: armed at the nearest
deadline, and when it fires it asks for the deadline again, re-arming if that moved later,
acting only if it has truly passed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

Deadline = tuple[float, str]
"""(loop time, the phase it ends: head, body, idle, send or linger)."""


class ConnectionClock:
    """Calls ``expired(phase)`` once ``deadline()`` has passed; ``arm`` after a change."""

    __slots__ = ("_deadline", "_expired", "_loop", "_timer")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: Callable[[], Deadline | None],
        expired: Callable[[str], None],
    ) -> None:
        self._loop = loop
        self._deadline = deadline
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None

    def arm(self) -> None:
        """Make sure the timer fires by the current deadline (if there is one)."""
        found = self._deadline()
        if found is None:
            return
        when = found[0]
        timer = self._timer
        if timer is not None:
            if timer.when() <= when:
                return  # it fires first and moves itself on
            timer.cancel()
        self._timer = self._loop.call_at(when, self._fire)

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        found = self._deadline()
        if found is None:
            return
        when, phase = found
        if self._loop.time() < when:
            self._timer = self._loop.call_at(when, self._fire)
            return
        self._expired(phase)

    def __repr__(self) -> str:
        armed = f"at {self._timer.when():.3f}" if self._timer is not None else "idle"
        return f"<ConnectionClock {armed}>"
