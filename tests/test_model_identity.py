"""``model_version: auto``: a backend's cached answers keyed by what its servers say they
serve (``transport.identity``).  Over real sockets: the sim's weights changed under the
same model name take a new key at once and the old answers are never served again; a
server that says nothing is not cached; a failed probe keeps the version; a rollout's
mixed replicas key apart; each server's document is read for its weights only (never the
fields that change on every call); garbage states nothing."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.errors import PolicyError
from gateway.metrics import Metrics
from gateway.policy.load import parse_policy_text
from gateway.sim import SimConfig, start_sim
from gateway.testing import FakeResolver, json_reply
from gateway.transport.backends import Upstreams
from gateway.transport.identity import UNKNOWN, identity_of, statement_of, version_of
from tests.helpers import chat, metric, until
from tests.test_discovery import free_port_on_all

POLICY = """
backends:
  main:
    {where}
    model_version: auto
    model_version_interval_s: 0.05
routes:
  - name: chat
    match: {{path: "/v1/*"}}
    backend: main
    cache: {{ttl_s: 60}}
"""
GREEDY = {"temperature": 0, "max_tokens": 8}


def version(gw: Any) -> str:
    return str(gw.gateway.transport.model_identity("main"))


async def ask(gw: Any, text: str = "Which jacket keeps the rain out?") -> httpx.Response:
    async with httpx.AsyncClient(base_url=gw.url) as client:
        return await client.post("/v1/chat/completions", json=chat(text, **GREEDY))


@pytest.fixture
async def sims() -> AsyncIterator[list[Any]]:
    started: list[Any] = []
    yield started
    for sim in started:
        await sim.close()


async def gateway_on(start_gateway: Any, tmp_path: Path, *urls: str) -> Any:
    where = f'url: "{urls[0]}"' if len(urls) == 1 else f"endpoints: {json.dumps(list(urls))}"
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY.format(where=where))
    return await start_gateway(policy=policy, warmup=False)


async def _hi(_: web.Request) -> web.Response:
    return web.json_response({"choices": [{"message": {"content": "hi"}}]})


async def model_server(serve_app: Any, models: Any, completions: Any = _hi) -> str:
    """A server of chat answers whose ``GET /v1/models`` is ``models`` (no ``/info`` nor
    ``/api/tags``: 404); its base URL."""
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", completions)
    return str(await serve_app(app))


async def test_new_weights_under_the_same_name_take_a_new_key_and_never_meet_the_old_answers(
    start_gateway: Any, tmp_path: Path, sims: list[Any]
) -> None:
    sim = await start_sim(SimConfig(port=0, base_ms=1.0, token_ms=0.0, weights="v1"))
    sims.append(sim)
    gw = await gateway_on(start_gateway, tmp_path, sim.url)
    await until(lambda: version(gw) != UNKNOWN)
    first = version(gw)
    old = await ask(gw)
    again = await ask(gw)
    assert old.headers["x-gateway-cache"] == "miss" and again.headers["x-gateway-cache"] == "hit"
    assert again.json()["choices"] == old.json()["choices"]
    assert sim.engine.counters.requests == 1

    sim.engine.reconfigure({"weights": "v2"})  # `ollama pull`: the same name, new weights
    await until(lambda: version(gw) not in (first, UNKNOWN))
    new = await ask(gw)
    assert new.headers["x-gateway-cache"] == "miss" and sim.engine.counters.requests == 2
    assert new.json()["choices"] != old.json()["choices"]  # the new weights' own answer
    cached = await ask(gw)
    assert (
        cached.headers["x-gateway-cache"] == "hit"
        and cached.json()["choices"] == new.json()["choices"]
    )

    # what the dashboards and a purge read: the version in force, the old one gone
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{gw.admin_url}/metrics")).text
    shown = "gateway_backend_model_identity"
    assert metric(text, shown, backend="main", identity=version(gw)) == 1
    assert metric(text, shown, backend="main", identity=first) is None
    async with httpx.AsyncClient() as client:
        policy = (await client.get(f"{gw.admin_url}/policy")).json()
    assert policy["model_versions"] == {"main": version(gw)}
    async with httpx.AsyncClient() as client:
        purged = await client.post(
            f"{gw.admin_url}/cache/purge", json={"model_version": version(gw)}
        )
    assert purged.status_code == 200, purged.text
    assert (await ask(gw)).headers["x-gateway-cache"] == "miss"


async def test_the_same_weights_give_the_same_version_in_every_replica(
    start_gateway: Any, tmp_path: Path, sims: list[Any]
) -> None:
    """Replicas of the gateway sharing a Redis cache share its entries: the version is the
    servers' statement, nothing of the gateway's own."""
    sim = await start_sim(SimConfig(port=0, base_ms=1.0, weights="v1"))
    sims.append(sim)
    one = await gateway_on(start_gateway, tmp_path, sim.url)
    (tmp_path / "other").mkdir()
    other = await gateway_on(start_gateway, tmp_path / "other", sim.url)
    await until(lambda: UNKNOWN not in (version(one), version(other)))
    assert version(one) == version(other)


async def test_a_rollout_keys_apart_until_every_replica_serves_the_new_weights(
    start_gateway: Any, tmp_path: Path, sims: list[Any]
) -> None:
    a = await start_sim(SimConfig(port=0, base_ms=1.0, weights="v1"))
    b = await start_sim(SimConfig(port=0, base_ms=1.0, weights="v1"))
    sims.extend([a, b])
    gw = await gateway_on(start_gateway, tmp_path, a.url, b.url)
    await until(lambda: version(gw) != UNKNOWN)
    old = version(gw)
    a.engine.reconfigure({"weights": "v2"})
    await until(lambda: version(gw) not in (old, UNKNOWN))
    mixed = version(gw)
    b.engine.reconfigure({"weights": "v2"})
    await until(lambda: version(gw) not in (old, mixed, UNKNOWN))
    assert len({old, mixed, version(gw)}) == 3


async def test_a_server_that_says_nothing_is_not_cached_and_the_log_says_why(
    start_gateway: Any, tmp_path: Path, serve_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    async def completions(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        return web.json_response({"choices": [{"message": {"content": "hi"}}]})

    async def models(_: web.Request) -> web.Response:
        return web.Response(text="<html>not json</html>")

    url = await model_server(serve_app, models, completions)  # /v1/models says nothing
    with caplog.at_level(logging.WARNING, logger="gateway.transport"):
        gw = await gateway_on(start_gateway, tmp_path, url)
        await until(lambda: "no endpoint says what it serves" in caplog.text)
    for _ in range(2):
        answer = await ask(gw)
        assert answer.status_code == 200 and answer.headers["x-gateway-cache"] == "bypass"
    assert calls == 2 and version(gw) == UNKNOWN
    async with httpx.AsyncClient() as client:  # what GatewayModelIdentityUnknown reads
        text = (await client.get(f"{gw.admin_url}/metrics")).text
    assert metric(text, "gateway_backend_model_identity", backend="main", identity=UNKNOWN) == 1


async def test_a_failed_probe_keeps_the_version_and_the_cache_keeps_answering(
    start_gateway: Any, tmp_path: Path, serve_app: Any
) -> None:
    state = {"models": 200, "asked": 0}

    async def models(_: web.Request) -> web.Response:
        state["asked"] += 1
        if state["models"] != 200:
            return web.json_response({"error": "busy"}, status=state["models"])
        return web.json_response({"data": [{"id": "m", "root": "/models/m-v1"}]})

    url = await model_server(serve_app, models)
    gw = await gateway_on(start_gateway, tmp_path, url)
    await until(lambda: version(gw) != UNKNOWN)
    known = version(gw)
    assert (await ask(gw)).headers["x-gateway-cache"] == "miss"
    state["models"] = 503  # a restart, an overloaded server: not new weights
    asked = state["asked"]
    await until(lambda: state["asked"] >= asked + 3)
    assert version(gw) == known
    assert (await ask(gw)).headers["x-gateway-cache"] == "hit"


async def test_a_reload_to_a_fixed_version_stops_asking_and_drops_the_series(
    start_gateway: Any, tmp_path: Path, sims: list[Any]
) -> None:
    sim = await start_sim(SimConfig(port=0, base_ms=1.0, weights="v1"))
    sims.append(sim)
    gw = await gateway_on(start_gateway, tmp_path, sim.url)
    await until(lambda: version(gw) != UNKNOWN)
    fixed = POLICY.format(where=f'url: "{sim.url}"')
    (tmp_path / "p.yaml").write_text(fixed.replace("version: auto", 'version: "fixed-1"'))
    async with httpx.AsyncClient() as client:
        assert (await client.post(f"{gw.admin_url}/reload")).json()["reloaded"]
        text = (await client.get(f"{gw.admin_url}/metrics")).text
    assert gw.gateway.transport.model_identity("main") is None
    assert "gateway_backend_model_identity{" not in text
    assert (await ask(gw)).headers["x-gateway-cache"] == "miss"
    assert (await ask(gw)).headers["x-gateway-cache"] == "hit"


# -- what each server's document says --------------------------------------------------------


def test_tgi_and_tei_info_give_the_model_and_its_revision() -> None:
    tgi = {
        "model_id": "bigscience/bloom-560m",
        "model_sha": "e515be6a73c4c4b36d05b9c1de5b9f8ab11fc2d6",
        "model_dtype": "torch.float16",
        "max_concurrent_requests": 128,
        "version": "3.0.1",
        "sha": "0c6aa6a",
    }
    found = identity_of("/info", json.dumps(tgi).encode())
    assert found is not None and "e515be6a" in found and "max_concurrent" not in found
    revised = identity_of("/info", json.dumps({**tgi, "model_sha": "1111"}).encode())
    assert revised != found
    # the server's own build or limits are not its weights
    rebuilt = {**tgi, "version": "3.1.0", "sha": "abc", "max_concurrent_requests": 8}
    assert identity_of("/info", json.dumps(rebuilt).encode()) == found


def test_ollama_tags_give_each_models_digest_and_nothing_without_one() -> None:
    tags: dict[str, Any] = {
        "models": [
            {"name": "gemma3:270m", "digest": "e7d8c9", "modified_at": "2026-12-05T06:00:00Z"},
            {"name": "llama3:8b", "digest": "a1b2c3", "size": 4_661_224_676},
        ]
    }
    found = identity_of("/api/tags", json.dumps(tags).encode())
    later = {"models": [{**m, "modified_at": "2027-01-01T00:00:00Z"} for m in tags["models"]]}
    assert found is not None and found == identity_of("/api/tags", json.dumps(later).encode())
    reordered = {"models": list(reversed(tags["models"]))}
    assert identity_of("/api/tags", json.dumps(reordered).encode()) == found
    # a server that copies the path without digests (llama.cpp's compatible one) says nothing
    blank = {"models": [{"name": "m.gguf", "digest": ""}]}
    assert identity_of("/api/tags", json.dumps(blank).encode()) is None


def test_openai_model_lists_give_ids_roots_and_llama_cpps_meta_never_created() -> None:
    vllm: dict[str, Any] = {
        "data": [
            {"id": "qwen", "root": "/models/qwen-v3", "parent": None, "created": 1733380000},
            {"id": "sql-lora", "root": "/adapters/sql", "parent": "qwen", "created": 1},
        ]
    }
    found = identity_of("/v1/models", json.dumps(vllm).encode())
    moved = {"data": [{**m, "created": m["created"] + 60} for m in vllm["data"]]}
    assert found is not None and identity_of("/v1/models", json.dumps(moved).encode()) == found
    new_root = {"data": [{**vllm["data"][0], "root": "/models/qwen-v4"}, vllm["data"][1]]}
    assert identity_of("/v1/models", json.dumps(new_root).encode()) != found
    llama = {"data": [{"id": "gemma.gguf", "meta": {"n_params": 268098176, "size": 291552}}]}
    requant = {"data": [{"id": "gemma.gguf", "meta": {"n_params": 268098176, "size": 536870}}]}
    assert identity_of("/v1/models", json.dumps(llama).encode()) != identity_of(
        "/v1/models", json.dumps(requant).encode()
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"data": "x"}',
        b'{"data": [1, "a", null]}',
        b'{"models": [{"name": "x"}]}',
        b'{"model_id": 7}',
        b"[" * 100_000 + b"]" * 100_000,
    ],
)
def test_garbage_states_no_identity(body: bytes) -> None:
    for path in ("/info", "/api/tags", "/v1/models"):
        assert identity_of(path, body) is None


def test_a_list_too_long_to_be_anyones_weights_is_read_up_to_its_cap() -> None:
    many = {"data": [{"id": f"m{i}"} for i in range(100_000)]}
    found = identity_of("/v1/models", json.dumps(many).encode())
    assert found is not None and len(found) < 10_000


def test_the_version_is_the_set_of_identities_in_any_order() -> None:
    assert version_of([]) == UNKNOWN
    assert version_of(["a", "b"]) == version_of(["b", "a", "b"]) != version_of(["a"])
    assert version_of(["a"]).startswith("auto:") and len(version_of(["a"])) == 17


def test_an_embedder_must_keep_a_fixed_version_and_the_interval_be_positive() -> None:
    text = """
