"""A named tenant held to some models (``tenants.keys[].models``) names only those: the
official ``openai`` SDK as the client, a model server on a real socket that answers for
any model it is asked, and the gateway between them.  The tenant's other models are
OpenAI's 404 ``model_not_found``, its model list holds only its own, the model in a
KServe V2 or TF Serving path counts as named, and a path that names no model the gateway
can read is a 403 for it; a tenant without ``models`` is served as before."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.errors import UpstreamError
from gateway.openai.allowed_models import AllowedModels, ModelNotAllowed, PathNotAllowed
from gateway.pipeline import Reply
from tests.helpers import problems_of, write_policy

MODELS = ["gpt-4o-mini", "gpt-4o", "llama-3.1-8b", "ft:gpt-4o-mini:acme:1", "secret-model"]
KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key"}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class AnyModelServer:
    """Serves every model it is asked for, as a server with several models does; its list
    is gzipped for a client that accepts it.  ``listing`` replaces the list's body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str]] = []  # (method, path, model)
        self.listing: bytes | None = None
        self.listing_encodings: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/", self.models)  # as Express and Fiber serve it
        app.router.add_get("/v1/models/{name}", self.model)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/embeddings", self.chat)
        app.router.add_post("/v2/models/{name}/infer", self.infer)
        app.router.add_post("/v1/models/{tail:.+}", self.infer)
        app.router.add_post("/api/chat", self.chat)
        app.router.add_post("/api/show", self.chat)
        app.router.add_get("/api/tags", self.tags)
        return app

    async def tags(self, request: web.Request) -> web.Response:
        """Ollama's list: its models by ``name``, gzipped for a client that accepts it."""
        self.listing_encodings.append(request.headers.get("Accept-Encoding", ""))
        names = ["llama-3.1-8b:latest", "secret-model:latest", "ft:x", "gpt-4o-mini:q4"]
        models = [{"name": n, "model": n, "size": 1} for n in names]
        response = web.json_response({"models": models})
        response.enable_compression()
        return response

    async def models(self, request: web.Request) -> web.Response:
        self.listing_encodings.append(request.headers.get("Accept-Encoding", ""))
        if self.listing is not None:
            return web.Response(body=self.listing, content_type="application/json")
        data = [{"id": m, "object": "model", "created": 1, "owned_by": "o"} for m in MODELS]
        response = web.json_response({"object": "list", "data": data}, headers={"ETag": '"1"'})
        response.enable_compression()
        return response

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.seen.append(("GET", request.path, name))
        return web.json_response({"id": name, "object": "model", "created": 1, "owned_by": "o"})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(("POST", request.path, body.get("model", "")))
        answer = {
            "id": "c-1",
            "object": "chat.completion",
            "created": 1,
            "model": body.get("model", "default"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "ok"},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        return web.json_response(answer)

    async def infer(self, request: web.Request) -> web.Response:
        self.seen.append(("POST", request.path, request.match_info.get("name", "")))
        return web.json_response({"outputs": []})


def policy(url: str, *, required: bool = False) -> str:
    return f"""
backends: {{main: {{url: "{url}"}}}}
routes:
  - {{match: {{path: "/*"}}, backend: main}}
tenants:
  required: {str(required).lower()}
  keys:
    - {{name: acme, sha256: {digest(KEYS["acme"])}, models: ["gpt-4o-mini", "llama-*", "ft:*"]}}
    - {{name: globex, sha256: {digest(KEYS["globex"])}}}
"""


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    server = AnyModelServer()
    url = await serve_app(server.app())
    gw = await start_gateway(policy=write_policy(tmp_path, policy(url)))
    return server, gw


def sdk(gw: Any, tenant: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEYS[tenant], max_retries=0)


def ask(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_tenant_held_to_some_models_is_told_the_others_do_not_exist(served):
    server, gw = served
    acme, globex = sdk(gw, "acme"), sdk(gw, "globex")
    allowed = await acme.chat.completions.create(**ask("gpt-4o-mini"))
    matched = await acme.chat.completions.create(**ask("llama-3.1-8b"))
    with pytest.raises(openai.NotFoundError) as refused:
        await acme.chat.completions.create(**ask("secret-model"))
    with pytest.raises(openai.NotFoundError):
        await acme.embeddings.create(model="gpt-4o", input="hi")  # a prefix is not a match
    other = await globex.chat.completions.create(**ask("secret-model"))
    assert (allowed.model, matched.model, other.model) == (
        "gpt-4o-mini",
        "llama-3.1-8b",
        "secret-model",
    )
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "model_not_found"
    assert error["message"] == (
        "The model `secret-model` does not exist or you do not have access to it."
    )
    assert [model for _, _, model in server.seen] == [
        "gpt-4o-mini",
        "llama-3.1-8b",
        "secret-model",
    ]  # globex's; acme's refusals never left the gateway


async def test_a_body_naming_no_model_is_refused_for_such_a_tenant(served):
    server, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as client:
        bare = {"messages": [{"role": "user", "content": "hi"}]}
        acme = await client.post(
            "/v1/chat/completions", json=bare, headers={"X-Api-Key": KEYS["acme"]}
        )
        globex = await client.post(
            "/v1/chat/completions", json=bare, headers={"X-Api-Key": KEYS["globex"]}
        )
    assert acme.status_code == 400
    assert acme.json()["error"]["code"] == "model_required"
    assert globex.status_code == 200  # the backend's default model, as before
    assert len(server.seen) == 1


async def test_its_model_list_holds_only_its_models(served):
    server, gw = served
    mine = [m.id async for m in sdk(gw, "acme").models.list()]
    everyone = [m.id async for m in sdk(gw, "globex").models.list()]
    assert mine == ["gpt-4o-mini", "llama-3.1-8b", "ft:gpt-4o-mini:acme:1"]
    assert everyone == MODELS
    # The cut list was asked for uncompressed; globex's went as the client asked.
    assert server.listing_encodings[0] == "identity"
    assert "gzip" in server.listing_encodings[1]
    async with httpx.AsyncClient(base_url=gw.url) as client:
        cut = await client.get("/v1/models", headers={"Authorization": f"Bearer {KEYS['acme']}"})
        posted = await client.post("/v1/models", headers={"X-Api-Key": KEYS["acme"]})
        slashed = await client.get("/v1/models/", headers={"X-Api-Key": KEYS["acme"]})
    assert cut.status_code == 200
    assert slashed.json() == cut.json()  # trimmed at the edge: the same list, cut
    assert "etag" not in cut.headers  # the backend's tag named the whole list
    assert int(cut.headers["content-length"]) == len(cut.content)
    assert posted.status_code == 403


async def test_the_model_in_a_kserve_or_tf_serving_path_is_the_one_named(served):
    server, gw = served
    acme = {"X-Api-Key": KEYS["acme"]}
    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def post(path: str) -> int:
            return (await client.post(path, json={"inputs": []}, headers=acme)).status_code

        statuses = {
            path: await post(path)
            for path in (
                "/v2/models/llama-3.1-8b/infer",
                "/v2/models/secret-model/infer",
                "/v2/models/%73ecret-model/infer",  # an unreserved byte, encoded
                "/v2/models/llama-x/../secret-model/infer",  # a dot segment, resolved
                "/v1/models/llama-3.1-8b:predict",
                "/v1/models/llama-3.1-8b/versions/2:predict",
                "/v1/models/secret-model:predict",
                "/v1/models/secret-model/versions/2:predict",
            )
        }
        retrieved = await sdk(gw, "acme").models.retrieve("ft:gpt-4o-mini:acme:1")
        with pytest.raises(openai.NotFoundError):
            await sdk(gw, "acme").models.retrieve("secret-model")
    assert statuses == {
        "/v2/models/llama-3.1-8b/infer": 200,
        "/v2/models/secret-model/infer": 404,
        "/v2/models/%73ecret-model/infer": 404,
        "/v2/models/llama-x/../secret-model/infer": 404,
        "/v1/models/llama-3.1-8b:predict": 200,
        "/v1/models/llama-3.1-8b/versions/2:predict": 200,
        "/v1/models/secret-model:predict": 404,
        "/v1/models/secret-model/versions/2:predict": 404,
    }
    assert retrieved.id == "ft:gpt-4o-mini:acme:1"
    assert all("secret" not in path for _, path, _ in server.seen)


async def test_a_path_that_names_no_model_is_refused_for_such_a_tenant_only(served):
    server, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as client:
        tgi = {"inputs": "hi", "parameters": {"max_new_tokens": 5}}
        acme = await client.post("/generate", json=tgi, headers={"X-Api-Key": KEYS["acme"]})
        globex = await client.post("/generate", json=tgi, headers={"X-Api-Key": KEYS["globex"]})
        anonymous = await client.post("/generate", json=tgi)
    assert acme.status_code == 403
    assert acme.json()["error"]["code"] == "model_access_denied"
    assert (globex.status_code, anonymous.status_code) == (404, 404)  # passed: none serves it
    assert server.seen == []


async def test_ollamas_own_api_names_its_model_in_the_body(served):
    """A held tenant uses Ollama's ``/api/chat`` for its models (a name without a tag is
    its ``:latest``) and is told the others do not exist; its ``/api/tags`` holds only its
    own."""
    server, gw = served
    acme = {"X-Api-Key": KEYS["acme"]}

    def chat(model: str, **more: Any) -> dict[str, Any]:
        return {"model": model, "messages": [{"role": "user", "content": "hi"}], **more}

    async with httpx.AsyncClient(base_url=gw.url, headers=acme) as client:
        for model in ("llama-3.1-8b", "llama-3.1-8b:latest", "gpt-4o-mini:latest"):
            assert (await client.post("/api/chat", json=chat(model))).status_code == 200, model
        for model in ("secret-model", "gpt-4o-mini:q4", "GPT-4O-MINI"):
            refused = await client.post("/api/chat", json=chat(model))
            assert refused.status_code == 404, model
            assert refused.json()["error"]["code"] == "model_not_found"
        shown = await client.post("/api/show", json={"name": "llama-3.1-8b"})  # older spelling
        assert shown.status_code == 200
        tags = await client.get("/api/tags", headers={"Accept-Encoding": "gzip"})
        assert (await client.get("/api/version")).status_code == 404  # passed: none serves it
        assert (await client.post("/api/version")).status_code == 403
    assert [m["name"] for m in tags.json()["models"]] == ["llama-3.1-8b:latest", "ft:x"]
    cut = AllowedModels(["a*"]).cut_listing
    with pytest.raises(UpstreamError):  # a list that cannot be read is never passed whole
        cut("GET", "/api/tags", Reply(200, (), body=b'{"models": "secret"}'))
    assert server.listing_encodings[-1] == "identity"  # asked uncompressed, to be cut
    assert all("secret" not in model for _, _, model in server.seen)


@pytest.mark.parametrize(
    ("body", "status"),
    [
        (b'{"model": "llama-3.1-8b", "MODEL": "secret-model"}', 400),  # Go reads the last
        (b'{"Model": "secret-model"}', 404),  # Go reads it as model
        (b'{"messages": []}', 400),  # none named
        (b'{"model": 5}', 400),
        (b"[1]", 400),
        (b"{not json", 400),
    ],
)
async def test_an_ollama_body_is_read_as_ollama_reads_it(served, body, status):
    """Ollama's Go server matches a key case-insensitively, the last one winning: a body
    naming its model under two spellings would be read one way here and another there."""
    server, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as client:
        answer = await client.post(
            "/api/chat",
            content=body,
            headers={"X-Api-Key": KEYS["acme"], "Content-Type": "application/json"},
        )
        gzipped = await client.post(
            "/api/chat",
            content=b"\x1f\x8b",
            headers={"X-Api-Key": KEYS["acme"], "Content-Encoding": "gzip"},
        )
    assert answer.status_code == status, answer.text
    assert gzipped.status_code == 415
    assert server.seen == []


@pytest.mark.parametrize(
    "listing",
    [
        b"not json",
        b'{"object": "list"}',
        b'[{"id": "secret-model"}]',
        b'{"data": "x"}',
        b"[" * 100_000,  # deeper than the JSON parser goes
    ],
)
async def test_a_model_list_that_cannot_be_read_is_never_passed_whole(served, listing):
    server, gw = served
    server.listing = listing
    async with httpx.AsyncClient(base_url=gw.url) as client:
        acme = await client.get("/v1/models", headers={"X-Api-Key": KEYS["acme"]})
        globex = await client.get("/v1/models", headers={"X-Api-Key": KEYS["globex"]})
    assert acme.status_code == 502
    assert acme.json()["error"]["code"] == "unreadable_model_list"
    assert b"secret" not in acme.content
    assert globex.content == listing  # passed as it came: nothing to cut


def test_entries_without_a_string_id_are_left_out_of_a_cut_list():
    from gateway.pipeline import Reply

    cut = AllowedModels(["a*"]).cut_listing(
        "GET",
        "/v1/models",
        Reply(200, (), body=b'{"data": [{"id": "ab"}, {"id": 1}, "a", {"id": "b"}, {}]}'),
    )
    assert cut.body == b'{"data": [{"id": "ab"}]}'


def test_the_checks_read_the_model_as_the_backend_does():
    allowed = AllowedModels(["gpt-4o-mini", "ft:*"])
    allowed.check("GET", "/v1/models/ft:gpt-4o-mini:acme:1", None)  # ids may hold `:`
    allowed.check("POST", "/v1/models/gpt-4o-mini:predict", None)
    allowed.check("POST", "/v2/models/gpt-4o-mini/versions/3/infer", None)
    with pytest.raises(ModelNotAllowed):
        allowed.check("POST", "/v1/models/gpt-4o:predict", None)
    with pytest.raises(ModelNotAllowed):
        allowed.check("POST", "/v1/chat/completions", {"model": "GPT-4O-MINI"})  # case counts
    with pytest.raises(PathNotAllowed):
        allowed.check("POST", "/v2/repository/index", None)
    with pytest.raises(PathNotAllowed):
        allowed.check("GET", "/v1/chat/completions", None)


@pytest.mark.parametrize(
    "path",
    [
        "/v1/files",
        "/v1/files/file-1~e~t/content",
        "/v1/uploads/upload_1~e~t/complete",
        "/v1/vector_stores/vs_1~e~t/search",
        "/v1/containers",
        "/v1/containers/cntr_1~e~t/files/cfile_1/content",
        "/v1/conversations/conv_1~e~t/items",
    ],
)
def test_objects_bound_to_their_tenant_run_no_model_and_pass_once_bound(path):
    """With ids bound (``response_id_secret``), a held tenant keeps its own files, uploads,
    vector stores, containers and conversations (each id checked by its stage); without,
    such a path is refused like any path naming no model."""
    AllowedModels(["m"], own_responses=True).check("POST", path, None)
    with pytest.raises(PathNotAllowed):
        AllowedModels(["m"]).check("POST", path, None)


@pytest.mark.parametrize("path", ["/v1/batches", "/v1/batches/batch_1~e~t", "/v1/fine_tuning/jobs"])
def test_a_batch_or_a_fine_tune_runs_models_the_gateway_cannot_read_and_stays_refused(path):
    with pytest.raises(PathNotAllowed):
        AllowedModels(["m"], own_responses=True).check("POST", path, None)


def test_a_tenants_models_are_given_once_and_are_not_empty():
    key = digest("k")
    found = problems_of(
        f"""
backends: {{m: {{url: "http://127.0.0.1:9"}}}}
routes: [{{backend: m}}]
tenants:
  keys:
    - {{name: acme, sha256: {key}, models: ["gpt-*"]}}
    - {{name: acme, sha256: {digest("k2")}, models: ["llama-*"]}}
    - {{name: b, sha256: {digest("k3")}, models: []}}
    - {{name: c, sha256: {digest("k4")}, models: ["ok", " "]}}
"""
    )
    assert found == [
        "p.yaml:7: tenants.keys[1].models: differs from another of 'acme''s keys",
        "p.yaml:8: tenants.keys[2].models: is empty: leave it out for every model",
        "p.yaml:9: tenants.keys[3].models[1]: must not be empty",
    ]
