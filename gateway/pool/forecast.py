"""A route's request-rate history and a forecast that knows the day and the week.

``RateHistory`` counts requests per minute (a week by default, bounded).  ``forecast``
predicts the mean rate over the next ``horizon_s`` with Holt-Winters' additive method
(level, trend and a daily season, on 10-minute buckets), after dividing out a day-of-week
factor (each weekday's mean over the history's mean, from the full days seen; 1.0 for a
weekday not seen yet).  Why Holt-Winters: traffic to a model is a daily shape (people
work, sleep) scaled by the weekday (weekends are lighter) with a slow trend (growth), and
exponential smoothing tracks all three with a handful of numbers, no training step and no
dependency, and adapts within hours when the shape moves.  With less than two days of
history there is no season to learn: the forecast is the last hour's mean (a naive
forecast, said as such in ``Forecast.method``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.clock import SYSTEM_CLOCK, Clock

MINUTE_S = 60
BUCKET_MIN = 10
DAY_MIN = 24 * 60
WEEK_MIN = 7 * DAY_MIN
SEASON = DAY_MIN // BUCKET_MIN
ALPHA, BETA, GAMMA = 0.3, 0.02, 0.3
"""Smoothing of level, trend and season (per 10-minute bucket)."""
FLEET_STALE_MIN = 3
"""Minutes after which the fleet's counts (``shared.py``) give way to this replica's own."""


class RateHistory:
    """Requests per minute, the last ``max_minutes`` of them (a week by default)."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK, max_minutes: int = WEEK_MIN) -> None:
        self._clock = clock
        self._counts: deque[int] = deque(maxlen=max_minutes)
        self._minute: int | None = None  # the wall-clock minute of the last count

    def record(self, n: int = 1) -> None:
        self._roll()
        self._counts[-1] += n

    def _roll(self) -> None:
        minute = int(self._clock.wall() // MINUTE_S)
        if self._minute is None:
            self._counts.append(0)
        else:
            for _ in range(min(max(0, minute - self._minute), self._counts.maxlen or 0)):
                self._counts.append(0)
        self._minute = minute

    def minute(self) -> int:
        """The wall-clock minute (since the epoch) now: what a cached figure is keyed by."""
        self._roll()
        return self._minute or 0

    def complete(self) -> tuple[list[int], int]:
        """The counts of the finished minutes, oldest first, and the wall-clock minute
        (since the epoch) of the first of them."""
        self._roll()
        counts = list(self._counts)[:-1]
        return counts, (self._minute or 0) - len(counts)


@dataclass(frozen=True, slots=True)
class Forecast:
    """The predicted mean request rate over the horizon, and how it was made."""

    requests_per_s: float
    horizon_s: float
    method: str


def forecast(counts: Sequence[float], first_minute: int, horizon_s: float) -> Forecast:
    """The mean requests/s over the ``horizon_s`` after the last of ``counts`` (per-minute
    counts, the first at wall-clock minute ``first_minute`` since the epoch)."""
    horizon_min = max(1, math.ceil(horizon_s / MINUTE_S))
    if len(counts) < 2 * DAY_MIN:
        recent = list(counts[-60:]) or [0.0]
        return Forecast(sum(recent) / len(recent) / MINUTE_S, horizon_s, "last-hour mean")
    factors = _weekday_factors(counts, first_minute)

    def weekday(minute: int) -> int:
        return (minute // DAY_MIN + 3) % 7  # 1970-01-01 was a Thursday: Monday is 0

    start = len(counts) % BUCKET_MIN  # whole buckets, ending at the last full minute
    buckets = []
    for i in range(start, len(counts), BUCKET_MIN):
        minute = first_minute + i
        buckets.append(sum(counts[i : i + BUCKET_MIN]) / factors[weekday(minute)])
    level = sum(buckets[:SEASON]) / SEASON
    trend = (sum(buckets[SEASON : 2 * SEASON]) - sum(buckets[:SEASON])) / SEASON / SEASON
    season = [b - level for b in buckets[:SEASON]]
    for t in range(SEASON, len(buckets)):
        x, s = buckets[t], season[t % SEASON]
        previous = level
        level = ALPHA * (x - s) + (1 - ALPHA) * (level + trend)
        trend = BETA * (level - previous) + (1 - BETA) * trend
        season[t % SEASON] = GAMMA * (x - level) + (1 - GAMMA) * s
    ahead = -(-horizon_min // BUCKET_MIN)
    end_minute = first_minute + len(counts)
    total = 0.0
    for h in range(1, ahead + 1):
        value = level + h * trend + season[(len(buckets) + h - 1) % SEASON]
        total += max(0.0, value) * factors[weekday(end_minute + (h - 1) * BUCKET_MIN)]
    return Forecast(total / (ahead * BUCKET_MIN * MINUTE_S), horizon_s, "holt-winters")


def _weekday_factors(counts: Sequence[float], first_minute: int) -> list[float]:
    """Each weekday's mean per-minute count over the mean of all full days (1.0 unseen)."""
    sums = [0.0] * 7
    days = [0] * 7
    offset = (-first_minute) % DAY_MIN  # minutes until the first midnight
    for start in range(offset, len(counts) - DAY_MIN + 1, DAY_MIN):
        day = ((first_minute + start) // DAY_MIN + 3) % 7
        sums[day] += sum(counts[start : start + DAY_MIN])
        days[day] += 1
    seen = [sums[d] / days[d] for d in range(7) if days[d]]
    mean = sum(seen) / len(seen) if seen else 0.0
    if mean <= 0:
        return [1.0] * 7
    return [(sums[d] / days[d]) / mean if days[d] and sums[d] > 0 else 1.0 for d in range(7)]


class RouteRate:
    """A route's request history, and its forecast and best minute, each computed at most
    once a minute (the pool sizing asks on every pick; the history is a week long)."""

    def __init__(self, history: RateHistory) -> None:
        self.history = history
        self._forecast: tuple[int, float, Forecast] | None = None
        self._best: tuple[int, float] | None = None
        self._fleet: tuple[list[int], int, int] | None = None  # counts, first, read at

    def use_fleet(self, counts: list[int], first_minute: int) -> None:
        """Forecast from the fleet's counts (``shared.py``) rather than this replica's."""
        self._fleet = (counts, first_minute, self.history.minute())
        self._forecast = self._best = None

    def counts(self) -> tuple[list[int], int]:
        """The finished minutes' counts the forecast uses, and the first one's minute: the
        fleet's while they are fresh, else this replica's own."""
        if self._fleet is not None and self.history.minute() - self._fleet[2] <= FLEET_STALE_MIN:
            return self._fleet[0], self._fleet[1]
        return self.history.complete()

    def forecast(self, horizon_s: float) -> Forecast:
        minute = self.history.minute()
        if self._forecast is None or self._forecast[:2] != (minute, horizon_s):
            counts, first = self.counts()
            self._forecast = (minute, horizon_s, forecast(counts, first, horizon_s))
        return self._forecast[2]

    def best_rps(self) -> float:
        minute = self.history.minute()
        if self._best is None or self._best[0] != minute:
            counts, _ = self.counts()
            self._best = (minute, max(counts, default=0) / MINUTE_S)
        return self._best[1]
