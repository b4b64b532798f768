"""Throttle rules: hysteresis, fail open / fail closed, strictest action, transitions.

The rules are the policy's own frozen types; rules that cannot work are refused when the
policy loads (``tests/test_policy.py``)."""

from __future__ import annotations

from gateway.policy.model import ThrottleLimit, ThrottleRule, When
from gateway.resilience.throttle import NO_THROTTLE, Throttle, ThrottleTransition
from gateway.telemetry import Sample, Telemetry
from gateway.testing import FakeClock

HOT = ThrottleRule("gpu-hot", "main", When("gpu_temperature_c", above=85, clear_below=80))
VRAM = ThrottleRule("vram-full", "main", When("gpu_memory_used_ratio", 0.90, 0.85), "shed")
WARM = ThrottleRule(
    "warm", "main", When("gpu_temperature_c", 80, 76), action="limit", limit=ThrottleLimit(4)
)


class Rig:
    def __init__(self, *rules: ThrottleRule, fail_closed: bool = False) -> None:
        self.clock = FakeClock()
        self.telemetry = Telemetry("main", 1000, fail_closed=fail_closed, clock=self.clock)
        self.events: list[ThrottleTransition] = []
        self.throttle = Throttle(
            rules,
            telemetry={"main": self.telemetry},
            clock=self.clock,
            on_transition=self.events.append,
        )

    def reading(self, **values: float) -> str:
        """Feed one sample and return the action decided for it."""
        self.telemetry.update(Sample(at=self.clock.now(), **values))
        return self.throttle.decide("main").action


def test_a_rule_fires_above_and_holds_until_below_clear_below() -> None:
    rig = Rig(HOT)
    temperatures = (84, 85, 86, 84, 81, 80, 79.9, 84, 85)
    seen = [rig.reading(gpu_temperature_c=t) for t in temperatures]
    off, on = "none", "reroute"
    assert seen == [off, off, on, on, on, on, off, off, off]
    assert [e.active for e in rig.events] == [True, False]
    assert rig.throttle.transitions[("gpu-hot", "main")] == 2


def test_a_signal_wavering_between_clear_below_and_above_never_flaps() -> None:
    rig = Rig(HOT)
    rig.reading(gpu_temperature_c=90)
    for t in (84, 81, 84.9, 80.5, 83, 85, 80):
        assert rig.reading(gpu_temperature_c=t) == "reroute"
    assert len(rig.events) == 1


def test_unknown_signal_neither_fires_nor_clears_when_failing_open() -> None:
    rig = Rig(HOT)
    assert rig.throttle.decide("main") is NO_THROTTLE  # no sample yet
    rig.reading(gpu_temperature_c=90)
    assert rig.reading(gpu_utilization=0.5) == "reroute"  # temperature unread: keeps firing
    rig.clock.advance(3.5)  # stale
    assert rig.throttle.decide("main").action == "reroute"
    rig.reading(gpu_temperature_c=70)
    assert rig.throttle.decide("main").action == "none"
    rig.clock.advance(10)
    assert rig.throttle.decide("main").action == "none"  # stale again: does not fire either


def test_unknown_signal_fires_when_the_backend_fails_closed() -> None:
    rig = Rig(HOT, fail_closed=True)
    assert rig.throttle.decide("main").action == "reroute"  # before any sample
    assert rig.reading(gpu_temperature_c=70) == "none"
    rig.clock.advance(3.001)
    assert rig.throttle.decide("main").action == "reroute"  # stale


def test_the_strictest_action_wins_and_limits_merge_to_the_smallest() -> None:
    tight = ThrottleRule(
        "hotter",
        "main",
        When("gpu_temperature_c", 82, 78),
        action="limit",
        limit=ThrottleLimit(max_concurrency=2, rps=50),
    )
    rig = Rig(HOT, VRAM, WARM, tight)
    assert rig.reading(gpu_temperature_c=81) == "limit"
    assert rig.throttle.decide("main").limit == ThrottleLimit(4)
    rig.reading(gpu_temperature_c=83)
    assert rig.throttle.decide("main").limit == ThrottleLimit(max_concurrency=2, rps=50)
    assert rig.reading(gpu_temperature_c=86) == "reroute"
    decision = rig.throttle.decide("main")
    assert decision.rule == "gpu-hot"
    assert decision.limit == ThrottleLimit(max_concurrency=2, rps=50)
    assert rig.reading(gpu_temperature_c=86, gpu_memory_used_ratio=0.95) == "shed"
    assert set(rig.throttle.decide("main").active) == {"gpu-hot", "vram-full", "warm", "hotter"}


def test_a_backend_without_rules_or_telemetry_is_never_throttled() -> None:
    rig = Rig(HOT)
    assert rig.throttle.decide("spare") is NO_THROTTLE


def test_reloading_rules_keeps_the_state_of_rules_that_stay_and_clears_removed_ones() -> None:
    rig = Rig(HOT, VRAM)
    rig.reading(gpu_temperature_c=90, gpu_memory_used_ratio=0.95)
    rig.throttle.set_rules([HOT])
    assert rig.throttle.is_active("gpu-hot", "main")
    assert not rig.throttle.is_active("vram-full", "main")
    assert rig.events[-1] == ThrottleTransition("vram-full", "main", False, None, rig.clock.now())
    assert rig.reading(gpu_temperature_c=82) == "reroute"


def test_decisions_are_cached_until_a_new_sample_arrives() -> None:
    rig = Rig(HOT)
    rig.reading(gpu_temperature_c=90)
    first = rig.throttle.decide("main")
    assert rig.throttle.decide("main") is first
    rig.reading(gpu_temperature_c=90)
    assert rig.throttle.decide("main") == first


def test_repr_names_the_active_rules() -> None:
    rig = Rig(HOT, VRAM)
    rig.reading(gpu_temperature_c=90)
    assert repr(rig.throttle) == "<Throttle rules=2 active=gpu-hot@main>"
