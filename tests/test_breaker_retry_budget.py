"""The retry budget: a share of recent requests, with a floor for quiet services."""

from __future__ import annotations

from gateway.policy.model import RetryBudget
from gateway.resilience.retry_budget import RetryAllowance
from gateway.testing import FakeClock


def spend_all(budget: RetryAllowance) -> int:
    spent = 0
    while budget.try_spend():
        spent += 1
    return spent


def test_a_quiet_service_may_still_retry_up_to_the_floor() -> None:
    budget = RetryAllowance(
        RetryBudget(ratio=0.2, min_retries_per_s=3, window_s=10), clock=FakeClock()
    )
    assert spend_all(budget) == 30
    assert budget.denied == 1


def test_retries_are_capped_at_the_ratio_of_recent_requests_plus_the_floor() -> None:
    budget = RetryAllowance(
        RetryBudget(ratio=0.2, min_retries_per_s=1, window_s=10), clock=FakeClock()
    )
    for _ in range(1000):
        budget.record_request()
    assert spend_all(budget) == 210


def test_the_budget_refills_as_old_retries_leave_the_window() -> None:
    clock = FakeClock()
    budget = RetryAllowance(RetryBudget(ratio=0.0, min_retries_per_s=1, window_s=10), clock=clock)
    assert spend_all(budget) == 10
    clock.advance(10)
    assert budget.try_spend()
    assert repr(budget) == "<RetryAllowance requests=0 retries=1 available=9 denied=1>"
