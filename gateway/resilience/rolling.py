"""Counts over a sliding time window, kept in a fixed number of time buckets.

The breaker counts successes and failures over ``window_s``; the retry budget counts requests
and retries.  A bucket covers ``window_s / buckets`` seconds, so the window slides in steps of
one bucket and memory stays constant however many calls pass.
"""

from __future__ import annotations

from collections import deque

from gateway.clock import Clock

DEFAULT_BUCKETS = 10


class RollingCounts:
    """Named counters summed over the last ``window_s`` seconds of ``clock``."""

    __slots__ = ("_buckets", "_clock", "_names", "_width", "buckets", "window_s")

    def __init__(
        self, names: tuple[str, ...], window_s: float, clock: Clock, buckets: int = DEFAULT_BUCKETS
    ) -> None:
        if window_s <= 0 or buckets <= 0:
            raise ValueError("window_s and buckets must be positive")
        self._names = {name: i for i, name in enumerate(names)}
        self.window_s = window_s
        self.buckets = buckets
        self._width = window_s / buckets
        self._clock = clock
        self._buckets: deque[tuple[int, list[int]]] = deque()

    def add(self, name: str, n: int = 1) -> None:
        slot = int(self._clock.now() // self._width)
        if not self._buckets or self._buckets[-1][0] != slot:
            self._buckets.append((slot, [0] * len(self._names)))
            self._expire(slot)
        self._buckets[-1][1][self._names[name]] += n

    def total(self, name: str) -> int:
        self._expire(int(self._clock.now() // self._width))
        i = self._names[name]
        return sum(counts[i] for _, counts in self._buckets)

    def clear(self) -> None:
        self._buckets.clear()

    def _expire(self, slot: int) -> None:
        oldest = slot - self.buckets + 1
        while self._buckets and self._buckets[0][0] < oldest:
            self._buckets.popleft()

    def __repr__(self) -> str:
        totals = " ".join(f"{name}={self.total(name)}" for name in self._names)
        return f"<RollingCounts {self.window_s:g}s {totals}>"
