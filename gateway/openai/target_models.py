"""The model a backend is asked for (a route's ``target_models``).

Clients name a model once, in their configuration (Spring AI's ``spring.ai.openai.chat.
options.model``); the operator decides which model serves it, and may move it without
touching a client: ``gpt-4o`` served by ``llama-3.1-8b``, or 10% of a route's requests sent
to a new fine-tune (the Kubernetes inference extension's weighted ``targetModels``).

On a route with ``target_models``, each OpenAI JSON body gets one of them as its
``model`` (set where the client sent none), drawn by weight, and the body is written again.
The client's own name has already done its work: the route was chosen on it, and a named
tenant's ``models`` were checked against it, at the edge.  Everything after this stage (the
cache, single flight, batching, the backend and its fallback) sees the target, so a cached
answer of one target never answers for another.  ``X-Gateway-Model`` names the target on
the answer, and ``gateway_target_model_requests_total{route, model}`` counts each, so a
canary's share and errors can be watched apart.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable

from gateway.metrics import Metrics
from gateway.openai.body import dumps_yielding
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy, Route

MODEL_HEADER = "X-Gateway-Model"


@dataclasses.dataclass(frozen=True, slots=True)
class _Draw:
    """One route's targets and their cumulative weights."""

    models: tuple[str, ...]
    cumulative: tuple[float, ...]


class TargetModels:
    """The stage; see the module docstring.  ``uniform`` draws in [0, 1) (a seeded
    ``random.Random().random`` in tests)."""

    def __init__(
        self,
        draws: dict[str, _Draw],
        counted: Callable[[str, str], None],
        uniform: Callable[[], float] = random.random,
    ) -> None:
        self._draws = draws
        self._counted = counted
        self._uniform = uniform

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        draw = self._draws.get(call.route.name)
        if draw is None or call.json is None:
            return await call_next(call)
        model = self._pick(draw)
        self._counted(call.route.name, model)
        data = {**call.json, "model": model}
        body = await dumps_yielding(data, len(call.body))
        reply = await call_next(dataclasses.replace(call, json=data, body=body))
        return reply.with_headers(((MODEL_HEADER, model),))

    def _pick(self, draw: _Draw) -> str:
        if len(draw.models) == 1:
            return draw.models[0]
        point = self._uniform() * draw.cumulative[-1]
        for model, bound in zip(draw.models, draw.cumulative, strict=True):
            if point < bound:
                return model
        return draw.models[-1]

    def __repr__(self) -> str:
        return f"<TargetModels routes={sorted(self._draws)}>"


def draw_of(route: Route) -> _Draw:
    targets = [t for t in route.target_models if t.weight > 0]
    weights = itertools.accumulate(t.weight for t in targets)
    return _Draw(tuple(t.model for t in targets), tuple(weights))


def build(
    policy: Policy, metrics: Metrics, uniform: Callable[[], float] = random.random
) -> list[Stage]:
    """The stage, when a route names target models."""
    draws = {route.name: draw_of(route) for route in policy.routes if route.target_models}
    if not draws:
        return []
    counters = {  # labels() costs microseconds a call: each child is made once
        (name, model): metrics.target_model_requests.labels(name, model).inc
        for name, draw in draws.items()
        for model in draw.models
    }
    return [TargetModels(draws, lambda route, model: counters[(route, model)](), uniform)]