backends:
  emb: {url: "http://127.0.0.1:9", model_version: auto, model_version_interval_s: 0}
  main: {url: "http://127.0.0.1:9"}
routes:
  - name: chat
    match: {path: "/v1/*"}
    backend: main
    cache: {ttl_s: 60, semantic: {method: embedding, embedder: emb}}
"""
    with pytest.raises(PolicyError) as raised:
        parse_policy_text(text)
    said = "\n".join(str(p) for p in raised.value.problems)
    assert "model_version_interval_s" in said and "fixed model_version" in said


async def test_probes_stay_bounded_against_a_server_that_never_answers(
    start_gateway: Any, tmp_path: Path, serve_app: Any
) -> None:
    """A server that accepts and never answers: each probe gives up within its interval,
    and the next one is asked on time (the watch never hangs on one)."""
    started = 0

    async def stall(_: web.Request) -> web.Response:
        nonlocal started
        started += 1
        await asyncio.sleep(3600)
        return web.Response()

    app = web.Application()
    app.router.add_get("/info", stall)
    url = await serve_app(app)
    gw = await gateway_on(start_gateway, tmp_path, url)
    await until(lambda: started >= 3)
    assert version(gw) == UNKNOWN


@pytest.mark.llm
async def test_llama_cpp_says_what_it_serves_and_its_greedy_answers_are_keyed_by_it(
    llama: Any, start_gateway: Any, tmp_path: Path
) -> None:
    """The real server (llama.cpp, Gemma 3 270M): its ``/v1/models`` names the file and the
    weights' figures; asked twice it says the same (its ``created`` moves, its ``n_ctx`` is
    the server's setting: neither read), and a greedy chat is cached under that version."""
    async with httpx.AsyncClient(base_url=llama.url, timeout=30) as client:
        said = [(await client.get("/v1/models")).content for _ in range(2)]
    found = identity_of("/v1/models", said[0])
    assert found is not None and found == identity_of("/v1/models", said[1])
    assert '"n_params"' in found and "n_ctx" not in found.replace("n_ctx_train", "")
    gw = await gateway_on(start_gateway, tmp_path, llama.url)
    await until(lambda: version(gw) != UNKNOWN, timeout_s=30)
    assert version(gw) == version_of([found])
    asked: dict[str, Any] = {"model": "gemma-3-270m"}
    asked["messages"] = [{"role": "user", "content": "Hi"}]
    asked |= {"max_tokens": 4, "temperature": 0}
    async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:
        answers = [await client.post("/v1/chat/completions", json=asked) for _ in range(2)]
    assert [a.headers["x-gateway-cache"] for a in answers] == ["miss", "hit"]


