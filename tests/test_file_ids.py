"""Files, batches and uploads bound to the tenant that made them and the instance that keeps
them (``tenants.response_id_secret``), as stored responses are: each id reaches its maker
tagged, a path naming one must carry the caller's own, and so must every ``file_id`` in a
body (a chat message's file, a response's ``input_file``, a batch's input), however deep
and however its key is spelled.  The official ``openai`` SDK as the client, a server on a
real socket that keeps files, batches and uploads as OpenAI does."""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from gateway.sim import SimConfig, start_sim
from tests.helpers import metric, write_policy
from tests.test_response_ids import ALICE, BOB, held_policy, policy, round_robin, sdk

JSONL = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


class Files:
    """Keeps files, runs each batch at once (its output a new file), assembles uploads; a
    chat or response naming a file reads it, and says which it read."""

    def __init__(self, name: str = "") -> None:
        self.name = name
        self.files: dict[str, dict[str, Any]] = {}
        self.contents: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        self.uploads: dict[str, dict[str, Any]] = {}
        self.stores: dict[str, list[str]] = {}  # each vector store's files
        self.made = 0
        self.asked: list[tuple[str, str]] = []
        self.read: list[str] = []  # the file ids a chat or a response named
        self.responses: dict[str, dict[str, Any]] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/v1/files", self.file_collection)
        app.router.add_route("*", "/v1/files/{fid}", self.file)
        app.router.add_get("/v1/files/{fid}/content", self.content)
        app.router.add_route("*", "/v1/batches", self.batch_collection)
        app.router.add_get("/v1/batches/{bid}", self.batch)
        app.router.add_post("/v1/batches/{bid}/cancel", self.batch)
        app.router.add_post("/v1/uploads", self.upload)
        app.router.add_post("/v1/uploads/{uid}/parts", self.part)
        app.router.add_post("/v1/uploads/{uid}/complete", self.complete)
        app.router.add_route("*", "/v1/vector_stores", self.store_collection)
        app.router.add_route("*", "/v1/vector_stores/{vs}", self.store)
        app.router.add_route("*", "/v1/vector_stores/{vs}/files", self.store_files)
        app.router.add_route("*", "/v1/vector_stores/{vs}/files/{fid}", self.store_files)
        app.router.add_post("/v1/vector_stores/{vs}/search", self.search)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/responses", self.respond)
        app.router.add_get("/v1/responses/{rid}", self.response)
        return app

    def _id(self, prefix: str) -> str:
        self.made += 1
        return f"{prefix}{self.made:04d}"

    def _keep(self, name: str, content: bytes, purpose: str) -> dict[str, Any]:
        fid = self._id("file-")
        self.contents[fid] = content
        self.files[fid] = {
            "id": fid,
            "object": "file",
            "bytes": len(content),
            "created_at": 1,
            "filename": f"{self.name}{name}",
            "purpose": purpose,
            "status": "processed",
        }
        return self.files[fid]

    async def file_collection(self, request: web.Request) -> web.Response:
        self.asked.append((request.method, request.path))
        if request.method == "GET":
            return web.json_response({"object": "list", "data": list(self.files.values())})
        form = await request.post()
        upload: Any = form["file"]
        return web.json_response(
            self._keep(upload.filename, upload.file.read(), str(form["purpose"]))
        )

    async def file(self, request: web.Request) -> web.Response:
        return self.one(request, self.files, "fid", "file", "No such File object: {}")

    def one(
        self, request: web.Request, kept: dict[str, Any], name: str, deleted: str, missing: str
    ) -> web.Response:
        """One of ``kept``, named in the path by ``name``: read, or deleted."""
        oid = request.match_info[name]
        self.asked.append((request.method, request.path))
        if oid not in kept:
            return _missing(missing.format(oid))
        if request.method == "DELETE":
            del kept[oid]
            return web.json_response({"id": oid, "object": deleted, "deleted": True})
        return web.json_response(kept[oid])

    async def content(self, request: web.Request) -> web.Response:
        fid = request.match_info["fid"]
        self.asked.append((request.method, request.path))
        if fid not in self.files:
            return _missing(f"No such File object: {fid}")
        return web.Response(body=self.contents[fid], content_type="application/octet-stream")

    async def batch_collection(self, request: web.Request) -> web.Response:
        self.asked.append((request.method, request.path))
        if request.method == "GET":
            return web.json_response({"object": "list", "data": list(self.batches.values())})
        try:
            body = await request.json()  # whatever the body's type, as aiohttp reads it
        except ValueError:
            error = {"message": "not JSON", "type": "invalid_request_error", "code": None}
            return web.json_response({"error": error}, status=400)
        source = body["input_file_id"]
        if source not in self.files:
            return _missing(f"No such File object: {source}")
        output = self._keep("output.jsonl", b'{"id": "batch_req_1", "custom_id": "a"}\n', "batch")
        bid = self._id("batch_")
        self.batches[bid] = {
            "id": bid,
            "object": "batch",
            "endpoint": body["endpoint"],
            "input_file_id": source,
            "output_file_id": output["id"],
            "error_file_id": None,
            "completion_window": body["completion_window"],
            "status": "completed",
            "created_at": 1,
        }
        return web.json_response(self.batches[bid])

    async def batch(self, request: web.Request) -> web.Response:
        bid = request.match_info["bid"]
        self.asked.append((request.method, request.path))
        if bid not in self.batches:
            return _missing(f"No such Batch object: {bid}")
        if request.method == "POST":
            self.batches[bid]["status"] = "cancelling"
        return web.json_response(self.batches[bid])

    async def upload(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append((request.method, request.path))
        uid = self._id("upload_")
        self.uploads[uid] = {
            "id": uid,
            "object": "upload",
            "bytes": body["bytes"],
            "created_at": 1,
            "expires_at": 2,
            "filename": body["filename"],
            "purpose": body["purpose"],
            "status": "pending",
            "parts": {},
        }
        return web.json_response({k: v for k, v in self.uploads[uid].items() if k != "parts"})

    async def part(self, request: web.Request) -> web.Response:
        uid = request.match_info["uid"]
        self.asked.append((request.method, request.path))
        if uid not in self.uploads:
            return _missing(f"No such Upload object: {uid}")
        data: Any = (await request.post())["data"]
        pid = self._id("part_")
        self.uploads[uid]["parts"][pid] = data.file.read()
        return web.json_response(
            {"id": pid, "object": "upload.part", "upload_id": uid, "created_at": 1}
        )

    async def complete(self, request: web.Request) -> web.Response:
        uid = request.match_info["uid"]
        self.asked.append((request.method, request.path))
        if uid not in self.uploads:
            return _missing(f"No such Upload object: {uid}")
        upload = self.uploads[uid]
        content = b"".join(upload["parts"][pid] for pid in (await request.json())["part_ids"])
        made = self._keep(upload["filename"], content, upload["purpose"])
        shown = {k: v for k, v in upload.items() if k != "parts"}
        return web.json_response({**shown, "status": "completed", "file": made})

    async def store_collection(self, request: web.Request) -> web.Response:
        self.asked.append((request.method, request.path))
        if request.method == "GET":
            return web.json_response({"object": "list", "data": list(self.stores)})
        fids = (await request.json()).get("file_ids", [])
        refused = self._named(fids)
        if refused is not None:
            return refused
        vs = self._id("vs_")
        self.stores[vs] = list(fids)
        return web.json_response(_store(vs, self.stores[vs]))

    async def store(self, request: web.Request) -> web.Response:
        vs = request.match_info["vs"]
        self.asked.append((request.method, request.path))
        if vs not in self.stores:
            return _missing(f"No such vector store: {vs}")
        if request.method == "DELETE":
            del self.stores[vs]
            return web.json_response({"id": vs, "object": "vector_store.deleted", "deleted": True})
        return web.json_response(_store(vs, self.stores[vs]))

    async def store_files(self, request: web.Request) -> web.Response:
        vs, fid = request.match_info["vs"], request.match_info.get("fid")
        self.asked.append((request.method, request.path_qs))
        if vs not in self.stores:
            return _missing(f"No such vector store: {vs}")
        if request.method == "POST" and fid is None:  # a file added
            fid = (await request.json())["file_id"]
            refused = self._named([fid])
            if refused is not None:
                return refused
            self.stores[vs].append(fid)
        if fid is not None:
            if fid not in self.stores[vs]:
                return _missing(f"No such file in {vs}: {fid}")
            return web.json_response(_store_file(vs, fid))
        listed = self.stores[vs]
        after = request.query.get("after")
        shown = listed[listed.index(after) + 1 :] if after in listed else listed
        data = [_store_file(vs, each) for each in shown]
        return web.json_response({"object": "list", "data": data, "has_more": False})

    async def search(self, request: web.Request) -> web.Response:
        vs = request.match_info["vs"]
        self.asked.append((request.method, request.path))
        if vs not in self.stores:
            return _missing(f"No such vector store: {vs}")
        data = [
            {"file_id": fid, "filename": self.files[fid]["filename"], "score": 0.5, "content": []}
            for fid in self.stores[vs]
        ]
        query = (await request.json())["query"]
        page = {"object": "vector_store.search_results.page", "search_query": [query]}
        return web.json_response({**page, "data": data, "has_more": False, "next_page": None})

    def _named(self, fids: list[str]) -> web.Response | None:
        self.read += fids
        missing = [fid for fid in fids if fid not in self.files]
        return _missing(f"No such File object: {missing[0]}") if missing else None

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append((request.method, request.path))
        parts = [p for m in body["messages"] for p in m["content"] if isinstance(p, dict)]
        fids = [p["file"]["file_id"] for p in parts if p.get("type") == "file"]
        fids += [
            f for t in body.get("tools", []) for f in t.get("container", {}).get("file_ids", [])
        ]
        refused = self._named(fids)
        if refused is not None:
            return refused
        message = {"role": "assistant", "content": f"{self.name}read {' '.join(fids)}"}
        return web.json_response(
            {
                "id": self._id("chatcmpl-"),
                "object": "chat.completion",
                "created": 1,
                "model": body["model"],
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )

    async def respond(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.asked.append((request.method, request.path))
        parts = [p for item in body["input"] for p in item["content"]]
        fids = [p["file_id"] for p in parts if p.get("type") == "input_file"]
        stores = [s for t in body.get("tools", []) for s in t.get("vector_store_ids", [])]
        if any(vs not in self.stores for vs in stores):
            return _missing("No such vector store")
        fids += [fid for vs in stores for fid in self.stores[vs]]  # what a search would read
        refused = self._named(fids)
        if refused is not None:
            return refused
        found = [fid for vs in stores for fid in self.stores[vs]]  # what a search found
        cited = [
            {"type": "file_citation", "file_id": f, "filename": "x", "index": 0} for f in found
        ]
        said = {"type": "output_text", "text": f"read {' '.join(fids)}", "annotations": cited}
        output: list[dict[str, Any]] = [
            {"id": "msg_1", "type": "message", "role": "assistant", "content": [said]}
        ]
        if stores:
            hits = [{"file_id": f, "filename": "x", "score": 1.0, "text": "a"} for f in found]
            search = {"id": "fs_1", "type": "file_search_call", "status": "completed"}
            output.insert(0, {**search, "queries": ["a"], "results": hits})
        made: dict[str, Any] = {"id": self._id("resp_"), "object": "response", "created_at": 1}
        made |= {"model": body["model"], "status": "completed", "output": output}
        made["input"] = body["input"]  # an echo of what it read: the ids tagged again
        self.responses[made["id"]] = made
        if not body.get("stream"):
            return web.json_response(made)
        events: list[dict[str, Any]] = [
            {"type": "response.created", "response": {**made, "output": []}},
            {"type": "response.output_item.added", "output_index": 0, "item": output[0]},
        ]
        events += [
            {"type": "response.output_text.annotation.added", "item_id": "msg_1"}
            | {"output_index": 1, "content_index": 0, "annotation_index": at, "annotation": a}
            for at, a in enumerate(cited)
        ]
        events.append({"type": "response.completed", "response": made})
        return await sse(request, events)

    async def response(self, request: web.Request) -> web.Response:
        rid = request.match_info["rid"]
        if rid not in self.responses:
            return _missing(f"Response with id '{rid}' not found.")
        return web.json_response(self.responses[rid])


async def sse(request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
    """``events`` streamed as the Responses API streams them."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for event in events:
        await response.write(f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode())
    await response.write_eof()
    return response


def _store(vs: str, fids: list[str]) -> dict[str, Any]:
    counts = {"completed": len(fids), "total": len(fids)}
    made = {"id": vs, "object": "vector_store", "created_at": 1, "name": "docs"}
    return {**made, "status": "completed", "file_counts": counts, "usage_bytes": 0}


def _store_file(vs: str, fid: str) -> dict[str, Any]:
    made = {"id": fid, "object": "vector_store.file", "created_at": 1, "vector_store_id": vs}
    return {**made, "status": "completed", "usage_bytes": 1, "last_error": None}


def _missing(message: str) -> web.Response:
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
    return web.json_response({"error": error}, status=404)


def _file_part(fid: str) -> Any:
    return [{"role": "user", "content": [{"type": "file", "file": {"file_id": fid}}]}]


@pytest.fixture
async def kept(serve_app, start_gateway, tmp_path):
    server = Files()
    url = await serve_app(server.app())
    return server, await start_gateway(policy=write_policy(tmp_path, policy(url)))


async def test_a_tenant_uses_its_own_files_batches_and_uploads(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        made = await alice.files.create(file=("in.jsonl", JSONL), purpose="batch")
        assert made.id.startswith("file-0001~") and made.id.count("~") == 2
        assert (await alice.files.retrieve(made.id)).id == made.id
        assert (await alice.files.content(made.id)).content == JSONL
        read = await alice.chat.completions.create(model="m", messages=_file_part(made.id))
        assert read.choices[0].message.content == "read file-0001"  # the server's own id
        batch = await alice.batches.create(
            input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch.id.startswith("batch_0004~") and batch.input_file_id == made.id
        assert batch.output_file_id is not None and batch.output_file_id.startswith("file-0003~")
        again = await alice.batches.retrieve(batch.id)
        assert (again.id, again.output_file_id) == (batch.id, batch.output_file_id)
        assert again.output_file_id is not None
        output = await alice.files.content(again.output_file_id)
        assert output.content == b'{"id": "batch_req_1", "custom_id": "a"}\n'
        assert (await alice.batches.cancel(batch.id)).status == "cancelling"
        upload = await alice.uploads.create(
            bytes=6, filename="big.txt", mime_type="text/plain", purpose="assistants"
        )
        assert upload.id.startswith("upload_0005~")
        part = await alice.uploads.parts.create(upload.id, data=b"abcdef")
        assert part.upload_id == upload.id and part.id == "part_0006"  # parts are not bound
        done = await alice.uploads.complete(upload.id, part_ids=[part.id])
        assert done.id == upload.id and done.file is not None
        assert done.file.id.startswith("file-0007~")
        assert (await alice.files.content(done.file.id)).content == b"abcdef"
        answer = await alice.responses.create(
            model="m",
            input=[{"role": "user", "content": [{"type": "input_file", "file_id": made.id}]}],
        )
        assert answer.output_text == "read file-0001" and answer.id.count("~") == 2
        deleted = await alice.files.delete(made.id)
        assert deleted.id == made.id and deleted.deleted
    assert server.read == ["file-0001", "file-0001"]
    assert ("DELETE", "/v1/files/file-0001") in server.asked


async def test_another_tenant_is_refused_every_file_batch_and_upload_it_did_not_get(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        fid = (await alice.files.create(file=("in.jsonl", JSONL), purpose="batch")).id
        batch = await alice.batches.create(
            input_file_id=fid, endpoint="/v1/chat/completions", completion_window="24h"
        )
        uid = (
            await alice.uploads.create(
                bytes=1, filename="a", mime_type="text/plain", purpose="user_data"
            )
        ).id
    asked = len(server.asked)
    async with sdk(gw, BOB) as bob:
        for spelled in (fid, fid.partition("~")[0], fid.rpartition("~")[0] + "~" + "0" * 24):
            calls: list[Any] = [
                bob.files.retrieve(spelled),
                bob.files.content(spelled),
                bob.files.delete(spelled),
                bob.chat.completions.create(model="m", messages=_file_part(spelled)),
                bob.batches.create(
                    input_file_id=spelled, endpoint="/v1/chat/completions", completion_window="24h"
                ),
            ]
            for call in calls:
                with pytest.raises(openai.NotFoundError) as refused:
                    await call
                assert refused.value.code == "file_not_found"
        for bid in (batch.id, batch.id.partition("~")[0]):
            for call in (bob.batches.retrieve(bid), bob.batches.cancel(bid)):
                with pytest.raises(openai.NotFoundError) as refused:
                    await call
                assert refused.value.code == "batch_not_found"
        # the files of a batch are its owner's: another tenant cannot read the output
        with pytest.raises(openai.NotFoundError):
            await bob.files.content(batch.output_file_id or "")
        uploads: list[Any] = [
            bob.uploads.parts.create(uid, data=b"x"),
            bob.uploads.complete(uid, part_ids=[]),
        ]
        for call in uploads:
            with pytest.raises(openai.NotFoundError) as refused:
                await call
            assert refused.value.code == "upload_not_found"
    assert len(server.asked) == asked  # the server never asked
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    counter = "gateway_response_ids_refused_total"
    assert metric(text, counter, tenant="", where="file") == 3 * 2  # chat and batch bodies
    assert metric(text, counter, tenant="", where="path") == 3 * 3 + 4 + 1 + 2


async def test_the_collections_are_not_listed(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        await alice.files.create(file=("in.jsonl", JSONL), purpose="batch")
        for listing in (alice.files.list(), alice.batches.list()):
            with pytest.raises(openai.NotFoundError) as refused:
                await listing
            assert refused.value.code == "not_found"
    assert [method for method, _ in server.asked] == ["POST"]


async def test_a_file_named_anywhere_in_a_body_however_spelled_is_checked(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        fid = (await alice.files.create(file=("a.txt", b"a"), purpose="user_data")).id
    raw = fid.partition("~")[0]
    headers = {"Authorization": f"Bearer {BOB}", "Content-Type": "application/json"}
    escaped = json.dumps({"model": "m", "messages": _file_part(raw)})
    escaped = escaped.replace("file", "fi\\u006ce")  # no "file" in its bytes
    async with httpx.AsyncClient() as client:
        sneaked = await client.post(
            gw.url + "/v1/chat/completions", content=escaped, headers=headers
        )
        assert sneaked.status_code == 404 and sneaked.json()["error"]["code"] == "file_not_found"
        note = {"type": "file_citation", "file_id": raw, "filename": "a.txt", "index": 0}
        said = {"type": "output_text", "text": "x", "annotations": [note]}
        given_back = {"type": "message", "role": "assistant", "content": [said]}
        cites = await client.post(  # a citation given back is checked: its echo is tagged
            gw.url + "/v1/responses", json={"model": "m", "input": [given_back]}, headers=headers
        )
        assert cites.status_code == 404 and cites.json()["error"]["code"] == "file_not_found"
        batch = {
            "input_file_id": raw,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        zipped = await client.post(
            gw.url + "/v1/batches",
            content=gzip.compress(json.dumps(batch).encode()),
            headers={**headers, "Content-Encoding": "gzip"},
        )
        assert zipped.status_code == 404
        owner = {**headers, "Authorization": f"Bearer {ALICE}"}
        deep = {  # a code interpreter's files, in a list, in a tool
            "model": "m",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "tools": [{"type": "code_interpreter", "container": {"file_ids": [fid]}}],
        }
        owned = await client.post(gw.url + "/v1/chat/completions", json=deep, headers=owner)
        assert owned.status_code == 200 and server.read == [raw]
        batch["input_file_id"] = fid
        zipped_own = await client.post(
            gw.url + "/v1/batches",
            content=gzip.compress(json.dumps(batch).encode()),
            headers={**owner, "Content-Encoding": "gzip"},
        )
        assert zipped_own.status_code == 200, zipped_own.text
        assert zipped_own.json()["input_file_id"] == fid


async def test_a_body_typed_or_encoded_otherwise_is_checked_all_the_same(kept):
    """A lenient server reads JSON whatever the body's type (aiohttp's ``json()``,
    Starlette's ``Request.json()``), and Python's parser reads UTF-16 and 32: neither may
    carry another tenant's file past the check."""
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        raw = (await alice.files.create(file=("a.txt", b"a"), purpose="user_data")).id
    raw = raw.partition("~")[0]
    batch = {"input_file_id": raw, "endpoint": "/v1/chat/completions", "completion_window": "1d"}
    items = {"items": [{"role": "user", "content": [{"type": "input_file", "file_id": raw}]}]}
    asked = len(server.asked)
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {BOB}"}) as client:
        for path, body in (("/v1/batches", batch), ("/v1/conversations", items)):
            text = json.dumps(body)
            for kind, content in (
                ("text/plain", text.encode()),
                ("application/x-www-form-urlencoded", (" \r\n" + text).encode()),
                (None, text.encode()),
            ):
                headers = {"Content-Type": kind} if kind else {}
                got = await client.post(gw.url + path, content=content, headers=headers)
                assert got.status_code == 404, (path, kind, got.text)
                assert got.json()["error"]["code"] == "file_not_found"
            for encoding in (
                "utf-16-le",
                "utf-16-be",
                "utf-32-le",
                "utf-32-be",
                "utf-16",
                "utf-8-sig",
            ):
                for kind in ("application/json", "text/plain"):
                    got = await client.post(
                        gw.url + path, content=text.encode(encoding), headers={"Content-Type": kind}
                    )
                    assert got.status_code == 400, (path, encoding, kind, got.text)
                    assert "must be UTF-8" in got.json()["error"]["message"]
        assert len(server.asked) == asked  # never the server's to resolve
        # a body that is no JSON object passes as it is, whatever it says
        for kind, content in (("text/plain", b"the file_id is " + raw.encode()),):
            got = await client.post(
                gw.url + "/v1/batches", content=content, headers={"Content-Type": kind}
            )
            assert got.status_code == 400 and got.json()["error"]["message"] == "not JSON"
    assert server.asked[-1] == ("POST", "/v1/batches")


async def test_a_files_content_passes_as_the_server_wrote_it(kept):
    _, gw = kept
    content = b'{"made": "file-0001"}\n'  # its own id, quoted, as a JSON string would be
    async with sdk(gw, ALICE) as alice:
        made = await alice.files.create(file=("a.jsonl", content), purpose="batch")
        assert (await alice.files.content(made.id)).content == content


async def test_files_are_pinned_to_the_instance_that_keeps_them(serve_app, start_gateway, tmp_path):
    one, two = Files("one:"), Files("two:")
    urls = [await serve_app(one.app()), await serve_app(two.app())]
    gw = await start_gateway(policy=write_policy(tmp_path, round_robin(urls)))
    async with sdk(gw, ALICE) as alice:
        made = await alice.files.create(file=("a.txt", b"a"), purpose="user_data")
        for _ in range(3):  # round robin alone would send one of these to the other
            assert (await alice.files.retrieve(made.id)).filename == made.filename
        read = await alice.chat.completions.create(model="m", messages=_file_part(made.id))
        assert read.choices[0].message.content == f"{made.filename[:4]}read file-0001"


async def test_without_the_secret_ids_pass_as_they_are(serve_app, start_gateway, tmp_path):
    server = Files()
    url = await serve_app(server.app())
    gw = await start_gateway(policy=write_policy(tmp_path, policy(url, secret="")))
    async with sdk(gw, ALICE) as alice:
        made = await alice.files.create(file=("a.txt", b"a"), purpose="user_data")
        assert made.id == "file-0001"
        assert len((await alice.files.list()).data) == 1


async def test_ten_thousand_files_named_in_one_body_are_each_untagged(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        fid = (await alice.files.create(file=("a.txt", b"a"), purpose="user_data")).id
    body = {  # the SDK's own checks of so large a body take seconds: plain HTTP
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
        "tools": [{"type": "code_interpreter", "container": {"file_ids": [fid] * 10_000}}],
    }
    headers = {"Authorization": f"Bearer {ALICE}"}
    async with httpx.AsyncClient(timeout=60) as client:
        reply = await client.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert server.read == ["file-0001"] * 10_000


async def test_a_tenant_keeps_and_searches_its_own_vector_stores(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        one = (await alice.files.create(file=("a.txt", b"a"), purpose="assistants")).id
        two = (await alice.files.create(file=("b.txt", b"b"), purpose="assistants")).id
        store = await alice.vector_stores.create(name="docs", file_ids=[one])
        assert store.id.startswith("vs_0003~") and store.id.count("~") == 2
        assert (await alice.vector_stores.retrieve(store.id)).id == store.id
        added = await alice.vector_stores.files.create(store.id, file_id=two)
        assert (added.id, added.vector_store_id) == (two, store.id)
        listed = await alice.vector_stores.files.list(store.id)
        assert [f.id for f in listed.data] == [one, two]  # its files, tagged as they were
        after = await alice.vector_stores.files.list(store.id, after=one)
        assert [f.id for f in after.data] == [two]
        assert (await alice.vector_stores.files.retrieve(two, vector_store_id=store.id)).id == two
        found = await alice.vector_stores.search(store.id, query="a")
        assert [hit.file_id for hit in found.data] == [one, two]
        answer = await alice.responses.create(
            model="m",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "a?"}]}],
            tools=[{"type": "file_search", "vector_store_ids": [store.id]}],
        )
        assert answer.output_text == "read file-0001 file-0002"
        # what the search found and the answer cites: the store's owner's files, tagged
        searched, message = answer.model_dump()["output"]
        assert [hit["file_id"] for hit in searched["results"]] == [one, two]
        assert [note["file_id"] for note in message["content"][0]["annotations"]] == [one, two]
        assert (await alice.files.content(two)).content == b"b"
        again = (await alice.responses.retrieve(answer.id)).model_dump()["output"]
        assert [note["file_id"] for note in again[1]["content"][0]["annotations"]] == [one, two]
        streamed = await alice.responses.create(
            model="m",
            input=[{"role": "user", "content": [{"type": "input_text", "text": "a?"}]}],
            tools=[{"type": "file_search", "vector_store_ids": [store.id]}],
            stream=True,
        )
        events = [event.model_dump() async for event in streamed]
        notes = [e["annotation"] for e in events if e["type"].endswith("annotation.added")]
        assert [note["file_id"] for note in notes] == [one, two]
        items = [e["item"] for e in events if e["type"] == "response.output_item.added"]
        assert [hit["file_id"] for hit in items[0]["results"]] == [one, two]
        with pytest.raises(openai.NotFoundError) as listing:
            await alice.vector_stores.list()
        assert listing.value.code == "not_found"
        assert (await alice.vector_stores.delete(store.id)).deleted
    assert ("GET", "/v1/vector_stores/vs_0003/files?after=file-0001") in server.asked


async def test_another_tenant_is_refused_every_vector_store_and_its_files(kept):
    server, gw = kept
    async with sdk(gw, ALICE) as alice:
        fid = (await alice.files.create(file=("a.txt", b"a"), purpose="assistants")).id
        vs = (await alice.vector_stores.create(name="docs", file_ids=[fid])).id
    asked = len(server.asked)
    async with sdk(gw, BOB) as bob:
        bobs = (await bob.files.create(file=("b.txt", b"b"), purpose="assistants")).id
        asked += 1
        for spelled in (vs, vs.partition("~")[0]):
            calls: list[Any] = [
                bob.vector_stores.retrieve(spelled),
                bob.vector_stores.delete(spelled),
                bob.vector_stores.search(spelled, query="a"),
                bob.vector_stores.files.list(spelled),
                bob.vector_stores.files.create(spelled, file_id=bobs),
                bob.responses.create(
                    model="m",
                    input="a?",
                    tools=[{"type": "file_search", "vector_store_ids": [spelled]}],
                ),
            ]
            for call in calls:
                with pytest.raises(openai.NotFoundError) as refused:
                    await call
                assert refused.value.code == "vector_store_not_found"
        # his own store cannot take her file, nor name it in its files' path
        mine = (await bob.vector_stores.create(name="mine")).id
        asked += 1
        for call in (
            bob.vector_stores.files.create(mine, file_id=fid),
            bob.vector_stores.files.retrieve(fid, vector_store_id=mine),
            bob.vector_stores.files.list(mine, after=fid),
        ):
            with pytest.raises(openai.NotFoundError) as refused:
                await call
            assert refused.value.code == "file_not_found"
    assert len(server.asked) == asked  # the server never asked


@pytest.mark.parametrize("bound", [True, False])
async def test_a_tenant_held_to_some_models_keeps_files_and_stores_once_ids_are_bound(
    serve_app, start_gateway, tmp_path, bound
):
    """A file, an upload or a vector store runs no model the client names: a tenant held to
    some models may keep its own once ids are bound to it (and use them with its models), and
    is refused the paths (a 403) without the secret.  A batch runs the models its file names,
    which the gateway cannot read: refused either way."""
    server = Files()
    url = await serve_app(server.app())
    gw = await start_gateway(policy=write_policy(tmp_path, held_policy(url, bound=bound)))
    async with sdk(gw, ALICE) as alice:
        if not bound:
            with pytest.raises(openai.PermissionDeniedError):
                await alice.files.create(file=("a.txt", b"a"), purpose="assistants")
            return
        made = await alice.files.create(file=("a.txt", b"a"), purpose="assistants")
        assert (await alice.files.content(made.id)).content == b"a"
        store = await alice.vector_stores.create(name="docs", file_ids=[made.id])
        assert [hit.file_id for hit in (await alice.vector_stores.search(store.id, query="a")).data]
        given: Any = [{"role": "user", "content": [{"type": "input_file", "file_id": made.id}]}]
        assert (await alice.responses.create(model="m", input=given)).output_text == (
            "read file-0001"
        )
        with pytest.raises(openai.NotFoundError):
            await alice.responses.create(model="other", input=given)
        with pytest.raises(openai.PermissionDeniedError):
            await alice.batches.create(
                input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
        await alice.files.delete(made.id)
    assert not any(path.startswith("/v1/batches") for _, path in server.asked)


async def test_a_tool_taking_a_file_id_and_the_clients_own_metadata_pass_as_they_are(kept):
    server, gw = kept
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {
                "type": "object",
                "properties": {"file_id": {"type": "string", "default": "file-9"}},
            },
        },
    }
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "read it"}]}],
        "tools": [tool],
        "metadata": {"file_id": "mine-to-name"},
    }
    headers = {"Authorization": f"Bearer {BOB}"}
    async with httpx.AsyncClient() as client:
        reply = await client.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == 200, reply.text
    assert server.read == []


