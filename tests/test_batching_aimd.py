"""AIMD batch size against a latency target, and the fixed size, on a fake clock."""

from __future__ import annotations

import pytest

from gateway.batching import AimdLimit, FixedLimit
from gateway.testing import FakeClock


def test_size_grows_by_one_per_full_batch_under_target():
    limit = AimdLimit(8, target_latency_ms=100, clock=FakeClock())
    for expected in (2, 3, 4):
        limit.observe(0.05, items=limit.limit)
        assert limit.limit == expected


def test_batches_smaller_than_the_limit_do_not_grow_it():
    limit = AimdLimit(8, target_latency_ms=100, clock=FakeClock(), initial=4)
    for _ in range(10):
        limit.observe(0.01, items=2)
    assert limit.limit == 4


def test_size_never_exceeds_max_size_nor_drops_below_one():
    limit = AimdLimit(3, target_latency_ms=100, clock=FakeClock(), min_samples=1)
    for _ in range(10):
        limit.observe(0.01, items=3)
    assert limit.limit == 3
    for _ in range(50):
        limit.observe(1.0, items=3)
    assert limit.limit == 1


def test_p90_over_target_shrinks_by_ten_percent_and_clears_the_window():
    limit = AimdLimit(32, target_latency_ms=100, clock=FakeClock(), initial=20)
    limit.observe(0.2, items=20)
    limit.observe(0.2, items=20)
    assert limit.limit == 20  # fewer than min_samples at this size
    limit.observe(0.2, items=20)
    assert limit.limit == 18
    assert "samples=0" in repr(limit)


def test_one_slow_batch_among_ten_is_under_the_p90():
    limit = AimdLimit(32, target_latency_ms=100, clock=FakeClock(), initial=10)
    for _ in range(9):
        limit.observe(0.05, items=1)
    limit.observe(0.5, items=1)
    assert limit.limit == 10
    assert limit.recent_p() == pytest.approx(0.05)


def test_samples_older_than_the_window_are_forgotten():
    clock = FakeClock()
    limit = AimdLimit(32, target_latency_ms=100, clock=clock, initial=10, window_s=10)
    limit.observe(0.5, items=1)
    limit.observe(0.5, items=1)
    clock.advance(11)
    limit.observe(0.05, items=1)
    assert limit.limit == 10 and limit.recent_p() == pytest.approx(0.05)


def test_out_of_memory_ceiling_caps_later_growth():
    limit = AimdLimit(32, target_latency_ms=100, clock=FakeClock(), initial=16)
    limit.backoff_to(8)
    for _ in range(20):
        limit.observe(0.01, items=limit.limit)
    assert limit.limit == 8


def test_settles_around_the_largest_size_that_meets_the_target():
    """Batch latency 46 ms + 4 ms per item against 100 ms: the best size is 13."""
    clock = FakeClock()
    limit = AimdLimit(32, target_latency_ms=100, clock=clock)
    seen = []
    for _ in range(300):
        size = limit.limit
        latency = 0.046 + 0.004 * size
        clock.advance(latency)
        limit.observe(latency, items=size)
        seen.append(size)
    assert 11 <= min(seen[-50:]) and max(seen[-50:]) <= 14


def test_fixed_limit_moves_only_on_out_of_memory():
    limit = FixedLimit(16)
    limit.observe(10.0, items=16)
    assert limit.limit == 16
    limit.backoff_to(8)
    limit.backoff_to(12)
    assert limit.limit == 8 and repr(limit) == "<FixedLimit limit=8/16>"


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError):
        AimdLimit(0, target_latency_ms=100)
    with pytest.raises(ValueError):
        AimdLimit(8, target_latency_ms=100, backoff=1.5)
    with pytest.raises(ValueError):
        FixedLimit(0)
