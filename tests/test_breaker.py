"""The circuit breaker: what counts as failure, its transitions, and the half-open probe limit."""

from __future__ import annotations

import pytest

from gateway.errors import CircuitOpen, Overloaded, UpstreamTimeout, UpstreamUnavailable
from gateway.policy.model import CircuitBreaker
from gateway.resilience.breaker import Breaker, BreakerTransition, Outcome
from gateway.testing import FakeClock

CONFIG = CircuitBreaker(failure_rate=0.5, min_calls=4, window_s=10, open_s=5, half_open_calls=2)


def make(config: CircuitBreaker = CONFIG) -> tuple[Breaker, FakeClock, list[BreakerTransition]]:
    clock = FakeClock()
    events: list[BreakerTransition] = []
    return Breaker("main", config, clock=clock, on_transition=events.append), clock, events


def call(breaker: Breaker, outcome: Outcome) -> None:
    breaker.acquire().record(outcome)


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        (200, Outcome.SUCCESS),
        (302, Outcome.SUCCESS),
        (400, Outcome.SUCCESS),
        (404, Outcome.SUCCESS),
        (429, Outcome.IGNORED),
        (503, Outcome.IGNORED),
        (500, Outcome.FAILURE),
        (502, Outcome.FAILURE),
        (504, Outcome.FAILURE),
    ],
)
def test_only_5xx_other_than_503_count_as_failures(status: int, outcome: Outcome) -> None:
    assert Outcome.of_status(status) is outcome


def test_connect_errors_and_timeouts_fail_but_shedding_and_cancellation_do_not() -> None:
    assert Outcome.of_error(UpstreamUnavailable("refused")) is Outcome.FAILURE
    assert Outcome.of_error(UpstreamTimeout("slow")) is Outcome.FAILURE
    assert Outcome.of_error(Overloaded("queue full")) is Outcome.IGNORED


def test_it_opens_at_the_failure_rate_only_once_min_calls_are_seen() -> None:
    breaker, _, events = make()
    for _ in range(3):
        call(breaker, Outcome.FAILURE)
    assert breaker.state == "closed"  # 3 of 3 failed, but fewer than min_calls
    call(breaker, Outcome.SUCCESS)
    call(breaker, Outcome.SUCCESS)
    assert breaker.state == "closed"  # 3 of 5 = 60%, but only failures trip it
    call(breaker, Outcome.FAILURE)
    assert breaker.state == "open"
    assert [(e.old, e.new) for e in events] == [("closed", "open")]


def test_back_pressure_and_client_errors_never_open_it() -> None:
    breaker, _, _ = make()
    for status in [429, 503, 400, 404] * 10:
        call(breaker, Outcome.of_status(status))
    assert breaker.state == "closed"


def test_failures_older_than_the_window_are_forgotten() -> None:
    breaker, clock, _ = make()
    for _ in range(3):
        call(breaker, Outcome.FAILURE)
    clock.advance(11)
    call(breaker, Outcome.FAILURE)
    assert breaker.state == "closed"
    assert repr(breaker) == "<Breaker main state=closed failures=1/1 in_a_row=4/5>"


def test_an_open_breaker_refuses_with_retry_after_then_half_opens_after_open_s() -> None:
    breaker, clock, _ = make()
    for _ in range(4):
        call(breaker, Outcome.FAILURE)
    clock.advance(2.6)
    assert not breaker.allow()
    with pytest.raises(CircuitOpen) as caught:
        breaker.acquire()
    assert caught.value.retry_after_s == pytest.approx(2.4)
    assert caught.value.status == 503
    assert repr(breaker) == "<Breaker main state=open retry_in=2.4s failures=4/4 in_a_row=0/5>"
    clock.advance(2.4)
    assert breaker.state == "half_open"


def open_then_half_open(breaker: Breaker, clock: FakeClock) -> None:
    for _ in range(4):
        call(breaker, Outcome.FAILURE)
    clock.advance(CONFIG.open_s)
    assert breaker.state == "half_open"


def test_half_open_lets_at_most_half_open_calls_probes_through() -> None:
    breaker, clock, _ = make()
    open_then_half_open(breaker, clock)
    first, second = breaker.acquire(), breaker.acquire()
    assert first.probe and second.probe
    assert not breaker.allow()
    with pytest.raises(CircuitOpen):
        breaker.acquire()
    first.record(Outcome.SUCCESS)
    with pytest.raises(CircuitOpen):
        breaker.acquire()  # a finished probe does not free its slot for another
    second.record(Outcome.SUCCESS)
    assert breaker.state == "closed"


