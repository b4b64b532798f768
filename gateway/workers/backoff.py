"""When a worker that exited is started again: after ``first_s`` the first time, then
after a delay that doubles with each exit in a row, up to ``cap_s``; a worker that lived
``stable_s`` starts the count afresh.  A worker that crashes at start is thus started at
most once per ``cap_s`` (a Python start costs about a second of CPU), never in a loop."""

from __future__ import annotations

from dataclasses import dataclass

FIRST_S = 0.1
CAP_S = 30.0
STABLE_S = 30.0


@dataclass(slots=True)
class Backoff:
    """The restart delays of one worker slot."""

    first_s: float = FIRST_S
    cap_s: float = CAP_S
    stable_s: float = STABLE_S
    exits: int = 0
    """Exits in a row, each after less than ``stable_s``."""

    def delay_s(self, lived_s: float) -> float:
        """How long to wait before starting again a worker that exited after ``lived_s``."""
        if lived_s >= self.stable_s:
            self.exits = 0
        delay = min(self.first_s * 2**self.exits, self.cap_s)
        self.exits += 1
        return delay

    def __repr__(self) -> str:
        following = min(self.first_s * 2**self.exits, self.cap_s)
        return f"<Backoff exits={self.exits} next={following:g}s>"
