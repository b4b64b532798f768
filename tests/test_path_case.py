"""A known API's path spelled in another case is refused at the edge
(``gateway.server.path_case``): behind a server that routes without regard to case
(Express, ASP.NET Core, Fiber), ``/V1/Files/<id>`` would reach what ``/v1/files/<id>``
names, past every check the gateway makes on that path.  A case-blind recording server on a
real socket."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from gateway.server.path_case import case_variant
from tests.helpers import write_policy
from tests.test_response_ids import ALICE, policy


@pytest.mark.parametrize(
    ("path", "known"),
    [
        ("/V1/files/file-AbC", "/v1/files/file-AbC"),
        ("/v1/Files/file-AbC/content", "/v1/files/file-AbC/content"),
        ("/v1/FILES", "/v1/files"),
        ("/v1/chat/Completions/chatcmpl-X", "/v1/chat/completions/chatcmpl-X"),
        ("/v1/CHAT/completions", "/v1/chat/completions"),
        ("/v1/Responses/resp_1", "/v1/responses/resp_1"),
        ("/v1/Vector_Stores/vs_1", "/v1/vector_stores/vs_1"),
        ("/V2/Models/m/infer", "/v2/models/m/infer"),
        # a known API's own spelling, an id's or a model's capitals, another API: as they are
        ("/v1/files/file-AbC", None),
        ("/v1/chat/completions/chatcmpl-AB", None),
        ("/v1/models/Qwen/Qwen2.5-7B", None),
        ("/v2/models/ResNet/infer", None),
        ("/v1/vector_stores/vs_1/Files/x", None),
        ("/V1/Custom", None),
        ("/Api/Generate", None),
        ("/v1", None),
        ("/", None),
    ],
)
def test_a_known_apis_path_in_another_case_is_told(path, known):
    assert case_variant(path) == known


class CaseBlind:
    """Routes without regard to case, as Express does: every path lower-cased; notes what
    it was asked."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.Response:
        self.asked.append(request.path)
        return web.json_response({"served": request.path.lower()})


async def test_no_other_case_of_a_bound_path_reaches_a_case_blind_server(
    serve_app, start_gateway, tmp_path
):
    server = CaseBlind()
    gw = await start_gateway(policy=write_policy(tmp_path, policy(await serve_app(server.app()))))
    headers = {"Authorization": f"Bearer {ALICE}"}
    refused = [
        ("GET", "/V1/files/file-0001"),  # another tenant's file, by its raw id
        ("GET", "/v1/Files/file-0001/content"),
        ("GET", "/v1/FILES"),  # every tenant's files, listed
        ("GET", "/v1/chat/Completions/chatcmpl-1"),
        ("GET", "/v1/Responses/resp_1"),
        ("GET", "/v1/Conversations/conv_1/items"),
        ("POST", "/V1/CHAT/COMPLETIONS"),  # past the chat route's cache and limits
    ]
    async with httpx.AsyncClient(headers=headers) as client:
        for method, path in refused:
            reply = await client.request(method, gw.url + path, json={})
            assert reply.status_code == 404, (method, path, reply.text)
            error = reply.json()["error"]
            assert error["code"] == "unknown_url" and "case-sensitive" in error["message"]
            assert error["message"].endswith(path.lower())
        assert server.asked == []
        for path in ("/V1/Custom", "/v1/models/Qwen/Qwen2.5-7B", "/Health"):
            reply = await client.get(gw.url + path)
            assert reply.status_code == 200 and reply.json()["served"] == path.lower()
    assert server.asked == ["/V1/Custom", "/v1/models/Qwen/Qwen2.5-7B", "/Health"]