def test_a_failed_probe_opens_it_again_for_another_open_s() -> None:
    breaker, clock, events = make()
    open_then_half_open(breaker, clock)
    probe = breaker.acquire()
    probe.record(Outcome.FAILURE)
    assert breaker.state == "open"
    assert breaker.retry_in_s == pytest.approx(CONFIG.open_s)
    assert [(e.old, e.new) for e in events] == [
        ("closed", "open"),
        ("open", "half_open"),
        ("half_open", "open"),
    ]


def test_a_released_or_back_pressured_probe_frees_its_slot() -> None:
    breaker, clock, _ = make()
    open_then_half_open(breaker, clock)
    breaker.acquire().release()
    breaker.acquire().record(Outcome.IGNORED)
    probes = [breaker.acquire(), breaker.acquire()]
    for p in probes:
        p.record(Outcome.SUCCESS)
    assert breaker.state == "closed"


def test_outcomes_of_calls_begun_before_the_state_changed_are_ignored() -> None:
    breaker, clock, _ = make()
    slow = breaker.acquire()
    open_then_half_open(breaker, clock)
    slow.record(Outcome.FAILURE)  # began while closed; must not reopen the half-open breaker
    assert breaker.state == "half_open"
    assert breaker.allow()


def test_closing_starts_a_fresh_window() -> None:
    breaker, clock, _ = make()
    open_then_half_open(breaker, clock)
    for p in [breaker.acquire(), breaker.acquire()]:
        p.record(Outcome.SUCCESS)
    call(breaker, Outcome.FAILURE)
    assert breaker.state == "closed"
    assert repr(breaker) == "<Breaker main state=closed failures=1/1 in_a_row=1/5>"


def test_recording_a_permit_twice_counts_once() -> None:
    breaker, _, _ = make()
    permit = breaker.acquire()
    for _ in range(5):
        permit.record(Outcome.FAILURE)
    assert repr(breaker) == "<Breaker main state=closed failures=1/1 in_a_row=1/5>"


def test_transitions_are_counted_per_edge() -> None:
    breaker, clock, _ = make()
    open_then_half_open(breaker, clock)
    assert breaker.transitions == {("closed", "open"): 1, ("open", "half_open"): 1}


def test_reconfiguring_keeps_the_state() -> None:
    breaker, _, _ = make()
    for _ in range(4):
        call(breaker, Outcome.FAILURE)
    breaker.configure(CircuitBreaker(open_s=60))
    assert breaker.state == "open"
    assert breaker.retry_in_s == pytest.approx(60)


def test_failures_in_a_row_open_it_whatever_the_rate() -> None:
    """A busy backend that suddenly fails: 100 successes in the window would hold a
    rate-based trip back for 100 more calls; five failures in a row open it at once."""
    breaker, _, moves = make(CircuitBreaker(failure_rate=0.5, min_calls=4, window_s=60))
    for _ in range(100):
        call(breaker, Outcome.SUCCESS)
    for _ in range(4):
        call(breaker, Outcome.FAILURE)
    assert breaker.state == "closed"
    call(breaker, Outcome.FAILURE)
    assert breaker.state == "open"
    assert [(t.old, t.new) for t in moves] == [("closed", "open")]


def test_a_success_or_a_reopening_starts_the_count_again() -> None:
    breaker, _, _ = make(CircuitBreaker(min_calls=1000, window_s=60, consecutive_failures=3))
    for _ in range(10):
        call(breaker, Outcome.FAILURE)
        call(breaker, Outcome.FAILURE)
        call(breaker, Outcome.IGNORED)  # back-pressure neither breaks nor resets the run
        call(breaker, Outcome.SUCCESS)
    assert breaker.state == "closed"
    assert "in_a_row=0/3" in repr(breaker)


def test_zero_consecutive_failures_leaves_only_the_rate() -> None:
    breaker, _, _ = make(CircuitBreaker(min_calls=1000, window_s=60, consecutive_failures=0))
    for _ in range(50):
        call(breaker, Outcome.FAILURE)
    assert breaker.state == "closed"
