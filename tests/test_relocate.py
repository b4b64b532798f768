"""A backend's own URL in an answer's ``Location`` is told as the gateway's path
(``gateway.transport.relocate``), as nginx's ``proxy_redirect default`` does: a real
Starlette app on uvicorn (what vLLM, MLServer and LiteLLM run on) redirects a trailing
slash to its own address, and the client following it comes back through the gateway, to
the route that path has."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Mount, Route

from gateway.transport.relocate import Relocation
from tests.helpers import write_policy

BACKEND = "http://127.0.0.1:8000/api"


@pytest.mark.parametrize(
    ("location", "told"),
    [
        ("http://127.0.0.1:8000/api/v1/chat/completions", "/v1/chat/completions"),
        ("HTTP://127.0.0.1:8000/api/v1/models?limit=2#top", "/v1/models?limit=2#top"),
        ("http://127.0.0.1:8000/api", "/"),
        ("http://127.0.0.1:8000/api?x=1", "/?x=1"),
        ("/api/v1/files/file-1", "/v1/files/file-1"),
        ("  http://127.0.0.1:8000/api/v1/x  ", "/v1/x"),
        # anything else, as it is
        ("http://127.0.0.1:8001/api/v1/x", None),  # another port
        ("https://127.0.0.1:8000/api/v1/x", None),  # another scheme
        ("http://10.0.0.7:8000/api/v1/x", None),  # another host
        ("http://127.0.0.1:8000/apiv1/x", None),  # outside the prefix
        ("http://127.0.0.1:8000/other", None),
        ("/other/v1/x", None),
        ("//127.0.0.1:8000/api/v1/x", None),  # a network-path reference: left to the client
        ("v1/x", None),
        ("https://files.example.com/signed?sig=1", None),  # a presigned download
        ("http://127.0.0.1:99999/api", None),  # a port out of range
        ("http://[::1/api", None),
        ("mailto:ops@example.com", None),
    ],
)
def test_a_url_naming_the_backend_is_told_as_the_gateways_path(location, told):
    assert Relocation(BACKEND).url(location) == (location if told is None else told)


def test_a_backend_without_a_prefix_keeps_the_whole_path():
    relocation = Relocation("https://models.internal")
    assert relocation.url("https://MODELS.internal:443/v1/x") == "/v1/x"
    assert (
        relocation.url("https://models.internal:8443/v1/x") == "https://models.internal:8443/v1/x"
    )
    assert relocation.url("/v1/x") == "/v1/x"


def test_only_url_headers_are_told_and_others_are_the_same_tuple():
    relocation = Relocation(BACKEND)
    plain = (("Content-Type", "application/json"), ("X-Note", "http://127.0.0.1:8000/api/x"))
    assert relocation.headers(plain) is plain
    told = relocation.headers(
        (*plain, ("location", "http://127.0.0.1:8000/api/a"), ("Content-Location", "/api/b"))
    )
    assert told == (*plain, ("location", "/a"), ("Content-Location", "/b"))


class Recorder:
    """A Starlette app under ``/ollama`` (its router redirects a path with or without a
    trailing slash to the one it has, 307, naming its own address); notes what it ran."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def app(self) -> Starlette:
        async def generate(request: Request) -> JSONResponse:
            self.ran.append(request.url.path)
            return JSONResponse({"model": (await request.json())["model"], "response": "hi"})

        async def chat(request: Request) -> JSONResponse:
            self.ran.append(request.url.path)
            return JSONResponse(completion((await request.json())["model"], len(self.ran)))

        routes = [
            Route("/api/generate", generate, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ]
        return Starlette(routes=[Mount("/ollama", routes=routes)])


def completion(model: str, n: int) -> dict[str, object]:
    return {
        "id": f"chatcmpl-{n}",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hello"},
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


@pytest.fixture
async def uvicorn_app() -> AsyncIterator[Callable[[Starlette], Awaitable[str]]]:
    """Serve ASGI apps with uvicorn on 127.0.0.1 ephemeral ports; returns each one's URL."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def start(app: Starlette) -> str:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        task = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        servers.append((server, task))
        port = server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    yield start
    for server, task in servers:
        server.should_exit = True
        await task


@pytest.fixture
async def behind(uvicorn_app, start_gateway, tmp_path):
    """A gateway before a Recorder under ``/ollama``: chat cached, every other path passed."""
    backend = Recorder()
    url = await uvicorn_app(backend.app()) + "/ollama"
    routes = [
        {"name": "chat", "match": {"path": "/v1/chat/completions"}, "backend": "main",
         "cache": {"ttl_s": 60}},
        {"name": "rest", "match": {"path": "/*"}, "backend": "main"},
    ]  # fmt: skip
    rules = {"backends": {"main": {"url": url}}, "routes": routes}
    gw = await start_gateway(policy=write_policy(tmp_path, rules))
    return backend, gw


async def test_a_redirect_to_the_backends_address_comes_back_through_the_gateway(behind):
    backend, gw = behind
    body = {"model": "m", "prompt": "hi"}
    async with httpx.AsyncClient() as client:
        reply = await client.post(gw.url + "/api/generate/", json=body)
        assert reply.status_code == 307
        assert reply.headers["location"] == "/api/generate"  # not the backend's address
        assert backend.ran == []
        reply = await client.post(gw.url + "/api/generate/", json=body, follow_redirects=True)
        assert reply.status_code == 200 and reply.json()["response"] == "hi"
        assert [str(r.url) for r in reply.history] == [gw.url + "/api/generate/"]
        assert str(reply.url) == gw.url + "/api/generate"  # the gateway's, again
    assert backend.ran == ["/ollama/api/generate"]


async def test_a_known_apis_path_with_a_trailing_slash_is_its_routes(behind):
    """``/v1/chat/completions/`` is trimmed at the edge: the chat route's, cache and all,
    with no redirect (the backend would have answered one)."""
    backend, gw = behind
    chat = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient() as client:
        for want in ("miss", "hit"):
            reply = await client.post(gw.url + "/v1/chat/completions/", json=chat)
            assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"]
            assert reply.headers["x-gateway-cache"] == want
    assert backend.ran == ["/ollama/v1/chat/completions"]