async def test_gateway_sims_files_are_kept_on_their_own_instance(start_gateway, tmp_path):
    """Two ``gateway sim``s behind round robin, each keeping its own files: every read of a
    file, its content, a chat naming it and its deletion reach the instance that keeps it;
    another tenant is refused it."""
    sims = [await start_sim(SimConfig(port=0, base_ms=0, token_ms=0)) for _ in range(2)]
    try:
        gw = await start_gateway(policy=write_policy(tmp_path, round_robin([s.url for s in sims])))
        async with sdk(gw, ALICE) as alice:
            made = [
                await alice.files.create(
                    file=(f"{n}.txt", f"text {n}".encode()), purpose="user_data"
                )
                for n in range(2)
            ]
            for at, each in enumerate(made):
                assert each.id.startswith("file-") and each.id.count("~") == 2
                for _ in range(2):  # round robin alone would send one of each to the other
                    assert (await alice.files.content(each.id)).content == f"text {at}".encode()
                said = await alice.chat.completions.create(
                    model="m", messages=_file_part(each.id), max_tokens=2
                )
                assert said.choices[0].message.content
            async with sdk(gw, BOB) as bob:
                with pytest.raises(openai.NotFoundError):
                    await bob.files.retrieve(made[0].id)
            for each in made:
                assert (await alice.files.delete(each.id)).deleted
                with pytest.raises(openai.NotFoundError):
                    await alice.files.retrieve(each.id)
    finally:
        for s in sims:
            await s.close()


async def test_gateway_sims_files_are_bounded():
    sim = await start_sim(SimConfig(port=0, base_ms=0, token_ms=0))
    try:
        async with httpx.AsyncClient() as client:
            not_a_form = await client.post(sim.url + "/v1/files", json={"file": "x"})
            assert not_a_form.status_code == 400
            big = {"file": ("big.bin", b"x" * (2 * 1024 * 1024))}
            too_big = await client.post(sim.url + "/v1/files", files=big, data={"purpose": "x"})
            assert too_big.status_code in (400, 413)
            missing = await client.get(sim.url + "/v1/files/file-none")
            assert missing.json()["error"]["code"] == "file_not_found"
    finally:
        await sim.close()
