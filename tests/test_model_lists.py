"""A route's ``merge_models``: with routes split by model over several model servers, the
official ``openai`` SDK lists every model any of them serves and retrieves each from the
server that has it.  Model servers on real sockets; one that fails is left out of the list
and named, an outage is never reported as "no such model", and a tenant's cut applies to
the merged list."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.openai.model_lists import MISSING_HEADER
from gateway.testing.llama import MODEL_ALIAS
from tests.helpers import metric, problems_of, write_policy

ACME_KEY = "acme-secret-key"


class ModelServer:
    """An OpenAI model server listing ``models`` (gzipped for a client that accepts it);
    ``failing`` makes both endpoints answer that status, ``listing`` replaces the list."""

    def __init__(self, owner: str, models: list[str]) -> None:
        self.owner = owner
        self.models = models
        self.failing: int | None = None
        self.listing: bytes | None = None
        self.asked: list[tuple[str, str]] = []  # (path, Accept-Encoding)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/v1/models/{name:.+}", self.retrieve)
        return app

    def entry(self, model: str) -> dict[str, Any]:
        return {"id": model, "object": "model", "created": 1, "owned_by": self.owner}

    async def list_models(self, request: web.Request) -> web.Response:
        self.asked.append((request.path, request.headers.get("Accept-Encoding", "")))
        if self.failing is not None:
            return web.json_response({"error": {"message": "down"}}, status=self.failing)
        if self.listing is not None:
            return web.Response(body=self.listing, content_type="application/json")
        data = [self.entry(m) for m in self.models]
        # llama.cpp's server adds an Ollama-shaped "models" beside OpenAI's "data"
        response = web.json_response({"object": "list", "data": data, "models": data})
        response.enable_compression()
        return response

    async def retrieve(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.asked.append((request.path, ""))
        if self.failing is not None:
            return web.json_response({"error": {"message": "down"}}, status=self.failing)
        if name not in self.models:
            error = {"message": f"The model `{name}` does not exist", "code": "model_not_found"}
            return web.json_response({"error": error}, status=404)
        return web.json_response(self.entry(name))


def merging_policy(urls: dict[str, str], merge: str = "[embedder]", extra: str = "") -> str:
    backends = "\n".join(f'  {name}: {{url: "{url}"}}' for name, url in urls.items())
    digest = hashlib.sha256(ACME_KEY.encode()).hexdigest()
    return f"""
backends:
{backends}
routes:
  - name: models
    match: {{path: "/v1/models*"}}
    backend: chat
    merge_models: {merge}
    {extra}
tenants:
  keys:
    - {{name: acme, sha256: {digest}, models: ["llama-*", "bge-*"]}}
