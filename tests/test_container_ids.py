"""Code interpreter containers bound to the tenant that made them and the instance that
keeps them (``tenants.response_id_secret``), as files are: a container made by a POST, or
by a response whose code interpreter asked for one, reaches its maker tagged; every path
below ``/v1/containers/<id>``, a code interpreter's ``container`` and every
``container_id`` in a body must carry the caller's own.  The official ``openai`` SDK as the
client, a server on a real socket that keeps containers as OpenAI does."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from aiohttp import web

from tests.helpers import metric, write_policy
from tests.test_file_ids import Files, _missing, sse
from tests.test_response_ids import ALICE, BOB, policy, round_robin, sdk


class Containers(Files):
    """Files, and containers of files; a response whose code interpreter names a container
    (or asks for one: ``{"type": "auto"}``) runs in it, and cites a file it wrote there."""

    def __init__(self, name: str = "") -> None:
        super().__init__(name)
        self.containers: dict[str, dict[str, Any]] = {}
        self.container_files: dict[str, dict[str, bytes]] = {}

    def app(self) -> web.Application:
        app = super().app()
        app.router.add_route("*", "/v1/containers", self.container_collection)
        app.router.add_route("*", "/v1/containers/{cid}", self.container)
        app.router.add_route("*", "/v1/containers/{cid}/files", self.files_of)
        app.router.add_get("/v1/containers/{cid}/files/{cf}/content", self.file_content)
        app.router.add_post("/v1/messages", self.message)
        return app

    def _make(self, name: str, fids: list[str]) -> dict[str, Any]:
        cid = self._id("cntr_")
        made = {"id": cid, "object": "container", "created_at": 1, "status": "running"}
        self.containers[cid] = {**made, "name": f"{self.name}{name}"}
        self.container_files[cid] = {f"/mnt/data/{fid}": self.contents[fid] for fid in fids}
        return self.containers[cid]

    async def container_collection(self, request: web.Request) -> web.Response:
        self.asked.append((request.method, request.path))
        if request.method == "GET":
            listed = list(self.containers.values())
            return web.json_response({"object": "list", "data": listed})
        body = await request.json()
        refused = self._named(body.get("file_ids", []))
        return refused or web.json_response(self._make(body["name"], body.get("file_ids", [])))

    async def container(self, request: web.Request) -> web.Response:
        missing = "Container with id '{}' not found."
        return self.one(request, self.containers, "cid", "container.deleted", missing)

    def _file(self, cid: str, path: str) -> dict[str, Any]:
        made = {"id": f"cfile_{path.rsplit('/', 1)[-1]}", "object": "container.file"}
        size = len(self.container_files[cid][path])
        return {**made, "container_id": cid, "path": path, "bytes": size, "source": "user"}

    async def files_of(self, request: web.Request) -> web.Response:
        cid = request.match_info["cid"]
        self.asked.append((request.method, request.path))
        if cid not in self.containers:
            return _missing(f"Container with id '{cid}' not found.")
        if request.method == "GET":
            data = [self._file(cid, path) for path in self.container_files[cid]]
            return web.json_response({"object": "list", "data": data, "has_more": False})
        if request.content_type == "multipart/form-data":  # a file uploaded into it
            upload: Any = (await request.post())["file"]
            path = f"/mnt/data/{upload.filename}"
            self.container_files[cid][path] = upload.file.read()
            return web.json_response(self._file(cid, path))
        fid = (await request.json())["file_id"]
        refused = self._named([fid])
        if refused is not None:
            return refused
        self.container_files[cid][f"/mnt/data/{fid}"] = self.contents[fid]
        return web.json_response(self._file(cid, f"/mnt/data/{fid}"))

    async def file_content(self, request: web.Request) -> web.Response:
        cid, cf = request.match_info["cid"], request.match_info["cf"]
        self.asked.append((request.method, request.path))
        path = f"/mnt/data/{cf.removeprefix('cfile_')}"
        if path not in self.container_files.get(cid, {}):
            return _missing(f"Container file with id '{cf}' not found.")
        return web.Response(body=self.container_files[cid][path], content_type="text/csv")

    async def respond(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append((request.method, request.path))
        tools = [t for t in body.get("tools", []) if t.get("type") == "code_interpreter"]
        given = [i.get("container_id") for i in body["input"] if isinstance(i, dict)]
        if not tools:
            return await super().respond(request)
        container = tools[0]["container"]
        if isinstance(container, dict):  # {"type": "auto"}: one made for the response
            container = self._make("auto", container.get("file_ids", []))["id"]
        for cid in [container, *filter(None, given)]:
            if cid not in self.containers:
                return _missing(f"Container with id '{cid}' not found.")
        self.container_files[container]["/mnt/data/plot.csv"] = b"x,y\n1,2\n"
        cited = {"type": "container_file_citation", "container_id": container}
        cited |= {"file_id": "cfile_plot.csv", "filename": "plot.csv"}
        said = {"type": "output_text", "text": f"{self.name}ran", "annotations": [cited]}
        output = [
            {"id": self._id("ci_"), "type": "code_interpreter_call", "container_id": container}
            | {"code": "print(1)", "status": "completed", "outputs": []},
            {"id": self._id("msg_"), "type": "message", "role": "assistant", "content": [said]},
        ]
        made: dict[str, Any] = {"id": self._id("resp_"), "object": "response", "created_at": 1}
        made |= {"model": body["model"], "status": "completed", "output": output}
        self.responses[made["id"]] = made
        if not body.get("stream"):
            return web.json_response(made)
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": {**made, "output": []}},
            {"type": "response.output_item.added", "output_index": 0, "item": output[0]},
            {"type": "response.output_item.added", "output_index": 1, "item": output[1]},
            {"type": "response.completed", "response": made},
        ]
        return await sse(request, events)

    async def message(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: with its code execution tool, the code runs in the
        container the body names (an id, or ``{"id": ...}``), or in one made for it."""
        body = await request.json()
        self.asked.append((request.method, request.path))
        tools = body.get("tools", [])
        runs = any(str(t.get("type", "")).startswith("code_execution") for t in tools)
        container = body.get("container")
        cid = container.get("id") if isinstance(container, dict) else container
        if cid is not None and cid not in self.containers:
            error = {"type": "not_found_error", "message": f"container {cid} not found"}
            return web.json_response({"type": "error", "error": error}, status=404)
        if runs and cid is None:
            cid = self._make("anthropic", [])["id"]
        ran = {"id": cid, "expires_at": "2026-12-04T00:00:00Z"} if cid else None
        said = {"type": "text", "text": f"{self.name}ran"}
        blocks: list[dict[str, Any]] = [said]
        if runs:  # its code wrote a file, kept in the Files API
            written = self._keep("plot.png", b"png", "user_data")["id"]
            output = {"type": "bash_code_execution_output", "file_id": written}
            result: dict[str, Any] = {
                "type": "bash_code_execution_result",
                "stdout": "",
                "stderr": "",
            }
            result |= {"return_code": 0, "content": [output]}
            blocks.append(
                {"type": "bash_code_execution_tool_result", "tool_use_id": "srvtoolu_1"}
                | {"content": result}
            )
        made: dict[str, Any] = {"id": self._id("msg_"), "type": "message", "role": "assistant"}
        made |= {"model": body["model"], "content": blocks, "stop_reason": "end_turn"}
        made |= {"stop_sequence": None, "usage": {"input_tokens": 1, "output_tokens": 1}}
        if not body.get("stream"):
            return web.json_response({**made, "container": ran})
        begun = {**made, "content": [], "stop_reason": None, "container": None}
        done = {"stop_reason": "end_turn", "stop_sequence": None, "container": ran}
        events: list[dict[str, Any]] = [
            {"type": "message_start", "message": begun},
            {"type": "content_block_start", "index": 0, "content_block": {**said, "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta"}}
            | {"delta": {"type": "text_delta", "text": said["text"]}},
            {"type": "content_block_stop", "index": 0},
            *(
                {"type": "content_block_start", "index": 1, "content_block": block}
                for block in blocks[1:]
            ),
            {"type": "message_delta", "delta": done, "usage": {"output_tokens": 1}},
            {"type": "message_stop"},
        ]
        return await sse(request, events)


