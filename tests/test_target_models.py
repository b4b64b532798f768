"""A route's ``target_models``: the client names one model and the backend is asked for
another (an alias), or for one of several by weight (a canary split).  The official
``openai`` SDK as the client, a model server on a real socket that answers with the model
it was asked for.  The client's name routes and is checked against a tenant's models; the
cache keys on the target; ``X-Gateway-Model`` and a counter name the target."""

from __future__ import annotations

import hashlib
import random
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.openai.target_models import MODEL_HEADER, TargetModels, draw_of
from gateway.policy.model import Match, Route, TargetModel
from tests.helpers import metric, problems_of, write_policy

ACME_KEY = "acme-secret-key"
SERVED = ["llama-3.1-8b", "assistant-v1", "assistant-v2"]


class EchoModels:
    """Answers chat and embeddings with the model it was asked for; records each body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{name}", self.model)
        return app

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in SERVED:
            return web.json_response({"error": {"code": "model_not_found"}}, status=404)
        return web.json_response({"id": name, "object": "model", "created": 1, "owned_by": "me"})

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "created": 1, "owned_by": "me"} for m in SERVED]
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        message = {"role": "assistant", "content": f"from {body.get('model')}"}
        answer = {
            "id": f"c-{len(self.bodies)}",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model", "default"),
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.json_response(answer)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.bodies.append(body)
        data = [{"object": "embedding", "index": 0, "embedding": [0.5, 0.5]}]
        usage = {"prompt_tokens": 1, "total_tokens": 1}
        return web.json_response(
            {"object": "list", "data": data, "model": body["model"], "usage": usage}
        )


def policy(url: str) -> str:
    digest = hashlib.sha256(ACME_KEY.encode()).hexdigest()
    return f"""
backends: {{main: {{url: "{url}"}}}}
routes:
  - name: aliased
    match: {{path: "/v1/*", model: "gpt-4o"}}
    backend: main
    cache: {{ttl_s: 60}}
    target_models: [{{model: llama-3.1-8b}}]
  - name: canary
    match: {{path: "/v1/*", model: "assistant"}}
    backend: main
    target_models:
      - {{model: assistant-v1, weight: 3}}
      - {{model: assistant-v2, weight: 1}}
      - {{model: assistant-v0, weight: 0}}   # drained
  - {{name: rest, match: {{path: "/*"}}, backend: main}}
tenants:
  keys:
    - {{name: acme, sha256: {digest}, models: ["gpt-4o"]}}
