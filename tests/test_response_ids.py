"""The Responses API's stored responses, scoped to the tenant that created them
(``tenants.response_id_secret``): each id a client sees is tagged for its credentials, and
an id without its own tag is refused before any backend (``GET``/``DELETE``
``/v1/responses/<id>``, ``/cancel``, ``previous_response_id``).  The official ``openai``
SDK as the client, a model server on a real socket that stores responses as vLLM does with
its store on, and two gateways sharing the secret as replicas do."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.openai.bound_ids import RESPONSE, Owned, ResponseIds
from gateway.policy.load import parse_sources
from gateway.sim import SimConfig, start_sim
from tests.helpers import metric, problems_of, write_policy

SECRET = "a-secret-of-more-than-16-chars"
ALICE, BOB = "alice-key", "bob-key"


class Store:
    """Stores every response it makes, serves it back by id, continues a stored one; keeps
    conversations (the Conversations API) and their items, a response joining one; and
    every item under its id, resolving an input item named by id (``item_reference``, or an
    item given with its ``id``) as OpenAI does, whoever made it."""

    def __init__(self, name: str = "") -> None:
        self.name = name  # said before each answer
        self.responses: dict[str, dict[str, Any]] = {}
        self.conversations: dict[str, list[dict[str, Any]]] = {}  # their items
        self.items: dict[str, dict[str, Any]] = {}
        self.inputs: dict[str, list[dict[str, Any]]] = {}  # each response's input items
        self.made = 0
        self.down = False  # answers every read with a 503
        self.asked: list[tuple[str, str, Any]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/responses", self.create)
        app.router.add_post("/v1/responses/input_tokens", self.input_tokens)
        app.router.add_get("/v1/responses/{rid}", self.get)
        app.router.add_get("/v1/responses/{rid}/input_items", self.input_items)
        app.router.add_delete("/v1/responses/{rid}", self.delete)
        app.router.add_post("/v1/responses/{rid}/cancel", self.get)
        app.router.add_post("/v1/conversations", self.open)
        for method in ("GET", "POST", "DELETE"):
            app.router.add_route(method, "/v1/conversations/{cid}", self.conversation)
        app.router.add_route("*", "/v1/conversations/{cid}/items", self.conversation)
        app.router.add_get("/v1/conversations/{cid}/items/{iid}", self.conversation)
        return app

    async def open(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append(("POST", request.path, body))
        self.made += 1
        cid = f"conv_{self.made:04d}"
        self.conversations[cid] = self._kept(body.get("items", []))
        return web.json_response(_conversation(cid))

    async def conversation(self, request: web.Request) -> web.Response:
        """A conversation read, updated or deleted; its items listed, added or read."""
        cid, iid = request.match_info["cid"], request.match_info.get("iid")
        body = await request.json() if request.can_read_body else None
        self.asked.append((request.method, request.path_qs, body))
        if cid not in self.conversations:
            return _error(404, f"Conversation with id '{cid}' not found.")
        items = self.conversations[cid]
        if iid is not None:
            found = [item for item in items if item.get("id") == iid]
            return web.json_response(found[0]) if found else _error(404, "No such item.")
        if request.path.endswith("/items"):
            if request.method == "POST" and body is not None:
                items.extend(self._kept(body["items"]))
            return web.json_response(_page(items, request.query.get("after")))
        if request.method == "DELETE":
            del self.conversations[cid]
            return web.json_response({"id": cid, "object": "conversation.deleted", "deleted": True})
        return web.json_response(_conversation(cid))

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append(("POST", request.path, body))
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.responses:
            return _error(400, f"Previous response with id '{previous}' not found.")
        joined = body.get("conversation")
        cid = joined.get("id") if isinstance(joined, dict) else joined
        if cid is not None and cid not in self.conversations:
            return _error(404, f"Conversation with id '{cid}' not found.")
        given = body["input"] if isinstance(body["input"], list) else []
        unknown = [item["id"] for item in given if "id" in item and item["id"] not in self.items]
        if unknown:
            return _error(404, f"Item with id '{unknown[0]}' not found.")
        self.made += 1
        rid, text = f"resp_{self.made:04d}", f"{self.name}answer {self.made}"
        self.inputs[rid] = self._kept(
            [self.items[item["id"]] if "id" in item else item for item in given]
        )
        made = {
            "id": rid,
            "object": "response",
            "created_at": 1,
            "status": "completed",
            "model": body["model"],
            "previous_response_id": previous,
            "metadata": body.get("metadata"),
            "output": [
                {
                    "type": "message",
                    "id": f"msg_{self.made:04d}",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}],
                }
            ],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5},
            "conversation": {"id": cid} if cid else None,
        }
        self.responses[rid] = made
        self.items[made["output"][0]["id"]] = made["output"][0]
        if cid:
            said = {"type": "message", "role": "user", "content": body["input"]}
            self.conversations[cid] += [*self._kept([said]), made["output"][0]]
        if not body.get("stream"):
            return web.json_response(made)
        events = [
            ("response.created", {"type": "response.created", "response": {**made, "status": "in_progress", "output": []}}),
            ("response.output_item.added", {"type": "response.output_item.added", "output_index": 0, "item": {**made["output"][0], "status": "in_progress", "content": []}}),
            ("response.output_text.delta", {"type": "response.output_text.delta", "item_id": made["output"][0]["id"], "output_index": 0, "content_index": 0, "delta": text}),
            ("response.completed", {"type": "response.completed", "response": made}),
        ]  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for name, data in events:  # an event split over two writes
            raw = f"event: {name}\ndata: {json.dumps(data)}\n\n".encode()
            await response.write(raw[:30])
            await response.write(raw[30:])
        await response.write_eof()
        return response

    async def input_tokens(self, request: web.Request) -> web.Response:
        self.asked.append(("POST", request.path, await request.json()))
        return web.json_response({"object": "response.input_tokens", "input_tokens": 3})

    async def input_items(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        self.asked.append((request.method, request.path_qs, None))
        if rid not in self.inputs:
            return _error(404, f"Response with id '{rid}' not found.")
        return web.json_response(_page(self.inputs[rid], request.query.get("after")))

    def _kept(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``items`` as stored: each under its id, one given to each without."""
        kept = []
        for item in items:
            item = item if "id" in item else {"id": f"item_{len(self.items) + 1:04d}", **item}
            self.items[item["id"]] = item
            kept.append(item)
        return kept

    async def get(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        self.asked.append((request.method, request.path, None))
        if self.down:
            return _error(503, "overloaded")
        if rid not in self.responses:
            return _error(404, f"Response with id '{rid}' not found.")
        return web.json_response(self.responses[rid])

    async def delete(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        self.asked.append(("DELETE", request.path, None))
        if self.responses.pop(rid, None) is None:
            return _error(404, f"Response with id '{rid}' not found.")
        return web.json_response({"id": rid, "object": "response", "deleted": True})


def _page(items: list[dict[str, Any]], after: str | None) -> dict[str, Any]:
    """A list answer of ``items``, those after the item ``after`` names, if one does."""
    ids = [item["id"] for item in items]
    shown = items[ids.index(after) + 1 :] if after in ids else items
    first, last = (shown[0]["id"], shown[-1]["id"]) if shown else (None, None)
    return {"object": "list", "data": shown, "first_id": first, "last_id": last, "has_more": False}


def _conversation(cid: str) -> dict[str, Any]:
    return {"id": cid, "object": "conversation", "created_at": 1, "metadata": {}}


def _error(status: int, message: str) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=status)


def policy(url: str, secret: str = SECRET) -> str:
    tenants = f"tenants: {{response_id_secret: {secret}}}\n" if secret else ""
    return f"backends: {{main: {{url: '{url}'}}}}\nroutes: [{{backend: main}}]\n{tenants}"


def held_policy(url: str, *, bound: bool) -> str:
    """A policy where ALICE is a tenant held to the model ``m``, ids bound or not."""
    digest = hashlib.sha256(ALICE.encode()).hexdigest()
    secret = f"response_id_secret: {SECRET}, " if bound else ""
    return policy(url, secret="") + (
        f"tenants: {{{secret}keys: [{{name: alice, sha256: {digest}, models: [m]}}]}}\n"
    )


def round_robin(urls: list[str]) -> str:
    """A policy binding ids, over one backend of ``urls`` taken in turn."""
    return (
        f"backends: {{main: {{endpoints: {json.dumps(urls)}, balance: round_robin}}}}\n"
        f"routes: [{{backend: main}}]\ntenants: {{response_id_secret: {SECRET}}}\n"
    )


@pytest.fixture
async def bound(serve_app, start_gateway, tmp_path):
    """A storing model server, and a gateway binding ids in front of it (shared by the
    conversation and item tests)."""
    store = Store()
    url = await serve_app(store.app())
    return store, await start_gateway(policy=write_policy(tmp_path, policy(url)))


def sdk(gw: Any, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_a_tenant_reads_and_continues_its_own_responses(bound):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        first = await alice.responses.create(model="m", input="hi")
        assert first.id.startswith("resp_0001~") and first.output_text == "answer 1"
        again = await alice.responses.retrieve(first.id)
        assert again.id == first.id
        follow = await alice.responses.create(
            model="m", input="more", previous_response_id=first.id
        )
        assert follow.previous_response_id == first.id  # the echo, tagged again
        assert follow.id.startswith("resp_0002~")
    assert store.asked[1][:2] == ("GET", "/v1/responses/resp_0001")
    assert store.asked[2][2]["previous_response_id"] == "resp_0001"


async def test_another_tenant_is_refused_every_id_it_did_not_get_and_the_backend_never_asked(
    bound,
):
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = (await alice.responses.create(model="m", input="secret plans")).id
    asked = len(store.asked)
    raw = made.partition("~")[0]
    forged = raw + "~" + "0" * 24
    async with sdk(gw, BOB) as bob:
        for rid in (made, raw, forged):
            with pytest.raises(openai.NotFoundError) as refused:
                await bob.responses.retrieve(rid)
            assert refused.value.code == "response_not_found"
            with pytest.raises(openai.NotFoundError):
                await bob.responses.delete(rid)
            with pytest.raises(openai.NotFoundError):
                await bob.responses.cancel(rid)
            with pytest.raises(openai.BadRequestError) as continued:
                await bob.responses.create(model="m", input="x", previous_response_id=rid)
            assert continued.value.code == "previous_response_not_found"
    async with httpx.AsyncClient() as nobody:  # no credentials: a scope of its own
        assert (await nobody.get(gw.url + "/v1/responses/" + made)).status_code == 404
    assert len(store.asked) == asked
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    counter = "gateway_response_ids_refused_total"
    assert metric(text, counter, tenant="", where="path") == 3 * 3 + 1
    assert metric(text, counter, tenant="", where="previous_response_id") == 3
    async with sdk(gw, ALICE) as alice:
        await alice.responses.delete(made)
    assert store.asked[-1] == ("DELETE", "/v1/responses/" + raw, None)


async def test_every_id_of_a_streamed_answer_is_tagged(bound):
    _, gw = bound
    async with httpx.AsyncClient() as client:
        reply = await client.post(
            gw.url + "/v1/responses",
            json={"model": "m", "input": "hi", "stream": True},
            headers={"Authorization": f"Bearer {ALICE}"},
        )
    ids = {
        json.loads(line[5:])["response"]["id"]
        for line in reply.content.splitlines()
        if line.startswith(b"data:") and b'"response"' in line
    }
    assert len(ids) == 1 and next(iter(ids)).startswith("resp_0001~")
    async with sdk(gw, ALICE) as alice:
        assert (await alice.responses.retrieve(ids.pop())).output_text == "answer 1"


async def test_replicas_sharing_the_secret_take_each_others_ids(serve_app, start_gateway, tmp_path):
    store = Store()
    url = await serve_app(store.app())
    one = await start_gateway(policy=write_policy(tmp_path, policy(url), "one.yaml"))
    two = await start_gateway(policy=write_policy(tmp_path, policy(url), "two.yaml"))
    other = await start_gateway(
        policy=write_policy(tmp_path, policy(url, "another-secret-16-chars"), "other.yaml")
    )
    async with sdk(one, ALICE) as alice:
        made = (await alice.responses.create(model="m", input="hi")).id
    async with sdk(two, ALICE) as alice:
        assert (await alice.responses.retrieve(made)).id == made
    async with sdk(other, ALICE) as alice:
        with pytest.raises(openai.NotFoundError):
            await alice.responses.retrieve(made)


async def test_an_id_whose_tilde_is_percent_encoded_is_read_as_sent(bound):
    _, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = (await alice.responses.create(model="m", input="hi")).id
    async with httpx.AsyncClient() as client:
        reply = await client.get(
            gw.url + "/v1/responses/" + made.replace("~", "%7E"),
            headers={"Authorization": f"Bearer {ALICE}"},
        )
    assert reply.status_code == 200 and reply.json()["id"] == made


async def test_without_the_secret_ids_pass_as_the_backend_wrote_them(
    serve_app, start_gateway, tmp_path
):
    store = Store()
    url = await serve_app(store.app())
    gw = await start_gateway(policy=write_policy(tmp_path, policy(url, secret="")))
    async with sdk(gw, ALICE) as alice:
        made = (await alice.responses.create(model="m", input="hi")).id
    async with sdk(gw, BOB) as bob:
        assert (await bob.responses.retrieve(made)).id == made == "resp_0001"


def test_only_the_ids_a_caller_owns_are_tagged():
    ids = ResponseIds(SECRET)
    body = {
        "id": "resp_1",
        "previous_response_id": "resp_0",
        "output": [{"id": "msg_1", "text": "see resp_1", "quoted": '"id": "resp_1"'}],
        "metadata": {"id": "resp_9"},
    }
    owned = [Owned("resp_1", "0a1b2c3d", RESPONSE), Owned("resp_0", "", RESPONSE)]
    tagged = json.loads(ids.tag_owned("scope", json.dumps(body).encode(), owned))
    assert tagged["id"] == ids.tag("scope", "resp_1", "0a1b2c3d")
    assert tagged["previous_response_id"] == ids.tag("scope", "resp_0")
    assert tagged["output"] == body["output"]  # inside other text: left as it was
    assert tagged["metadata"] == {"id": "resp_9"}  # not the caller's: never signed
    again = json.dumps(tagged).encode()
    assert ids.tag_owned("scope", again, owned) == again  # not tagged twice
    assert ids.untag("scope", tagged["id"]) == owned[0]
    assert ids.untag("scope", tagged["previous_response_id"]) == owned[1]
    assert ids.untag("other", tagged["id"]) is None
    assert ids.untag("scope", "resp_1") is None
    assert ids.tag("scope", "resp_1") != ResponseIds(SECRET + "x").tag("scope", "resp_1")


def test_a_clients_guesses_are_never_remembered():
    """Untagging remembers only an id it proved (so that its answer need not tag it anew):
    a hostile client's guesses, however long, leave nothing behind."""
    ids = ResponseIds(SECRET)
    for n in range(50):
        guess = "resp_" + "x" * 100_000 + f"~{n:08x}~" + "0" * 24
        assert ids.untag("scope", guess) is None
    assert not ids._proved  # the memo's own: nothing of the guesses in it
    tagged = ids.tag("scope", "resp_1", "0a1b2c3d")
    assert ids.untag("scope", tagged) == Owned("resp_1", "0a1b2c3d", RESPONSE)
    assert len(ids._proved) == 1


def test_the_endpoint_an_id_names_is_covered_by_its_tag():
    ids = ResponseIds(SECRET)
    url = "http://10.0.3.17:8000"
    handle = ids.handle(url)
    assert len(handle) == 8 and "10.0" not in handle
    assert handle == ResponseIds(SECRET).handle(url) != ResponseIds(SECRET + "x").handle(url)
    tagged = ids.tag("scope", "resp_1", handle)
    rid, _, mac = tagged.split("~")
    other = ids.handle("http://10.0.3.18:8000")
    for moved in (f"{rid}~{other}~{mac}", f"{rid}~{mac}", f"{rid}~{handle}{mac}"):
        assert ids.untag("scope", moved) is None, moved  # re-pinned, or unpinned: refused
    assert ids.pin(handle)(url) and not ids.pin(handle)("http://10.0.3.18:8000")


async def test_an_id_the_client_put_in_the_answer_is_never_signed_for_it(bound):
    """An id the client never got, echoed back in its ``metadata`` (the server repeats
    it), stays as it was; and a body choosing its response's id (vLLM's ``request_id``) is
    refused, so a client cannot have the gateway sign another tenant's id."""
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        victim = (await alice.responses.create(model="m", input="secret plans")).id
    raw = victim.partition("~")[0]
    asked = len(store.asked)
    async with sdk(gw, BOB) as bob:
        made = await bob.responses.create(
            model="m", input="hi", metadata={"id": raw, "response_id": raw}
        )
        assert made.metadata == {"id": raw, "response_id": raw}
        assert made.id.startswith("resp_0002~")
        with pytest.raises(openai.BadRequestError) as chosen:
            await bob.responses.create(model="m", input="hi", extra_body={"request_id": raw})
        assert chosen.value.code == "response_id_chosen"
        with pytest.raises(openai.NotFoundError):
            await bob.responses.retrieve(raw)
    assert len(store.asked) == asked + 1  # only bob's first creation reached the server


def test_a_short_secret_is_refused():
    found = problems_of("tenants: {response_id_secret: too-short}\n")
    assert any("response_id_secret" in p and "16 characters" in p for p in found), found


def test_named_tenants_without_the_secret_are_warned_of():
    """Named tenants and no secret: a warning (at load, and from ``gateway check``) that
    stored objects lie open between them; none with the secret, none without tenants, and
    none beside the warning of a secret whose variable is unset here."""
    digest = hashlib.sha256(ALICE.encode()).hexdigest()
    keys = f"keys: [{{name: alice, sha256: {digest}}}]"
    base = "backends: {m: {url: 'http://m'}}\n"

    def warned(tenants: str) -> list[str]:
        loaded = parse_sources([("p.yaml", base + tenants)], lenient_env=True)
        return [str(w) for w in loaded.warnings]

    [open_ids] = warned(f"tenants: {{{keys}}}\n")
    assert "tenants.response_id_secret" in open_ids and "is not set" in open_ids
    assert warned(f"tenants: {{{keys}, response_id_secret: {SECRET}}}\n") == []
    assert warned("tenants: {required: false}\n") == []
    [unset] = warned(f"tenants: {{{keys}, response_id_secret: '${{UNSET_HERE_XYZ}}'}}\n")
    assert "UNSET_HERE_XYZ" in unset


async def test_the_secret_is_never_shown(bound):
    _, gw = bound
    async with httpx.AsyncClient() as client:
        shown = await client.get(gw.admin_url + "/policy")
    assert shown.status_code == 200 and SECRET not in shown.text
    assert "response_id_secret" in shown.text


@pytest.mark.parametrize("bound", [True, False])
async def test_a_tenant_held_to_some_models_reads_its_own_responses_once_ids_are_bound(
    serve_app, start_gateway, tmp_path, bound
):
    """A tenant with ``models`` is refused every path that names no model (a 403); a stored
    response of its own is one it may read once ids are bound to it, since it made it under
    the model check."""
    store = Store()
    url = await serve_app(store.app())
    gw = await start_gateway(policy=write_policy(tmp_path, held_policy(url, bound=bound)))
    async with sdk(gw, ALICE) as alice:
        made = (await alice.responses.create(model="m", input="hi")).id
        with pytest.raises(openai.NotFoundError):
            await alice.responses.create(model="other", input="hi")
        if bound:
            assert (await alice.responses.retrieve(made)).id == made
            await alice.responses.delete(made)
        else:
            with pytest.raises(openai.PermissionDeniedError):
                await alice.responses.retrieve(made)


async def test_no_spelling_of_the_path_reaches_another_tenants_response(bound):
    """Encoded, with a trailing slash or a dot segment, the path still names the id, and
    the id is still checked; ``/v1/responses/input_tokens`` is no id and passes."""
    store, gw = bound
    async with sdk(gw, ALICE) as alice:
        made = (await alice.responses.create(model="m", input="hi")).id
    raw = made.partition("~")[0]
    asked = len(store.asked)
    bob = {"Authorization": f"Bearer {BOB}"}
    async with httpx.AsyncClient() as client:
        for path in (
            raw.replace("_", "%5F"),
            raw + "/",
            raw + "/cancel/",
            "x/../" + raw,
            made.replace("~", "%7E"),
            raw + "%2Fcancel",
        ):
            reply = await client.get(gw.url + "/v1/responses/" + path, headers=bob)
            assert reply.status_code in (400, 404), (path, reply.status_code)
        assert len(store.asked) == asked
        counted = await client.post(
            gw.url + "/v1/responses/input_tokens", json={"model": "m", "input": "hi"}, headers=bob
        )
    assert counted.json()["input_tokens"] == 3  # no id: passed through untouched
    assert store.asked[-1][1] == "/v1/responses/input_tokens"


async def test_a_stored_response_is_asked_of_the_endpoint_that_holds_it(
    serve_app, start_gateway, tmp_path
):
    """Two instances of one backend, each storing what it made (and naming it alike, as two
    counters would): every read, continuation and deletion of a response reaches the
    instance that made it, though the backend's balancing takes each in turn."""
    stores = [Store("a: "), Store("b: ")]
    urls = [await serve_app(store.app()) for store in stores]
    text = round_robin(urls)
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    async with sdk(gw, ALICE) as alice:
        made = [await alice.responses.create(model="m", input=f"q{i}") for i in range(4)]
        assert len({m.id for m in made}) == 4  # resp_0001 twice, on two instances
        assert all(len(s.responses) == 2 for s in stores)
        for first in made:
            assert (await alice.responses.retrieve(first.id)).output_text == first.output_text
            follow = await alice.responses.create(
                model="m", input="more", previous_response_id=first.id
            )
            assert follow.previous_response_id == first.id
            assert (await alice.responses.retrieve(follow.id)).id == follow.id
            await alice.responses.delete(first.id)
        streamed = await alice.responses.create(
            model="m", input="x", previous_response_id=follow.id, stream=True
        )
        async for _ in streamed:  # the continuation streamed from the follow-up's instance
            pass
    assert sum(len(s.responses) for s in stores) == 5  # the four follow-ups and the last
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert metric(text, "gateway_endpoint_pins_total", backend="main", outcome="kept") == 17


async def test_gateway_sims_stored_responses_are_continued_on_their_own_instance(
    start_gateway, tmp_path
):
    """``gateway sim`` stores responses as vLLM does, each instance its own: behind one
    backend of two sims, a conversation continues turn after turn on the instance that
    holds it (its input grows by the turns before), and a deleted response is gone."""
    sims = [await start_sim(SimConfig(port=0, base_ms=0, token_ms=0)) for _ in range(2)]
    try:
        text = round_robin([s.url for s in sims])
        gw = await start_gateway(policy=write_policy(tmp_path, text))
        async with sdk(gw, ALICE) as alice:
            turn = await alice.responses.create(model="m", input="hello")
            for _ in range(4):
                assert turn.usage is not None
                before = turn.usage.total_tokens
                turn = await alice.responses.create(
                    model="m", input="and then?", previous_response_id=turn.id
                )
                assert turn.usage is not None and turn.usage.input_tokens > before
            assert (await alice.responses.retrieve(turn.id)).id == turn.id
            await alice.responses.delete(turn.id)
            with pytest.raises(openai.NotFoundError):
                await alice.responses.retrieve(turn.id)
            unstored = await alice.responses.create(model="m", input="x", store=False)
            with pytest.raises(openai.NotFoundError):
                await alice.responses.retrieve(unstored.id)
    finally:
        for s in sims:
            await s.close()


async def test_a_pinned_request_is_never_sent_to_a_fallback_backend(
    serve_app, start_gateway, tmp_path
):
    """Only the instance that made a response holds it: when it fails, the client gets its
    failure, not a fallback backend's "not found"."""
    home, spare = Store(), Store()
    urls = [await serve_app(home.app()), await serve_app(spare.app())]
    text = (
        f"backends: {{main: {{url: '{urls[0]}'}}, spare: {{url: '{urls[1]}'}}}}\n"
        f"routes: [{{backend: main, fallback: [spare]}}]\n"
        f"tenants: {{response_id_secret: {SECRET}}}\n"
    )
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    async with sdk(gw, ALICE) as alice:
        made = await alice.responses.create(model="m", input="hi")
        home.down = True
        with pytest.raises(openai.InternalServerError) as failed:
            await alice.responses.retrieve(made.id)
    assert failed.value.status_code == 503
    assert spare.asked == []
