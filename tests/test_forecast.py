"""The request-rate forecaster on synthetic seasonal traffic: it follows the daily shape
(rising before a peak it has seen on earlier days), the weekday (a weekend is lighter) and
the trend; with little history it says it is naive; the history counts per wall-clock
minute and stays bounded."""

from __future__ import annotations

import math

import pytest

from gateway.policy.model import Backend, Prewarm
from gateway.pool.forecast import DAY_MIN, WEEK_MIN, RateHistory, RouteRate, forecast
from gateway.pool.stage import HISTORIES, desired_endpoints
from gateway.testing import FakeClock
from tests.backends import Model, post
from tests.helpers import policy, problems_of

MONDAY = 1_700_438_400 // 60  # 2023-11-20 00:00 UTC, a Monday, in minutes since the epoch


def rate(minute: int, growth: float = 0.0) -> float:
    """Requests per minute: a daily peak at 14:00, weekends at half, a slow growth."""
    of_day = minute % DAY_MIN
    shape = 100 + 80 * math.cos(2 * math.pi * (of_day - 14 * 60) / DAY_MIN)
    weekday = (minute // DAY_MIN + 3) % 7
    scale = 0.5 if weekday >= 5 else 1.0
    return shape * scale * (1 + growth * (minute - MONDAY) / WEEK_MIN)


def series(days: float, growth: float = 0.0, start: int = MONDAY) -> list[float]:
    return [rate(start + m, growth) for m in range(int(days * DAY_MIN))]


def truth(at: int, horizon_min: int, growth: float = 0.0) -> float:
    return sum(rate(at + m, growth) for m in range(horizon_min)) / horizon_min / 60


def test_it_rises_ahead_of_a_daily_peak_it_has_seen() -> None:
    counts = series(7 + 10 / 24)  # a week, then the next Monday until 10:00
    now = MONDAY + len(counts)
    predicted = forecast(counts, MONDAY, 3600)
    assert predicted.method == "holt-winters"
    expected = truth(now, 60)
    assert predicted.requests_per_s == pytest.approx(expected, rel=0.15)
    last_hour = sum(counts[-60:]) / 60 / 60
    assert predicted.requests_per_s > last_hour  # the morning climb is foreseen


def test_a_weekend_is_forecast_lighter_than_a_weekday() -> None:
    friday_noon = series(4 + 12 / 24)
    saturday_noon = series(5 + 12 / 24)
    weekday = forecast(friday_noon, MONDAY, 1800).requests_per_s
    weekend = forecast(saturday_noon, MONDAY, 1800).requests_per_s
    assert weekend == pytest.approx(weekday / 2, rel=0.2)


def test_a_trend_is_followed() -> None:
    counts = series(7 + 10 / 24, growth=0.5)
    now = MONDAY + len(counts)
    flat = forecast(series(7 + 10 / 24), MONDAY, 3600).requests_per_s
    grown = forecast(counts, MONDAY, 3600).requests_per_s
    assert grown > flat
    assert grown == pytest.approx(truth(now, 60, growth=0.5), rel=0.15)


def test_with_little_history_the_forecast_says_it_is_naive() -> None:
    counts = [30.0] * 300
    predicted = forecast(counts, MONDAY, 600)
    assert predicted.method == "last-hour mean"
    assert predicted.requests_per_s == pytest.approx(0.5)
    assert forecast([], MONDAY, 600).requests_per_s == 0.0


def test_the_history_counts_per_wall_clock_minute_and_is_bounded() -> None:
    clock = FakeClock(wall_start=MONDAY * 60.0)
    history = RateHistory(clock, max_minutes=5)
    history.record(3)
    clock.advance(60)
    history.record()
    history.record()
    clock.advance(120)  # a silent minute is a zero
    history.record()
    counts, first = history.complete()
    assert counts == [3, 2, 0]
    assert first == MONDAY
    clock.advance(600)
    counts, first = history.complete()
    assert len(counts) == 4 and counts == [0, 0, 0, 0]  # bounded: the oldest fell off


async def test_a_prewarm_route_exports_its_forecast_and_the_endpoints_it_needs(
    pipeline,
) -> None:
    """Through the gateway (no sockets, a fake clock): 30 requests in one minute forecast
    0.5 requests/s (too little history for a season: the last hour's mean), and at 0.25
    requests/s per endpoint with 20% headroom the backend needs ceil(2.4) = 3 endpoints."""
    clock = FakeClock(wall_start=MONDAY * 60.0)
    model = Model("main")
    gw = await pipeline(
        policy(
            {"main": {"endpoints": ["http://a", "http://b"]}},
            {"prewarm": {"horizon_s": 600, "headroom": 1.2, "endpoint_rps": 0.25}},
        ),
        {"main": model},
        clock=clock,
    )
    for i in range(30):
        assert (await post(gw, f"q{i}")).status_code == 200
    clock.advance(60)
    assert gw.metric("gateway_forecast_requests_per_second", route="chat") == pytest.approx(0.5)
    assert gw.metric("gateway_desired_endpoints", backend="main") == 3
    rate = gw.gateway.registry.peek(HISTORIES, "chat")
    assert rate is not None and rate.history.complete()[0] == [30]


def test_without_endpoint_rps_the_best_minute_seen_sets_the_per_endpoint_rate() -> None:
    clock = FakeClock(wall_start=MONDAY * 60.0)
    rate = RouteRate(RateHistory(clock))
    backend = Backend("m", endpoints=("http://a", "http://b"))
    assert desired_endpoints(rate, Prewarm(), backend) == 2  # no history: what it lists
    rate.history.record(120)  # the best minute: 2 requests/s on 2 endpoints
    clock.advance(60)
    rate.history.record(60)
    clock.advance(60)
    # the forecast (last-hour mean) is 1.5 requests/s; x 1.2 over 1 request/s per endpoint
    assert desired_endpoints(rate, Prewarm(headroom=1.2), backend) == 2
    assert desired_endpoints(rate, Prewarm(headroom=2.0), backend) == 3


@pytest.mark.parametrize(
    ("prewarm", "message"),
    [
        ("{horizon_s: 0}", "prewarm.horizon_s: must be greater than 0"),
        ("{headroom: 0.5}", "prewarm.headroom: must be at least 1"),
        ("{endpoint_rps: -1}", "prewarm.endpoint_rps: must be greater than 0"),
    ],
)
def test_prewarm_settings_that_cannot_work_are_refused(prewarm: str, message: str) -> None:
    text = f'backends: {{main: {{url: "http://a"}}}}\nroutes: [{{backend: main, prewarm: {prewarm}}}]\n'
    found = problems_of(text)
    assert any(message in p for p in found), found