"""


@pytest.fixture
async def servers(serve_app, start_gateway, tmp_path):
    chat = ModelServer("chat", ["llama-3.1-8b", "shared-model"])
    embedder = ModelServer("embedder", ["bge-small", "shared-model"])
    urls = {"chat": await serve_app(chat.app()), "embedder": await serve_app(embedder.app())}
    gw = await start_gateway(policy=write_policy(tmp_path, merging_policy(urls)))
    return chat, embedder, gw


def sdk(gw: Any, key: str = "anyone") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_the_list_holds_every_backends_models_once_the_first_entry_kept(servers):
    chat, embedder, gw = servers
    listed = [(m.id, m.owned_by) async for m in sdk(gw).models.list()]
    assert listed == [
        ("llama-3.1-8b", "chat"),
        ("shared-model", "chat"),  # the route's own backend lists it first
        ("bge-small", "embedder"),
    ]
    async with httpx.AsyncClient(base_url=gw.url) as client:
        raw = await client.get("/v1/models")
    assert raw.headers["x-gateway-backend"] == "chat,embedder"
    assert MISSING_HEADER.lower() not in raw.headers
    assert set(raw.json()) == {"object", "data"}
    # each was asked uncompressed, so that its list could be read
    assert chat.asked[0] == embedder.asked[0] == ("/v1/models", "identity")


async def test_a_model_is_retrieved_from_the_backend_that_serves_it(servers):
    chat, embedder, gw = servers
    client = sdk(gw)
    bge = await client.models.retrieve("bge-small")
    llama = await client.models.retrieve("llama-3.1-8b")
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-4o")
    assert (bge.owned_by, llama.owned_by) == ("embedder", "chat")
    assert isinstance(missing.value.body, dict)
    assert missing.value.body["code"] == "model_not_found"
    assert [path for path, _ in embedder.asked] == ["/v1/models/bge-small", "/v1/models/gpt-4o"]
    assert len(chat.asked) == 3  # asked first every time


@pytest.mark.parametrize(
    "failure", ["status", "not a list", "refused"], ids=["503", "unreadable", "refused"]
)
async def test_a_backend_that_fails_is_left_out_and_named(
    serve_app, start_gateway, tmp_path, failure
):
    chat = ModelServer("chat", ["llama-3.1-8b"])
    embedder = ModelServer("embedder", ["bge-small"])
    urls = {"chat": await serve_app(chat.app()), "embedder": await serve_app(embedder.app())}
    if failure == "status":
        embedder.failing = 503
    elif failure == "not a list":
        embedder.listing = b'{"object": "list", "data": {"bge-small": {}}}'
    else:
        urls["embedder"] = "http://127.0.0.1:9"  # discard: nothing listens
    gw = await start_gateway(policy=write_policy(tmp_path, merging_policy(urls)), warmup=False)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        listed = await client.get("/v1/models")
        again = await client.get("/v1/models")
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == ["llama-3.1-8b"]
    assert listed.headers[MISSING_HEADER] == "embedder"
    assert again.headers[MISSING_HEADER] == "embedder"
    assert metric(text, "gateway_model_list_missing_total", route="models", backend="embedder") == 2


async def test_when_every_backend_fails_the_routes_own_failure_answers(
    serve_app, start_gateway, tmp_path
):
    chat = ModelServer("chat", ["llama-3.1-8b"])
    embedder = ModelServer("embedder", ["bge-small"])
    chat.failing, embedder.failing = 503, 500
    urls = {"chat": await serve_app(chat.app()), "embedder": await serve_app(embedder.app())}
    gw = await start_gateway(policy=write_policy(tmp_path, merging_policy(urls)))
    async with httpx.AsyncClient(base_url=gw.url) as client:
        listed = await client.get("/v1/models")
        retrieved = await client.get("/v1/models/bge-small")
    assert listed.status_code == 503
    assert listed.json() == {"error": {"message": "down"}}
    assert retrieved.status_code == 503


async def test_an_outage_is_not_reported_as_no_such_model(serve_app, start_gateway, tmp_path):
    """The route's backend refuses connections and the other does not know the model: the
    client learns of the outage (it may hold the model), not a 404."""
    embedder = ModelServer("embedder", ["bge-small"])
    urls = {"chat": "http://127.0.0.1:9", "embedder": await serve_app(embedder.app())}
    gw = await start_gateway(policy=write_policy(tmp_path, merging_policy(urls)), warmup=False)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        unknown = await client.get("/v1/models/llama-3.1-8b")
        known = await client.get("/v1/models/bge-small")
    assert unknown.status_code == 502
    assert unknown.json()["error"]["type"] != "invalid_request_error"
    assert known.status_code == 200


async def test_a_tenant_sees_only_its_models_of_the_merged_list(servers):
    _, _, gw = servers
    mine = [m.id async for m in sdk(gw, ACME_KEY).models.list()]
    assert mine == ["llama-3.1-8b", "bge-small"]
    with pytest.raises(openai.NotFoundError):
        await sdk(gw, ACME_KEY).models.retrieve("shared-model")


async def test_the_named_backends_are_asked_without_the_routes_fallback(
    serve_app, start_gateway, tmp_path
):
    chat = ModelServer("chat", ["llama-3.1-8b"])
    spare = ModelServer("spare", ["llama-3.1-8b", "spare-only"])
    urls = {
        "chat": await serve_app(chat.app()),
        "embedder": "http://127.0.0.1:9",
        "spare": await serve_app(spare.app()),
    }
    text = merging_policy(urls, extra="fallback: [spare]")
    gw = await start_gateway(policy=write_policy(tmp_path, text), warmup=False)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        listed = await client.get("/v1/models")
    assert [m["id"] for m in listed.json()["data"]] == ["llama-3.1-8b"]
    assert listed.headers[MISSING_HEADER] == "embedder"
    assert spare.asked == []


async def test_other_methods_and_paths_pass_through(servers):
    chat, embedder, gw = servers
    async with httpx.AsyncClient(base_url=gw.url) as client:
        posted = await client.post("/v1/models", json={})
        other = await client.get("/v1/modelsx")
    assert posted.status_code == 405  # aiohttp's answer for a POST it has no route for
    assert other.status_code == 404
    assert embedder.asked == []
    assert chat.asked == []  # neither path reached a list handler


@pytest.mark.parametrize(
    ("merge", "match", "problem"),
    [
        ("[nowhere]", '{path: "/v1/models"}', "merge_models[0]: unknown backend 'nowhere'"),
        ("[chat]", '{path: "/v1/models"}', "merge_models[0]: 'chat' is already asked"),
        ("[embedder, embedder]", '{path: "/v1/*"}', "merge_models[1]: 'embedder' is already"),
        ("[embedder]", '{path: "/v2/*"}', "merge_models: only applies to a route"),
        ("[embedder]", '{path: "/v1/*", model: "llama*"}', "merge_models: only applies"),
    ],
)
def test_gateway_check_refuses_a_merge_that_cannot_work(merge, match, problem):
    text = f"""
backends: {{chat: {{url: "http://127.0.0.1:1"}}, embedder: {{url: "http://127.0.0.1:2"}}}}
routes:
  - {{match: {match}, backend: chat, merge_models: {merge}}}
"""
    problems = problems_of(text)
    assert any(problem in p for p in problems), problems


@pytest.mark.llm
async def test_llama_cpps_real_list_merges_with_another_servers(
    llama, serve_app, start_gateway, tmp_path
):
    """llama.cpp's server lists its model in OpenAI's ``data`` (and Ollama's ``models``
    beside it); merged with an embedder's, the SDK sees both, and a model only the
    embedder serves is retrieved from it."""
    embedder = ModelServer("embedder", ["bge-small"])
    urls = {"chat": llama.url, "embedder": await serve_app(embedder.app())}
    gw = await start_gateway(policy=write_policy(tmp_path, merging_policy(urls)))
    client = sdk(gw)
    listed = [m.id async for m in client.models.list()]
    async with openai.AsyncOpenAI(base_url=llama.url + "/v1", api_key="none") as direct:
        own = [m.id async for m in direct.models.list()]
    bge = await client.models.retrieve("bge-small")
    assert listed == [*own, "bge-small"]
    assert MODEL_ALIAS in listed
    assert bge.owned_by == "embedder"