async def test_an_endpoint_discovery_adds_is_asked_at_once_not_at_the_next_round(
    sims: list[Any],
) -> None:
    """A rollout's new pod appears through DNS between two rounds (an hour apart here): it
    is asked within a second, so its weights change the version before the next round."""
    port = free_port_on_all()
    for host, weights in (("127.0.0.2", "v1"), ("127.0.0.3", "v2")):
        sims.append(await start_sim(SimConfig(host=host, port=port, weights=weights)))
    resolver = FakeResolver({"llm.svc": ["127.0.0.2"]})
    upstreams = Upstreams(Metrics(), resolver=resolver)
    text = f"""
backends:
  main:
    discovery: {{dns: llm.svc, port: {port}, interval_s: 0.02}}
    model_version: auto
    model_version_interval_s: 3600
routes:
  - {{name: chat, match: {{path: "/*"}}, backend: main, cache: {{ttl_s: 60}}}}
"""
    upstreams.sync(parse_policy_text(text))
    try:
        await until(lambda: upstreams.model_identity("main") != UNKNOWN)
        first = upstreams.model_identity("main")
        resolver.set("llm.svc", ["127.0.0.2", "127.0.0.3"])
        await until(lambda: upstreams.model_identity("main") not in (first, UNKNOWN))
        mixed = upstreams.model_identity("main")
        resolver.set("llm.svc", ["127.0.0.3"])  # the old pod gone: the new weights' version
        await until(lambda: upstreams.model_identity("main") not in (first, mixed, UNKNOWN))
    finally:
        await upstreams.aclose()