@pytest.fixture
async def kept(serve_app, start_gateway, tmp_path):
    server = Containers()
    url = await serve_app(server.app())
    return server, await start_gateway(policy=write_policy(tmp_path, policy(url)))


def _interpreter(container: Any) -> list[Any]:
    return [{"type": "code_interpreter", "container": container}]


def _given_back(container: str) -> Any:
    """A code interpreter's call given back as input (its container named)."""
    return [{"type": "code_interpreter_call", "container_id": container}]


def _container(item: Any) -> str:
    """The container an output item names."""
    return str(item.model_dump()["container_id"])


async def test_a_tenant_makes_and_uses_its_own_containers(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        fid = (await alice.files.create(file=("data.csv", b"a,b\n"), purpose="user_data")).id
        made = await alice.containers.create(name="work", file_ids=[fid])
        cid = made.id
        assert cid.startswith("cntr_") and "~" in cid
        assert (await alice.containers.retrieve(cid)).id == cid
        copied = await alice.containers.files.create(cid, file_id=fid)
        assert copied.container_id == cid  # the container's own, tagged for its owner
        uploaded = await alice.containers.files.create(cid, file=("up.txt", b"up"))
        listed = await alice.containers.files.list(cid)
        assert {f.id for f in listed.data} >= {copied.id, uploaded.id}
        assert {f.container_id for f in listed.data} == {cid}
        ran = await alice.responses.create(model="m", input="plot", tools=_interpreter(cid))
        call = ran.output[0]
        assert call.type == "code_interpreter_call" and call.container_id == cid
        cited = ran.output[1].model_dump()["content"][0]["annotations"][0]
        assert cited["container_id"] == cid
        # a container made for a response (auto) is its maker's, tagged wherever it stands
        auto = await alice.responses.create(
            model="m", input="plot", tools=_interpreter({"type": "auto", "file_ids": [fid]})
        )
        made_for_it = _container(auto.output[0])
        assert "~" in made_for_it and made_for_it != cid
        assert (await alice.containers.retrieve(made_for_it)).name == "auto"
        read_again = await alice.responses.retrieve(auto.id)
        assert _container(read_again.output[0]) == made_for_it
        streamed = await alice.responses.create(
            model="m", input="plot", tools=_interpreter(made_for_it), stream=True
        )
        seen = [event async for event in streamed]
        added = [e.item for e in seen if e.type == "response.output_item.added"]
        assert _container(added[0]) == made_for_it
        # the call given back as input: its container untagged for the server
        again = await alice.responses.create(
            model="m",
            input=_given_back(made_for_it),
            tools=_interpreter(cid),
        )
        assert _container(again.output[0]) == cid
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {ALICE}"}) as client:
        content = await client.get(f"{gw.url}/v1/containers/{cid}/files/cfile_plot.csv/content")
        assert content.status_code == 200 and content.content == b"x,y\n1,2\n"
        assert content.headers["content-type"] == "text/csv"  # passed as the server wrote it
    raw = cid.partition("~")[0]
    assert server.containers.keys() == {raw, made_for_it.partition("~")[0]}  # raw upstream
    async with sdk(gw, ALICE) as alice:
        await alice.containers.delete(cid)
    assert raw not in server.containers


async def test_another_tenant_is_refused_every_container(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        cid = (await alice.containers.create(name="work")).id
        auto = await alice.responses.create(
            model="m", input="plot", tools=_interpreter({"type": "auto"})
        )
        made_for_it = _container(auto.output[0])
    asked = len(server.asked)
    async with sdk(gw, BOB) as bob:
        for owned in (cid, made_for_it):
            for spelled in (
                owned,
                owned.partition("~")[0],
                owned.rpartition("~")[0] + "~" + "0" * 24,
            ):
                calls: list[Any] = [
                    bob.containers.retrieve(spelled),
                    bob.containers.delete(spelled),
                    bob.containers.files.list(spelled),
                    bob.containers.files.create(spelled, file=("x.txt", b"x")),
                    bob.responses.create(model="m", input="x", tools=_interpreter(spelled)),
                    bob.responses.create(
                        model="m",
                        input=_given_back(spelled),
                    ),
                ]
                for call in calls:
                    with pytest.raises(openai.NotFoundError) as refused:
                        await call
                    assert refused.value.code == "container_not_found"
        with pytest.raises(openai.NotFoundError) as refused:
            await bob.containers.list()
        assert refused.value.code == "not_found"
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {BOB}"}) as client:
        raw = cid.partition("~")[0]
        content = await client.get(f"{gw.url}/v1/containers/{raw}/files/cfile_plot.csv/content")
        assert content.status_code == 404
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert len(server.asked) == asked  # the server never asked
    counter = "gateway_response_ids_refused_total"
    assert metric(text, counter, tenant="", where="container") == 2 * 3 * 2
    assert metric(text, counter, tenant="", where="path") == 2 * 3 * 4 + 1


async def test_another_tools_container_and_another_apis_pass_as_they_are(kept):
    """Only a code interpreter's ``container`` (and an Anthropic Messages body's own, below)
    is one of these: any other tool's field of that name, and a Responses body's own, are
    the client's."""
    _, gw = kept
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with httpx.AsyncClient(headers=headers) as client:
        function = {"type": "function", "name": "f", "container": "mine", "parameters": {}}
        body = {"model": "m", "input": [], "tools": [function], "container": "container_011"}
        got = await client.post(gw.url + "/v1/responses", json=body)
        assert got.status_code == 200, got.text


async def test_containers_are_pinned_to_the_instance_that_keeps_them(
    serve_app, start_gateway, tmp_path
):
    servers = [Containers("a:"), Containers("b:")]
    urls = [await serve_app(s.app()) for s in servers]
    gw = await start_gateway(policy=write_policy(tmp_path, round_robin(urls)))
    async with sdk(gw, ALICE) as alice:
        made = [(await alice.containers.create(name="c")).id for _ in range(4)]
        auto = await alice.responses.create(
            model="m", input="plot", tools=_interpreter({"type": "auto"})
        )
        made.append(_container(auto.output[0]))
        for cid in made * 2:
            container = await alice.containers.retrieve(cid)
            ran = await alice.responses.create(model="m", input="x", tools=_interpreter(cid))
            keeper = container.name.partition(":")[0]
            assert ran.output_text == f"{keeper}:ran"


CODE_EXECUTION = [{"type": "code_execution_20250825", "name": "code_execution"}]


async def test_an_anthropic_messages_container_is_its_makers(kept):
    """Anthropic's code execution runs in a container the answer names (made for the
    request unless one was named): tagged for its maker, whole and streamed; another tenant
    naming it (an id, or ``{"id": ...}``) is refused."""
    server, gw = kept
    ask: dict[str, Any] = {"model": "claude", "max_tokens": 8, "tools": CODE_EXECUTION}
    ask["messages"] = [{"role": "user", "content": "plot"}]
    async with anthropic.AsyncAnthropic(base_url=gw.url, api_key=ALICE, max_retries=0) as alice:
        first = await alice.messages.create(**ask)
        assert first.container is not None
        cid = first.container.id
        assert "~" in cid and cid.partition("~")[0] in server.containers
        again = await alice.messages.create(**ask, container=cid)
        assert again.container is not None and again.container.id == cid
        ran = again.model_dump()["content"][1]["content"]["content"][0]
        assert "~" in ran["file_id"]  # the file its code wrote: the maker's, tagged
    async with sdk(gw, ALICE) as files:
        assert (await files.files.content(ran["file_id"])).content == b"png"
    headers = {"Authorization": f"Bearer {ALICE}", "anthropic-version": "2023-06-01"}  # as the SDK
    async with httpx.AsyncClient(headers=headers) as client:
        streamed = await client.post(
            gw.url + "/v1/messages", json={**ask, "container": {"id": cid}, "stream": True}
        )
        assert streamed.status_code == 200, streamed.text
        assert json.dumps(cid) in streamed.text  # in message_delta, tagged
        assert json.dumps(cid.partition("~")[0]) not in streamed.text
        written = [line for line in streamed.text.splitlines() if '"file_id"' in line]
        assert len(written) == 1 and '"file_id": "file-' in written[0]
        file_id = json.loads(written[0][5:])["content_block"]["content"]["content"][0]["file_id"]
        assert "~" in file_id  # in its content_block_start, tagged
        asked = len(server.asked)
        bob = {**headers, "Authorization": f"Bearer {BOB}"}
        for spelled in (cid, cid.partition("~")[0]):
            for container in (spelled, {"id": spelled}):
                refused = await client.post(
                    gw.url + "/v1/messages", json={**ask, "container": container}, headers=bob
                )
                assert refused.status_code == 404, refused.text
                assert "container" in refused.text
        assert len(server.asked) == asked  # never the server's to resolve
        plain = await client.post(gw.url + "/v1/messages", json={**ask, "tools": []})
        assert plain.json()["container"] is None  # no code run: nothing read or made
