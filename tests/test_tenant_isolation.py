"""A tenant is every credential it carries: clients told apart only by ``X-Api-Key`` or
``api-key`` (the Azure OpenAI convention) never share a cached answer, a flight, a batch,
a judged alias or a rate budget, and nothing runs upstream on another tenant's key.  Named
tenants (``tenants:``) by their key's hash: counted by name, 401 when keys are required.

On real sockets, against a model server that answers with the key it was sent (and, where
a test says so, refuses keys it does not know, as a real one does)."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import uuid
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.batching.stage import BATCHERS
from gateway.testing import FakeClock
from tests.helpers import until, write_policy

KEY_HEADERS = ["X-Api-Key", "api-key"]
CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"
NEVER_MS = 600_000


def ask(text: str = "What is the capital of France?") -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def key_of(headers: Any) -> str:
    for name in ("x-api-key", "api-key", "authorization"):
        if headers.get(name) is not None:
            return str(headers[name])
    return ""


class KeyedBackend:
    """Answers with the key it was sent; ``accepted`` (when set) refuses other keys with
    401; ``hold`` (when set) keeps every answer until it is released."""

    def __init__(self, accepted: set[str] | None = None) -> None:
        self.accepted = accepted
        self.calls: list[tuple[dict[str, str], Any]] = []
        self.hold: asyncio.Event | None = None
        self.answer_headers: dict[str, str] = {}
        self.ids = itertools.count(1)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CHAT, self.chat)
        app.router.add_post(EMBED, self.embeddings)
        return app

    async def _arrive(self, request: web.Request) -> tuple[str, Any, web.Response | None]:
        body = await request.json()
        self.calls.append(({k.lower(): v for k, v in request.headers.items()}, body))
        if self.hold is not None:
            await self.hold.wait()
        key = key_of(request.headers)
        if self.accepted is not None and key not in self.accepted:
            error = {"error": {"message": "bad key", "type": "auth", "code": "invalid_api_key"}}
            return key, body, web.json_response(error, status=401)
        return key, body, None

    async def chat(self, request: web.Request) -> web.Response:
        key, body, refused = await self._arrive(request)
        if refused is not None:
            return refused
        text = f"answer {next(self.ids)} for key {key!r}"
        answer = {
            "id": f"c-{uuid.uuid4().hex[:8]}",
            "object": "chat.completion",
            "model": body.get("model", "m"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10},
        }
        return web.json_response(answer, headers=self.answer_headers)

    async def embeddings(self, request: web.Request) -> web.Response:
        key, body, refused = await self._arrive(request)
        if refused is not None:
            return refused
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        stamp = float(int(hashlib.sha256(key.encode()).hexdigest(), 16) % 997)
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(text)), stamp]}
            for i, text in enumerate(inputs)
        ]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        answer = {"object": "list", "data": data, "model": "e", "usage": usage}
        return web.json_response(answer, headers=self.answer_headers)


def waiting_in(gw: Any) -> int:
    """Requests waiting in the gateway's batchers."""
    return sum(b.waiting for _, b in gw.gateway.registry.items(BATCHERS))


def stamp(key: str) -> float:
    return float(int(hashlib.sha256(key.encode()).hexdigest(), 16) % 997)


@pytest.fixture
async def keyed(serve_app, start_gateway, tmp_path):
    """``await keyed(routes_yaml, accepted=...)``: a gateway in front of a KeyedBackend."""

    async def start(routes: str, *, accepted: set[str] | None = None, extra: str = "", **kw):
        backend = KeyedBackend(accepted)
        url = await serve_app(backend.app())
        policy = write_policy(
            tmp_path, f'backends: {{model: {{url: "{url}"}}}}\nroutes:\n{routes}\n{extra}'
        )
        running = await start_gateway(policy=policy, **kw)
        return backend, running

    return start


CACHED = "  - {backend: model, cache: {ttl_s: 60}, coalesce: true}"


