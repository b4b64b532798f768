"""A circuit breaker per backend: stop sending to a backend that keeps failing, then probe it.

    closed --(consecutive_failures in a row, or
              failure rate >= failure_rate over >= min_calls in window_s)--> open
    open --(open_s passed)--> half_open
    half_open --(half_open_calls probes all succeed)--> closed
    half_open --(a probe fails)--> open

The two trips answer different outages: the consecutive count (Envoy outlier detection's
``consecutive_5xx``, default 5) sees a busy backend that suddenly fails at once, where the
healthy calls already in the window would hold a rate-based trip back for seconds; the rate
sees a backend that fails often but not always.

Only the backend being broken counts as failure: connect errors, timeouts and 5xx other than
503, and failures after the head (a body cut or left idle mid-way, one the gateway cannot
parse: the caller records those when the body ends).  A 4xx is the client's fault and counts
as a success (the backend answered); 429 and 503 are back-pressure, the backend alive but
busy, and count as neither.  While half-open at most
``half_open_calls`` probes are let through, so after the breaker opens at most that many
requests per ``open_s`` reach the backend.  Calls go through a ``Permit`` so that an outcome
that arrives after the state moved on (a slow call from before the breaker opened) is ignored.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import CircuitOpen, UpstreamError
from gateway.policy.backend import CircuitBreaker
from gateway.resilience.rolling import RollingCounts

log = logging.getLogger(__name__)

HALF_OPEN_BUSY_RETRY_S = 1.0
"""Retry-After for a call refused because every half-open probe slot is taken."""

State = Literal["closed", "open", "half_open"]
STATE_VALUES: dict[State, int] = {"closed": 0, "open": 1, "half_open": 2}
"""The ``gateway_breaker_state`` gauge's encoding."""


class Outcome(enum.Enum):
    """How one upstream call counts for the breaker."""

    SUCCESS = "success"
    FAILURE = "failure"
    IGNORED = "ignored"

    @classmethod
    def of_status(cls, status: int) -> Outcome:
        """5xx other than 503 fail; 429 and 503 are back-pressure; everything else succeeds."""
        if status in (429, 503):
            return cls.IGNORED
        return cls.FAILURE if status >= 500 else cls.SUCCESS

    @classmethod
    def of_error(cls, error: BaseException) -> Outcome:
        """Connect errors and timeouts (``UpstreamError``) fail; anything else is not the
        backend's doing (the client went away, the gateway shed the call)."""
        return cls.FAILURE if isinstance(error, UpstreamError) else cls.IGNORED


@dataclass(frozen=True, slots=True)
class BreakerTransition:
    """The breaker of ``backend`` moved from ``old`` to ``new`` at ``at``."""

    backend: str
    old: State
    new: State
    at: float


class Permit:
    """Leave to make one call; report how it went with ``record`` (or ``release`` if unused)."""

    __slots__ = ("_breaker", "_done", "generation", "probe")

    def __init__(self, breaker: Breaker, generation: int, probe: bool) -> None:
        self._breaker = breaker
        self.generation = generation
        self.probe = probe
        self._done = False

    def record(self, outcome: Outcome) -> None:
        """Count the call's outcome; only the first record or release of a permit counts."""
        if not self._done:
            self._done = True
            self._breaker._record(self, outcome)

    def release(self) -> None:
        """Give the permit back without an outcome (the call was never made or was cancelled)."""
        self.record(Outcome.IGNORED)

    def __repr__(self) -> str:
        kind = "probe" if self.probe else "call"
        return f"<Permit {self._breaker.backend} {kind} gen={self.generation} done={self._done}>"