"""


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    server = EchoModels()
    url = await serve_app(server.app())
    gw = await start_gateway(policy=write_policy(tmp_path, policy(url)))
    return server, gw


def sdk(gw: Any, key: str = "anyone") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_the_backend_is_asked_for_the_target_and_the_client_told_which(served):
    server, gw = served
    async with sdk(gw) as client:
        raw = await client.chat.completions.with_raw_response.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], temperature=0
        )
        embedded = await client.embeddings.create(model="gpt-4o", input="hi")
        untouched = await client.chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}]
        )
    answer = raw.parse()
    assert raw.headers[MODEL_HEADER] == "llama-3.1-8b"
    assert answer.model == "llama-3.1-8b"  # the backend's own answer, as it gave it
    assert embedded.model == "llama-3.1-8b"
    assert untouched.model == "other"
    assert [b["model"] for b in server.bodies] == ["llama-3.1-8b", "llama-3.1-8b", "other"]
    # the rest of the body went as the client sent it
    assert server.bodies[0]["messages"] == [{"role": "user", "content": "hi"}]
    assert server.bodies[0]["temperature"] == 0


async def test_the_cache_keys_on_the_target(served):
    server, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as client:
        ask = {"messages": [{"role": "user", "content": "cached?"}], "temperature": 0}
        first = await client.post("/v1/chat/completions", json={**ask, "model": "gpt-4o"})
        second = await client.post("/v1/chat/completions", json={**ask, "model": "gpt-4o"})
    assert (first.headers["x-gateway-cache"], second.headers["x-gateway-cache"]) == (
        "miss",
        "hit",
    )
    assert second.json()["model"] == "llama-3.1-8b"
    assert len(server.bodies) == 1


async def test_a_canary_gets_its_share_and_a_drained_target_none(served):
    server, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as client:
        for _ in range(400):
            body = {"model": "assistant", "messages": [{"role": "user", "content": "hi"}]}
            answer = await client.post("/v1/chat/completions", json=body)
            assert answer.headers[MODEL_HEADER] == answer.json()["model"]
        text = (await client.get(gw.admin_url + "/metrics")).text
    asked = [b["model"] for b in server.bodies]
    # 3:1 over 400 draws: v2's share is 0.25 with a standard deviation of 0.022
    assert 0.15 < asked.count("assistant-v2") / 400 < 0.35
    assert asked.count("assistant-v1") + asked.count("assistant-v2") == 400
    for model in ("assistant-v1", "assistant-v2"):
        counted = metric(text, "gateway_target_model_requests_total", route="canary", model=model)
        assert counted == asked.count(model)


async def test_a_tenant_is_checked_against_the_name_it_sent(served):
    server, gw = served
    async with sdk(gw, ACME_KEY) as client:
        served_answer = await client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
        )
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(
                model="llama-3.1-8b", messages=[{"role": "user", "content": "hi"}]
            )
    assert served_answer.model == "llama-3.1-8b"
    assert len(server.bodies) == 1


def test_draws_follow_the_weights_and_skip_a_zero_weight():
    route = Route(
        backend="b",
        match=Match(path="/v1/*"),
        name="r",
        target_models=(
            TargetModel("a", 1),
            TargetModel("off", 0),
            TargetModel("b", 3),
        ),
    )
    draw = draw_of(route)
    points = iter([0.0, 0.2499, 0.25, 0.9999])
    stage = TargetModels({"r": draw}, lambda route, model: None, uniform=lambda: next(points))
    assert [stage._pick(draw) for _ in range(4)] == ["a", "a", "b", "b"]
    seeded = random.Random(26)
    stage = TargetModels({"r": draw}, lambda route, model: None, uniform=seeded.random)
    assert "off" not in {stage._pick(draw) for _ in range(1000)}
    assert repr(stage) == "<TargetModels routes=['r']>"


@pytest.mark.parametrize(
    ("targets", "match", "problem"),
    [
        ('[{model: ""}]', '{path: "/v1/*"}', "target_models[0].model: must name a model"),
        ("[{model: a, weight: -1}]", '{path: "/v1/*"}', "target_models[0].weight: must be"),
        ("[{model: a, weight: .nan}]", '{path: "/v1/*"}', "target_models[0].weight: must be"),
        ("[{model: a, weight: 0}]", '{path: "/v1/*"}', "at least one weight must be above 0"),
        ("[{model: a}]", '{path: "/v2/*"}', "target_models: only applies to a route"),
    ],
)
def test_gateway_check_refuses_targets_that_cannot_work(targets, match, problem):
    text = f"""
backends: {{main: {{url: "http://127.0.0.1:1"}}}}
routes:
  - {{match: {match}, backend: main, target_models: {targets}}}
"""
    problems = problems_of(text)
    assert any(problem in p for p in problems), problems


async def test_the_names_a_policy_answers_for_are_listed_and_retrieved(served):
    _, gw = served
    async with sdk(gw) as client:
        listed = [(m.id, m.owned_by) async for m in client.models.list()]
        alias = await client.models.retrieve("assistant")
        served_model = await client.models.retrieve("llama-3.1-8b")
    async with sdk(gw, ACME_KEY) as client:
        mine = [m.id async for m in client.models.list()]
    assert listed == [
        *((m, "me") for m in SERVED),
        ("gpt-4o", "sidecar-gateway"),  # the routes' names, after the backend's models
        ("assistant", "sidecar-gateway"),
    ]
    assert (alias.id, alias.owned_by) == ("assistant", "sidecar-gateway")
    assert served_model.id == "llama-3.1-8b"  # the backend's own answer
    assert mine == ["gpt-4o"]  # the tenant's cut applies to the names as to the models
