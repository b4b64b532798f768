"""OpenAI's stored chat completions (``store: true``) bound to the tenant that made them
and the instance that keeps them (``tenants.response_id_secret``), as stored responses are:
the id of a completion stored for its request reaches its maker tagged, whole or in every
chunk of a stream; ``/v1/chat/completions/<id>`` (read, update, delete) and its
``/messages`` must carry the caller's own id; the listing of every stored completion is not
passed on.  A completion not stored keeps its id as the server wrote it, and a stored one is
never answered from the cache, which would leave it unstored.  The official ``openai`` SDK
as the client, a server on a real socket that stores completions as OpenAI does."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from tests.helpers import metric, write_policy
from tests.test_response_ids import ALICE, BOB, policy, round_robin, sdk

HI: Any = [{"role": "user", "content": "hi"}]


class Completions:
    """Answers chat, storing each completion asked to be stored, and serves them back."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.stored: dict[str, dict[str, Any]] = {}
        self.made = 0
        self.asked: list[tuple[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.create)
        app.router.add_get("/v1/chat/completions", self.listing)
        for method in ("GET", "POST", "DELETE"):
            app.router.add_route(method, "/v1/chat/completions/{cid}", self.one)
        app.router.add_get("/v1/chat/completions/{cid}/messages", self.messages)
        return app

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append(("POST", request.path))
        self.made += 1
        cid = f"chatcmpl-{self.made:04d}"
        message = {"role": "assistant", "content": f"{self.name}answer {self.made}"}
        made = {
            "id": cid,
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "metadata": body.get("metadata"),
        }
        if body.get("store"):
            self.stored[cid] = {**made, "request": body["messages"]}
        if not body.get("stream"):
            return web.json_response(made)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for delta, end in (({"role": "assistant"}, None), (message, None), ({}, "stop")):
            chunk = {"id": cid, "object": "chat.completion.chunk", "created": 1}
            chunk.update(model=body["model"])
            chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": end}]
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def listing(self, request: web.Request) -> web.Response:
        self.asked.append(("GET", request.path))
        data = list(self.stored.values())
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def one(self, request: web.Request) -> web.Response:
        cid = request.match_info["cid"]
        self.asked.append((request.method, request.path))
        if cid not in self.stored:
            return _missing(cid)
        if request.method == "DELETE":
            del self.stored[cid]
            return web.json_response(
                {"id": cid, "object": "chat.completion.deleted", "deleted": True}
            )
        if request.method == "POST":
            self.stored[cid]["metadata"] = (await request.json())["metadata"]
        return web.json_response({k: v for k, v in self.stored[cid].items() if k != "request"})

    async def messages(self, request: web.Request) -> web.Response:
        cid = request.match_info["cid"]
        self.asked.append(("GET", request.path))
        if cid not in self.stored:
            return _missing(cid)
        said = [{**m, "id": f"{cid}-{at}"} for at, m in enumerate(self.stored[cid]["request"])]
        after = (
            [m["id"] for m in said].index(request.query["after"])
            if "after" in request.query
            else -1
        )
        return web.json_response({"object": "list", "data": said[after + 1 :], "has_more": False})


def _missing(cid: str) -> web.Response:
    error = {"message": f"Chat completion {cid} not found.", "type": "invalid_request_error"}
    return web.json_response({"error": {**error, "param": None, "code": None}}, status=404)


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    server = Completions()
    url = await serve_app(server.app())
    return server, await start_gateway(policy=write_policy(tmp_path, policy(url)))


async def test_a_tenant_reads_updates_and_deletes_its_stored_completions(served):
    server, gw = served
    async with sdk(gw, ALICE) as alice:
        made = await alice.chat.completions.create(model="m", messages=HI, store=True)
        assert made.id.startswith("chatcmpl-0001~") and made.id.count("~") == 2
        assert (await alice.chat.completions.retrieve(made.id)).id == made.id
        updated = await alice.chat.completions.update(made.id, metadata={"topic": "t"})
        assert updated.id == made.id and updated.metadata == {"topic": "t"}
        said = await alice.chat.completions.messages.list(made.id)
        assert [m.content for m in said.data] == ["hi"]
        assert said.data[0].id.count("~") == 2  # the messages' ids tagged, as items are
        after = await alice.chat.completions.messages.list(made.id, after=said.data[0].id)
        assert after.data == []
        stream = await alice.chat.completions.create(
            model="m", messages=HI, store=True, stream=True
        )
        ids = {chunk.id async for chunk in stream}
        assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-0002~")
        deleted = await alice.chat.completions.delete(made.id)
        assert deleted.id == made.id and deleted.deleted
        plain = await alice.chat.completions.create(model="m", messages=HI)
        assert plain.id == "chatcmpl-0003"  # not stored: as the server wrote it
    raw = "/v1/chat/completions/chatcmpl-0001"
    read = [("GET", raw), ("POST", raw), ("GET", raw + "/messages"), ("GET", raw + "/messages")]
    assert server.asked[1:7] == [*read, ("POST", "/v1/chat/completions"), ("DELETE", raw)]


async def test_another_tenant_is_refused_every_stored_completion_and_the_listing(served):
    server, gw = served
    async with sdk(gw, ALICE) as alice:
        made = (await alice.chat.completions.create(model="m", messages=HI, store=True)).id
    asked = len(server.asked)
    raw = made.partition("~")[0]
    forged = raw + "~" + "0" * 24
    async with sdk(gw, BOB) as bob:
        for cid in (made, raw, forged):
            with pytest.raises(openai.NotFoundError) as refused:
                await bob.chat.completions.retrieve(cid)
            assert refused.value.code == "chat_completion_not_found"
            with pytest.raises(openai.NotFoundError):
                await bob.chat.completions.update(cid, metadata={"a": "b"})
            with pytest.raises(openai.NotFoundError):
                await bob.chat.completions.delete(cid)
            with pytest.raises(openai.NotFoundError):
                await bob.chat.completions.messages.list(cid)
        with pytest.raises(openai.NotFoundError) as listed:
            await bob.chat.completions.list()
        assert listed.value.code == "not_found"
    assert len(server.asked) == asked
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert metric(text, "gateway_response_ids_refused_total", tenant="", where="path") == 12


async def test_a_stored_completion_is_never_answered_from_the_cache(
    serve_app, start_gateway, tmp_path
):
    """At temperature 0 on a caching route, a completion asked to be stored reaches the
    server every time (a hit would leave it unstored); one not stored is a hit."""
    server = Completions()
    url = await serve_app(server.app())
    text = policy(url).replace("routes: [{backend: main}]", "routes: [{backend: main, cache: {}}]")
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    async with sdk(gw, ALICE) as alice:
        for _ in range(2):
            await alice.chat.completions.create(model="m", messages=HI, temperature=0, store=True)
            await alice.chat.completions.create(model="m", messages=HI, temperature=0)
    assert len(server.stored) == 2 and server.made == 3


async def test_a_stored_completion_is_asked_of_the_instance_that_keeps_it(
    serve_app, start_gateway, tmp_path
):
    servers = [Completions("a: "), Completions("b: ")]
    urls = [await serve_app(server.app()) for server in servers]
    gw = await start_gateway(policy=write_policy(tmp_path, round_robin(urls)))
    async with sdk(gw, ALICE) as alice:
        made = [await alice.chat.completions.create(model="m", messages=HI, store=True)]
        made.append(await alice.chat.completions.create(model="m", messages=HI, store=True))
        assert made[0].id.partition("~")[0] == made[1].id.partition("~")[0]
        for each in made:
            for _ in range(3):  # round robin alone would send one of three elsewhere
                again = await alice.chat.completions.retrieve(each.id)
                assert again.choices[0].message.content == each.choices[0].message.content
