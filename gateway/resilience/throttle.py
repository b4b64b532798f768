"""Throttle rules over telemetry signals, with hysteresis, and the decision they add up to.

A rule fires when its signal rises above ``above`` and clears only when it falls below
``clear_below``; between the two it keeps its state, so a temperature hovering at the limit
does not flap.  An unknown signal (no sample yet, stale, unreadable) neither fires nor clears
a rule, unless its backend's telemetry fails closed, in which case unknown fires.  Several
rules may hold at once; the strictest action wins: shed > reroute > limit, and among limits
the smallest of each limit.

Evaluation is a few comparisons per rule, cached per backend until a new sample arrives or
the telemetry goes stale, so ``decide`` is cheap enough to call on every request.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeVar

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.policy.throttle import ThrottleLimit, ThrottleRule
from gateway.telemetry.signals import Telemetry

log = logging.getLogger(__name__)

STRICTNESS: dict[str, int] = {"none": 0, "limit": 1, "reroute": 2, "shed": 3}

T = TypeVar("T", int, float)


def tightest(a: ThrottleLimit, b: ThrottleLimit) -> ThrottleLimit:
    """Each field the smaller of the two (an unset field loses to a set one)."""
    return ThrottleLimit(
        max_concurrency=_min(a.max_concurrency, b.max_concurrency),
        rps=_min(a.rps, b.rps),
        batch_max_size=_min(a.batch_max_size, b.batch_max_size),
    )


def _min(a: T | None, b: T | None) -> T | None:
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


def rule_key(rule: ThrottleRule) -> tuple[str, str]:
    """A rule's identity across reloads: its name and backend."""
    return (rule.name, rule.backend)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the throttle says for a backend now: ``action`` of the strictest active ``rule``.

    ``limit`` merges every active limit rule even when a stricter action wins, so a caller
    that cannot reroute (no fallback) can still apply it.
    """

    action: Literal["none", "reroute", "shed", "limit"] = "none"
    rule: str | None = None
    active: tuple[str, ...] = ()
    limit: ThrottleLimit | None = None


NO_THROTTLE = Decision()


@dataclass(frozen=True, slots=True)
class ThrottleTransition:
    """A rule started (``active``) or stopped holding, with the value that moved it."""

    rule: str
    backend: str
    active: bool
    value: float | None
    at: float


class Throttle:
    """Holds every rule's state and answers ``decide(backend)``.

    ``telemetry`` maps backend names to their ``Telemetry`` (the caller may keep adding to
    it).  ``on_transition`` sees every change of a rule's state (metrics:
    ``gateway_throttle_active``, ``gateway_throttle_transitions_total``); ``transitions``
    counts them per (rule, backend).
    """

    def __init__(
        self,
        rules: Iterable[ThrottleRule] = (),
        *,
        telemetry: Mapping[str, Telemetry],
        clock: Clock = SYSTEM_CLOCK,
        on_transition: Callable[[ThrottleTransition], None] | None = None,
    ) -> None:
        self._telemetry = telemetry
        self._clock = clock
        self.on_transition = on_transition
        self.transitions: Counter[tuple[str, str]] = Counter()
        self._active: dict[tuple[str, str], bool] = {}
        self._by_backend: dict[str, tuple[ThrottleRule, ...]] = {}
        self._cache: dict[str, tuple[tuple[int, bool], Decision]] = {}
        self.set_rules(rules)

    @property
    def rules(self) -> tuple[ThrottleRule, ...]:
        return tuple(r for rules in self._by_backend.values() for r in rules)

    def set_rules(self, rules: Iterable[ThrottleRule]) -> None:
        """Swap in a reloaded rule set; a rule of the same name and backend keeps its state."""
        rules = tuple(rules)
        keys = [rule_key(r) for r in rules]
        if len(set(keys)) != len(keys):
            raise ValueError("two throttle rules share a name on the same backend")
        for key in set(self._active) - set(keys):
            if self._active.pop(key):
                self._emit(ThrottleTransition(key[0], key[1], False, None, self._clock.now()))
        by_backend: dict[str, list[ThrottleRule]] = {}
        for rule in rules:
            by_backend.setdefault(rule.backend, []).append(rule)
            self._active.setdefault(rule_key(rule), False)
        self._by_backend = {b: tuple(rs) for b, rs in by_backend.items()}
        self._cache.clear()

    def is_active(self, rule: str, backend: str) -> bool:
        return self._active.get((rule, backend), False)

    def decide(self, backend: str) -> Decision:
        """The decision for ``backend`` now, re-evaluating only when its telemetry moved."""
        rules = self._by_backend.get(backend)
        if not rules:
            return NO_THROTTLE
        telemetry = self._telemetry.get(backend)
        key = (-1, True) if telemetry is None else (telemetry.samples, telemetry.stale)
        cached = self._cache.get(backend)
        if cached is not None and cached[0] == key:
            return cached[1]
        decision = self._evaluate(rules, telemetry)
        self._cache[backend] = (key, decision)
        return decision

    def on_sample(self, telemetry: Telemetry) -> None:
        """A poller's ``on_sample`` hook: evaluate at sample time, so transitions show at once."""
        self.decide(telemetry.backend)

    def _evaluate(self, rules: tuple[ThrottleRule, ...], telemetry: Telemetry | None) -> Decision:
        sample = None if telemetry is None else telemetry.current()
        fail_closed = telemetry.fail_closed if telemetry is not None else False
        strictest: ThrottleRule | None = None
        active: list[str] = []
        limit: ThrottleLimit | None = None
        for rule in rules:
            when = rule.when
            value = None if sample is None else sample.value(when.signal)
            was = self._active[rule_key(rule)]
            if value is None:
                now = was or fail_closed
            else:
                now = value >= when.clear_below if was else value > when.above
            if now != was:
                self._active[rule_key(rule)] = now
                self._emit(ThrottleTransition(rule.name, rule.backend, now, value, self._now()))
            if not now:
                continue
            active.append(rule.name)
            if rule.limit is not None:
                limit = rule.limit if limit is None else tightest(limit, rule.limit)
            if strictest is None or STRICTNESS[rule.action] > STRICTNESS[strictest.action]:
                strictest = rule
        if strictest is None:
            return NO_THROTTLE
        return Decision(strictest.action, strictest.name, tuple(active), limit)

    def _now(self) -> float:
        return self._clock.now()

    def _emit(self, transition: ThrottleTransition) -> None:
        self.transitions[(transition.rule, transition.backend)] += 1
        log.info(
            "throttle %s on %s %s (value %s)",
            transition.rule,
            transition.backend,
            "fired" if transition.active else "cleared",
            transition.value,
        )
        if self.on_transition is not None:
            self.on_transition(transition)

    def __repr__(self) -> str:
        active = [f"{name}@{backend}" for (name, backend), on in self._active.items() if on]
        return f"<Throttle rules={len(self._active)} active={','.join(active) or '-'}>"