@pytest.mark.parametrize("header", KEY_HEADERS)
async def test_a_client_with_another_key_or_none_never_gets_a_cached_answer(keyed, header):
    backend, gw = await keyed(CACHED)
    async with httpx.AsyncClient(base_url=gw.url) as client:
        alice = await client.post(CHAT, json=ask(), headers={header: "alice-key"})
        again = await client.post(CHAT, json=ask(), headers={header: "alice-key"})
        bob = await client.post(CHAT, json=ask(), headers={header: "bob-key"})
        nobody = await client.post(CHAT, json=ask())
    assert again.headers["X-Gateway-Cache"] == "hit"
    assert again.json()["id"] == alice.json()["id"]
    for other, key in ((bob, "bob-key"), (nobody, "")):
        assert other.headers["X-Gateway-Cache"] == "miss"
        assert other.json()["choices"][0]["message"]["content"].endswith(f"for key {key!r}")
    assert [key_of(headers) for headers, _ in backend.calls] == ["alice-key", "bob-key", ""]


@pytest.mark.parametrize("header", KEY_HEADERS)
async def test_identical_requests_in_flight_with_different_keys_each_make_their_own_call(
    keyed, header
):
    backend, gw = await keyed(CACHED)
    backend.hold = asyncio.Event()
    async with httpx.AsyncClient(base_url=gw.url) as client:
        sent = [
            asyncio.ensure_future(client.post(CHAT, json=ask(), headers=h))
            for h in ({header: "alice-key"}, {header: "bob-key"}, {header: "alice-key"})
        ]
        await until(lambda: len(backend.calls) == 2)
        backend.hold.set()
        alice, bob, alice_again = await asyncio.gather(*sent)
    assert sorted(key_of(h) for h, _ in backend.calls) == ["alice-key", "bob-key"]
    assert alice_again.headers.get("X-Gateway-Coalesced") == "1"
    assert alice_again.json()["id"] == alice.json()["id"] != bob.json()["id"]
    assert bob.json()["choices"][0]["message"]["content"].endswith("for key 'bob-key'")


BATCHED = f"""  - backend: model
    match: {{path: {EMBED}}}
    batch: {{max_size: 16, max_wait_ms: {NEVER_MS}}}"""


@pytest.mark.parametrize("header", KEY_HEADERS)
async def test_the_batcher_never_runs_a_callers_input_on_another_callers_key(keyed, header):
    """The right key, a wrong one and none, waiting together for a busy backend that
    checks keys: each goes upstream with its own, and only the right one is answered."""
    backend, gw = await keyed(BATCHED, accepted={"good-key"})
    backend.hold = asyncio.Event()
    async with httpx.AsyncClient(base_url=gw.url) as client:

        def embed(text: str, key: str | None) -> Any:
            headers = {header: key} if key is not None else {}
            body = {"model": "e", "input": text}
            return asyncio.ensure_future(client.post(EMBED, json=body, headers=headers))

        busy = embed("first", "good-key")
        await until(lambda: len(backend.calls) == 1)
        waiting = [embed("right", "good-key"), embed("wrong", "bad-key"), embed("none", None)]
        await until(lambda: waiting_in(gw) == 3)  # with the batcher, the backend still busy
        backend.hold.set()
        await busy
        right, wrong, none = await asyncio.gather(*waiting)
    assert right.status_code == 200
    assert right.json()["data"][0]["embedding"] == [5.0, stamp("good-key")]
    assert (wrong.status_code, none.status_code) == (401, 401)
    for headers, body in backend.calls:  # never one key with another caller's input
        key = key_of(headers)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        owner = {"first": "good-key", "right": "good-key", "wrong": "bad-key", "none": ""}
        assert {owner[i] for i in inputs} == {key}, (key, inputs)


async def test_a_merged_call_carries_only_the_headers_its_members_share(keyed):
    backend, gw = await keyed(BATCHED)
    backend.hold = asyncio.Event()
    async with httpx.AsyncClient(base_url=gw.url) as client:

        def embed(text: str, note: str) -> Any:
            headers = {"X-Api-Key": "k", "X-Note": note, "X-Same": "same"}
            body = {"model": "e", "input": text}
            return asyncio.ensure_future(client.post(EMBED, json=body, headers=headers))

        busy = embed("first", "0")
        await until(lambda: len(backend.calls) == 1)
        merged = [embed("a", "1"), embed("bb", "2")]
        await until(lambda: waiting_in(gw) == 2)
        backend.hold.set()
        await busy
        answers = await asyncio.gather(*merged)
    assert [a.json()["data"][0]["embedding"][0] for a in answers] == [1.0, 2.0]
    headers, body = backend.calls[1]
    assert body["input"] == ["a", "bb"]
    assert headers["x-api-key"] == "k" and headers["x-same"] == "same"
    assert "x-note" not in headers and "x-request-id" not in headers


