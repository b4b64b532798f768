"""How much one call may ask a model to generate (a route's ``generation``).

A call asking for more output tokens than the route's ``max_tokens`` is sent with
``max_tokens`` instead (or refused, ``over: refuse``); a call naming no bound, or ``null``, is
given ``default_max_tokens`` (else ``max_tokens``), so that it cannot hold a slot for the
model's whole context; a call asking for more choices than ``max_choices`` (``n``, a
completion's ``best_of``) is refused: clamping those would change the answer's shape.
``X-Gateway-Max-Tokens`` tells the client the bound its call was sent with whenever the
gateway set it.

Under a bound, a value the gateway cannot read as the positive integer it must be is a 400
naming the field, never passed on: model servers read loosely (pydantic turns
``"100000"`` and ``100000.0`` into an integer; llama.cpp reads ``-1`` as no bound at all),
so a bound a client could write around would bound nothing.

The stage stands before the cache, single flight and the limits: they see the call as it
goes upstream, so a clamped call shares the cache and a flight with one that asked for the
bound, and a token limit's estimate is the bound it was sent with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from gateway.errors import FieldRefused
from gateway.metrics import Metrics
from gateway.openai.body import dumps_yielding
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.generation import CHOICE_FIELDS, OUTPUT_FIELDS, Generation
from gateway.policy.model import Policy

BOUND_HEADER = "X-Gateway-Max-Tokens"
ACTIONS = ("clamped", "defaulted", "refused")


class GenerationBounds:
    """The stage; see the module docstring.  ``counted(route, action)`` counts each change
    or refusal."""

    def __init__(self, routes: dict[str, Generation], counted: Callable[[str, str], None]) -> None:
        self._routes = routes
        self._counted = counted

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        bounds = self._routes.get(call.route.name)
        if bounds is None or call.json is None or call.path not in OUTPUT_FIELDS:
            return await call_next(call)
        try:
            changes, action = bounded(call.json, call.path, bounds)
        except FieldRefused:
            self._counted(call.route.name, "refused")
            raise
        if not changes:
            return await call_next(call)
        self._counted(call.route.name, action)
        data = {**call.json, **changes}
        body = await dumps_yielding(data, len(call.body))
        reply = await call_next(dataclasses.replace(call, json=data, body=body))
        return reply.with_headers(((BOUND_HEADER, str(next(iter(changes.values())))),))

    def __repr__(self) -> str:
        return f"<GenerationBounds routes={sorted(self._routes)}>"


def bounded(data: dict[str, Any], path: str, bounds: Generation) -> tuple[dict[str, int], str]:
    """The fields of ``data`` (a call to ``path``) that ``bounds`` changes, with the action
    (``clamped``, ``defaulted``; none: ``{}``); ``FieldRefused`` for a call it refuses."""
    if bounds.max_choices is not None:
        for name in CHOICE_FIELDS.get(path, ()):
            asked = _integer(data, name)
            if asked is not None and asked > bounds.max_choices:
                raise FieldRefused(
                    f"'{name}' is {asked}; this route allows at most {bounds.max_choices}",
                    name,
                    "integer_above_max_value",
                )
    if not bounds.bounds_tokens:
        return {}, ""
    most = bounds.max_tokens
    fields = OUTPUT_FIELDS[path]
    changes: dict[str, int] = {}
    named = False
    for name in fields:
        asked = _integer(data, name)
        if asked is None:
            continue
        named = True
        if most is not None and asked > most:
            if bounds.over == "refuse":
                raise FieldRefused(
                    f"'{name}' is {asked}; this route allows at most {most} output tokens",
                    name,
                    "integer_above_max_value",
                )
            changes[name] = most
    if named:
        return changes, "clamped"
    default = bounds.default_max_tokens or most
    assert default is not None  # bounds_tokens
    return {fields[0]: default}, "defaulted"


def _integer(data: dict[str, Any], name: str) -> int | None:
    """``data[name]`` as the positive integer a bound must be (absent or null: None)."""
    value = data.get(name)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        kind = "a string" if isinstance(value, str) else type(value).__name__
        raise FieldRefused(
            f"Invalid type for '{name}': expected an integer, but got {kind} instead",
            name,
            "invalid_type",
        )
    if value < 1:
        raise FieldRefused(
            f"Invalid '{name}': {value}; it must be at least 1", name, "integer_below_min_value"
        )
    return value


def build(policy: Policy, metrics: Metrics) -> list[Stage]:
    """The stage, when a route bounds its generations."""
    routes = {r.name: r.generation for r in policy.routes if r.generation is not None}
    if not routes:
        return []
    counters = {  # labels() costs microseconds a call: each child is made once
        (name, action): metrics.generation_bounds.labels(name, action).inc
        for name in routes
        for action in ACTIONS
    }
    return [GenerationBounds(routes, lambda route, action: counters[(route, action)]())]