class Breaker:
    """The circuit breaker of one backend; see the module docstring for the states."""

    def __init__(
        self,
        backend: str,
        config: CircuitBreaker | None = None,
        *,
        clock: Clock = SYSTEM_CLOCK,
        on_transition: Callable[[BreakerTransition], None] | None = None,
    ) -> None:
        self.backend = backend
        self.config = config = config or CircuitBreaker()
        self.on_transition = on_transition
        self.transitions: Counter[tuple[State, State]] = Counter()
        self._clock = clock
        self._state: State = "closed"
        self._generation = 0
        self._opened_at = 0.0
        self._probes_out = 0
        self._probes_ok = 0
        self._in_a_row = 0
        self._window = RollingCounts(("success", "failure"), config.window_s, clock)

    def configure(self, config: CircuitBreaker) -> None:
        """Apply a reloaded config, keeping the current state (and, if the window is the same
        length, the counts)."""
        if config.window_s != self.config.window_s:
            self._window = RollingCounts(("success", "failure"), config.window_s, self._clock)
        self.config = config

    @property
    def state(self) -> State:
        if self._state == "open" and self._clock.now() >= self._opened_at + self.config.open_s:
            self._move("half_open")
        return self._state

    @property
    def retry_in_s(self) -> float:
        """Seconds until the breaker lets a probe by; 0 unless open."""
        if self.state != "open":
            return 0.0
        return max(0.0, self._opened_at + self.config.open_s - self._clock.now())

    def allow(self) -> bool:
        """Whether ``acquire`` would succeed now (it takes nothing)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open":
            return self._probes_out + self._probes_ok < self.config.half_open_calls
        return False

    def acquire(self) -> Permit:
        """A permit for one call, or ``CircuitOpen`` (with a Retry-After) if none is allowed."""
        state = self.state
        if state == "closed":
            return Permit(self, self._generation, probe=False)
        if state == "half_open":
            if self._probes_out + self._probes_ok < self.config.half_open_calls:
                self._probes_out += 1
                return Permit(self, self._generation, probe=True)
            raise CircuitOpen(
                f"backend {self.backend!r} is being probed after failing",
                retry_after_s=HALF_OPEN_BUSY_RETRY_S,
                backend=self.backend,
            )
        raise CircuitOpen(
            f"backend {self.backend!r} is failing; its circuit breaker is open",
            retry_after_s=max(1.0, self.retry_in_s),
            backend=self.backend,
        )

    def _record(self, permit: Permit, outcome: Outcome) -> None:
        if permit.generation != self._generation:
            return  # the state moved on since this call began; its outcome is history
        if permit.probe:
            self._probes_out -= 1
            if outcome is Outcome.FAILURE:
                self._open()
            elif outcome is Outcome.SUCCESS:
                self._probes_ok += 1
                if self._probes_ok >= self.config.half_open_calls:
                    self._move("closed")
            return
        if outcome is Outcome.SUCCESS:
            self._in_a_row = 0
            self._window.add("success")
        elif outcome is Outcome.FAILURE:
            self._in_a_row += 1
            self._window.add("failure")
            failures = self._window.total("failure")
            calls = failures + self._window.total("success")
            in_a_row = self.config.consecutive_failures
            if (in_a_row and self._in_a_row >= in_a_row) or (
                calls >= self.config.min_calls and failures >= self.config.failure_rate * calls
            ):
                self._open()

    def _open(self) -> None:
        self._opened_at = self._clock.now()
        self._move("open")

    def _move(self, new: State) -> None:
        old, self._state = self._state, new
        self._generation += 1
        self._probes_out = self._probes_ok = 0
        self._in_a_row = 0
        if new == "closed":
            self._window.clear()
        self.transitions[(old, new)] += 1
        log.warning("breaker %s: %s -> %s", self.backend, old, new)
        if self.on_transition is not None:
            self.on_transition(BreakerTransition(self.backend, old, new, self._clock.now()))

    def __repr__(self) -> str:
        state = self.state
        failures = self._window.total("failure")
        calls = failures + self._window.total("success")
        detail = ""
        if state == "open":
            detail = f" retry_in={self.retry_in_s:.1f}s"
        elif state == "half_open":
            probes = f"{self._probes_ok}ok+{self._probes_out}out/{self.config.half_open_calls}"
            detail = f" probes={probes}"
        return (
            f"<Breaker {self.backend} state={state}{detail} failures={failures}/{calls} "
            f"in_a_row={self._in_a_row}/{self.config.consecutive_failures}>"
        )