LIMITED = "  - {backend: model, rate_limit: {requests_per_s: 1, burst: 5}}"


@pytest.mark.parametrize("header", ["Authorization", *KEY_HEADERS])
async def test_a_fresh_made_up_key_per_request_gets_at_most_twice_one_tenants_budget(keyed, header):
    """Against a backend that takes any key: 40 requests from one address, each with a key
    never seen before, admit at most 2 x burst (the address's new-credential budget);
    a real tenant's budget is its own and whole."""
    _, gw = await keyed(LIMITED, clock=FakeClock())
    prefix = "Bearer " if header == "Authorization" else ""
    async with httpx.AsyncClient(base_url=gw.url) as client:
        statuses = [
            (
                await client.post(CHAT, json=ask(), headers={header: f"{prefix}{uuid.uuid4()}"})
            ).status_code
            for _ in range(40)
        ]
    assert statuses.count(200) == 10 and set(statuses) == {200, 429}


async def test_a_proven_key_keeps_its_own_budget_beside_invented_ones(keyed):
    _, gw = await keyed(LIMITED, clock=FakeClock())
    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def post(key: str) -> int:
            return (await client.post(CHAT, json=ask(), headers={"X-Api-Key": key})).status_code

        assert await post("real") == 200  # proven by its first success
        invented = [await post(str(uuid.uuid4())) for _ in range(20)]
        assert invented.count(200) == 9  # the newcomers' 10, one of them spent by "real"
        assert [await post("real") for _ in range(5)] == [200, 200, 200, 200, 429]


TENANT_KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key"}


def tenants_yaml(required: bool, limit: str = "") -> str:
    keys = "\n".join(
        f"    - {{name: {name}, sha256: {hashlib.sha256(k.encode()).hexdigest()}{limit}}}"
        for name, k in TENANT_KEYS.items()
    )
    return f"tenants:\n  required: {str(required).lower()}\n  keys:\n{keys}\n"


@pytest.mark.parametrize("header", ["Authorization", *KEY_HEADERS])
async def test_with_required_tenants_only_listed_keys_are_served(keyed, header):
    backend, gw = await keyed(CACHED, extra=tenants_yaml(True))
    prefix = "Bearer " if header == "Authorization" else ""
    async with httpx.AsyncClient(base_url=gw.url) as client:
        known = await client.post(CHAT, json=ask(), headers={header: prefix + "acme-secret-key"})
        unknown = await client.post(CHAT, json=ask(), headers={header: prefix + "made-up"})
        bare = await client.post(CHAT, json=ask())
        both = await client.post(
            CHAT,
            json=ask(),
            headers={"X-Api-Key": "acme-secret-key", "api-key": "globex-secret-key"},
        )
    assert known.status_code == 200
    for refused in (unknown, bare, both):
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert len(backend.calls) == 1


async def test_a_named_tenant_is_held_to_its_own_limit_over_all_its_keys(keyed):
    limit = ", rate_limit: {requests_per_s: 1, burst: 2}"
    _, gw = await keyed("  - {backend: model}", extra=tenants_yaml(False, limit), clock=FakeClock())
    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def post(**headers: str) -> int:
            return (await client.post(CHAT, json=ask(), headers=headers)).status_code

        acme = [await post(**{"X-Api-Key": "acme-secret-key"}) for _ in range(3)]
        globex = await post(**{"api-key": "globex-secret-key"})
        anonymous = [await post() for _ in range(3)]  # no named tenant: no tenant limit
    assert acme == [200, 200, 429]
    assert globex == 200
    assert anonymous == [200, 200, 200]
