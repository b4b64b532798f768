"""The sim's Files API (OpenAI's ``/v1/files``): files kept in this process's memory, as
stored responses and conversations are, so another instance of the sim has none of them.

``POST /v1/files`` takes a form with ``file`` and ``purpose``; ``GET /v1/files`` lists them;
``GET`` and ``DELETE /v1/files/<id>``; ``GET /v1/files/<id>/content`` gives the bytes back.
A chat or a response may name one (a ``file`` part): the sim reads only the text of a
request, so a file named changes nothing in the answer.  Bounded: the last ``MAX_FILES``,
least recently used forgotten first, each of at most ``MAX_FILE_BYTES``."""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from gateway.errors import RequestError
from gateway.sim import requests as req
from gateway.sim.openai_api import ENGINE

MAX_FILES = 256
MAX_FILE_BYTES = 1024 * 1024
FILES = web.AppKey("files", OrderedDict)


class FileNotFound(RequestError):
    status = 404
    code = "file_not_found"


@dataclass
class File:
    id: str
    created_at: int
    filename: str
    purpose: str
    content: bytes

    def shown(self) -> dict[str, object]:
        made = {"id": self.id, "object": "file", "created_at": self.created_at}
        named = {"filename": self.filename, "purpose": self.purpose, "status": "processed"}
        return {**made, "bytes": len(self.content), **named}


def kept(request: web.Request) -> OrderedDict[str, File]:
    found: OrderedDict[str, File] = request.app[FILES]
    return found


def _named(request: web.Request) -> File:
    fid = request.match_info["fid"]
    found = kept(request).get(fid)
    if found is None:
        raise FileNotFound(f"No such File object: {fid}")
    kept(request).move_to_end(fid)
    return found


async def create(request: web.Request) -> web.Response:
    """A file from a form's ``file`` and ``purpose``."""
    if not request.content_type.startswith("multipart/"):
        raise req.BadRequest("a file is uploaded as multipart/form-data")
    form = await request.post()
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, web.FileField) or not isinstance(purpose, str):
        raise req.BadRequest("the form needs a 'file' and a 'purpose'")
    content = upload.file.read(MAX_FILE_BYTES + 1)
    if len(content) > MAX_FILE_BYTES:
        raise req.BadRequest(f"a file holds at most {MAX_FILE_BYTES} bytes here")
    made = File(
        f"file-{uuid.uuid4().hex}",
        int(request.app[ENGINE].clock.wall()),
        upload.filename,
        purpose,
        content,
    )
    files = kept(request)
    files[made.id] = made
    while len(files) > MAX_FILES:
        files.popitem(last=False)
    return web.json_response(made.shown())


async def listing(request: web.Request) -> web.Response:
    data = [each.shown() for each in kept(request).values()]
    return web.json_response({"object": "list", "data": data, "has_more": False})


async def one(request: web.Request) -> web.Response:
    """``GET`` or ``DELETE`` one file."""
    found = _named(request)
    if request.method == "DELETE":
        del kept(request)[found.id]
        return web.json_response({"id": found.id, "object": "file", "deleted": True})
    return web.json_response(found.shown())


async def content(request: web.Request) -> web.Response:
    return web.Response(body=_named(request).content, content_type="application/octet-stream")