async def test_the_fake_transport_says_what_a_test_says_the_servers_serve(pipeline: Any) -> None:
    """``gateway.testing``'s ``FakeTransport`` stands for the servers' statements too, for
    a user's own tests of a ``model_version: auto`` policy without sockets."""
    asked = 0

    def answer(_: Any) -> Any:
        nonlocal asked
        asked += 1
        return json_reply({"choices": [{"message": {"content": f"answer {asked}"}}]})

    text = POLICY.format(where='url: "http://main.invalid"')
    gw = await pipeline(text, {"main": answer})
    question = chat("Which jacket keeps the rain out?", **GREEDY)
    said = [(await gw.post("/v1/chat/completions", question)).headers["x-gateway-cache"]]
    gw.transport.identities["main"] = "auto:0123456789ab"
    for _ in range(2):
        said.append((await gw.post("/v1/chat/completions", question)).headers["x-gateway-cache"])
    gw.transport.identities["main"] = "auto:ba9876543210"  # new weights
    said.append((await gw.post("/v1/chat/completions", question)).headers["x-gateway-cache"])
    assert said == ["bypass", "miss", "hit", "miss"] and asked == 3


async def test_a_statement_too_large_to_read_whole_is_not_read(
    start_gateway: Any, tmp_path: Path, serve_app: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A model list past what the transport reads whole (1 MiB) comes as a stream, which the
    probe closes unread: no identity, nothing held, and the server's calls still answered."""

    async def models(_: web.Request) -> web.Response:
        data = [{"id": f"model-{i:07d}", "root": "x" * 64} for i in range(30_000)]
        return web.json_response({"data": data})

    url = await model_server(serve_app, models)
    with caplog.at_level(logging.WARNING, logger="gateway.transport"):
        gw = await gateway_on(start_gateway, tmp_path, url)
        await until(lambda: "no endpoint says what it serves" in caplog.text)
    answer = await ask(gw)
    assert answer.status_code == 200 and answer.headers["x-gateway-cache"] == "bypass"
    assert version(gw) == UNKNOWN


async def test_a_fallbacks_answer_is_not_stored_while_its_servers_have_said_nothing(
    pipeline: Any,
) -> None:
    """The primary keeps a fixed version; its fallback has ``model_version: auto`` and no
    statement yet: the fallback's answer goes to the client and is not stored, counted as
    ``identity_unknown`` (under no version it could ever be found by); once the fallback's
    servers have said, its answers are stored under that version."""
    from tests.backends import Model, post
    from tests.helpers import policy

    main, spare = Model("main"), Model("spare")
    main.status = 500
    backends = {
        "main": {"url": "http://main.test", "model_version": "v1"},
        "spare": {"url": "http://spare.test", "model_version": "auto"},
    }
    route = {"fallback": ["spare"], "cache": {"ttl_s": 60}}
    gw = await pipeline(policy(backends, route), {"main": main, "spare": spare})
    answer = await post(gw, "q", temperature=0)
    assert answer.status_code == 200 and answer.headers["X-Gateway-Backend"] == "spare"
    not_stored = gw.metric(
        "gateway_cache_not_stored_total", route="chat", reason="identity_unknown"
    )
    assert not_stored == 1
    gw.transport.identities["spare"] = "auto:0123456789ab"
    await post(gw, "q", temperature=0)  # stored, under the spare's own key and version
    again = gw.metric("gateway_cache_not_stored_total", route="chat", reason="identity_unknown")
    assert again == 1 and len(spare.arrivals) == 2


async def test_each_model_is_keyed_by_its_own_weights_not_its_neighbours(
    start_gateway: Any, tmp_path: Path, serve_app: Any
) -> None:
    """vLLM loads a LoRA adapter at run time, Ollama pulls another model beside the one in
    use: the list changes, the base model's weights do not, and its cached answers stay
    good.  The adapter's key follows its base's weights too."""
    listed = [{"id": "base", "root": "/models/base-v1", "created": 1}]
    calls: list[str] = []

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": listed})

    async def completions(request: web.Request) -> web.Response:
        model = (await request.json())["model"]
        calls.append(model)
        return web.json_response({"choices": [{"message": {"content": f"{model} {len(calls)}"}}]})

    url = await model_server(serve_app, models, completions)
    gw = await gateway_on(start_gateway, tmp_path, url)
    await until(lambda: version(gw) != UNKNOWN)

    async def asks(model: str) -> str:
        async with httpx.AsyncClient(base_url=gw.url) as client:
            body = {**chat("Which jacket?", **GREEDY), "model": model}
            answer = await client.post("/v1/chat/completions", json=body)
        return str(answer.headers["x-gateway-cache"])

    assert [await asks("base"), await asks("base")] == ["miss", "hit"]
    whole = version(gw)
    listed.append({"id": "sql-lora", "root": "/adapters/sql", "parent": "base", "created": 2})
    await until(lambda: version(gw) != whole)  # the server's list changed...
    assert await asks("base") == "hit"  # ...the base model's weights did not
    assert [await asks("sql-lora"), await asks("sql-lora")] == ["miss", "hit"]
    listed[0] = {**listed[0], "root": "/models/base-v2"}  # new base weights: both anew
    before = version(gw)
    await until(lambda: version(gw) != before)
    assert [await asks("base"), await asks("sql-lora")] == ["miss", "miss"]
    assert calls == ["base", "sql-lora", "base", "sql-lora"]


def test_a_statement_parts_each_model_an_adapter_with_its_base_and_ollamas_latest() -> None:
    vllm = {
        "data": [
            {"id": "base", "root": "/m/base-v1"},
            {"id": "lora", "root": "/a/lora", "parent": "base"},
            {"id": "other", "root": "/m/other"},
        ]
    }
    said = statement_of("/v1/models", json.dumps(vllm).encode())
    assert said is not None and set(said.models) == {"base", "lora", "other"}
    assert "/m/base-v1" in said.models["lora"] and "/m/base-v1" not in said.models["other"]
    assert said.of("unlisted") == said.of(None) == said.whole
    tags = {
        "models": [{"name": "llama3:latest", "digest": "d1"}, {"name": "qwen:7b", "digest": "d2"}]
    }
    said = statement_of("/api/tags", json.dumps(tags).encode())
    assert said is not None and said.of("llama3") == said.of("llama3:latest") != said.of("qwen:7b")
    tgi = {"model_id": "bigscience/bloom-560m", "model_sha": "e515be6a"}
    said = statement_of("/info", json.dumps(tgi).encode())
    assert said is not None and said.of("tgi") == said.of("anything") == said.whole


async def test_model_names_a_client_makes_up_take_the_whole_version_and_are_not_kept(
    start_gateway: Any, tmp_path: Path, serve_app: Any
) -> None:
    """The model a request names picks its version, and a client names any string: one the
    servers do not list takes the backend's whole version, and only listed names are
    remembered, so made-up names cannot grow the gateway's memory."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "base", "root": "/m/base"}]})

    gw = await gateway_on(start_gateway, tmp_path, await model_server(serve_app, models))
    await until(lambda: version(gw) != UNKNOWN)
    transport = gw.gateway.transport
    made_up = {transport.model_identity("main", f"made-up-{i}") for i in range(5_000)}
    assert made_up == {version(gw)}
    assert transport.model_identity("main", "base") not in (None, UNKNOWN)
    assert len(transport._identities["main"][0]._of_model) == 1  # "base" alone
