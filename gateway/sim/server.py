"""The sim as an aiohttp application, and the ways to run it (in-process or from the CLI).

Routes: the OpenAI endpoints (``openai_api``, ``other_apis``, ``conversations``,
``files``), Ollama's own (``ollama_api``), TGI's (``tgi_api``: ``/generate``,
``/generate_stream`` and ``/``), SGLang's (``sglang_api``: ``/generate``, told from TGI's by
its body), ``/health``, ``/metrics``, and the control
endpoints ``GET /sim/state``, ``GET|POST /sim/config`` and ``POST /sim/reset``.  Errors
leave as OpenAI-shaped JSON, as a real model server's would (Ollama's paths: as Ollama
writes them, TGI's as TGI does).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.errors import BadRequest, GatewayError
from gateway.sim import (
    conversations,
    files,
    ollama_api,
    openai_api,
    other_apis,
    sglang_api,
    tgi_api,
)
from gateway.sim import requests as req
from gateway.sim.config import SimConfig
from gateway.sim.engine import Engine
from gateway.sim.metrics import CONTENT_TYPE, build_registry, render
from gateway.sim.openai_api import ENGINE, error_body

REGISTRY = web.AppKey("registry", CollectorRegistry)

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(config: SimConfig, clock: Clock | None = None) -> web.Application:
    """The sim's application; ``clock`` drives the thermal model (the system clock by default)."""
    app = web.Application(middlewares=[_openai_errors])
    engine = Engine(config, clock or SYSTEM_CLOCK)
    app[ENGINE] = engine
    app[REGISTRY] = build_registry(engine)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_post("/v1/embeddings", openai_api.embeddings)
    app[other_apis.STORED] = OrderedDict()
    app.router.add_post("/v1/responses", other_apis.responses)
    app.router.add_get("/v1/responses/{rid}", other_apis.stored_response)
    app.router.add_delete("/v1/responses/{rid}", other_apis.stored_response)
    app[conversations.CONVERSATIONS] = OrderedDict()
    app.router.add_post("/v1/conversations", conversations.create)
    for method in ("GET", "POST", "DELETE"):
        app.router.add_route(method, "/v1/conversations/{cid}", conversations.conversation)
    app.router.add_get("/v1/conversations/{cid}/items", conversations.items)
    app.router.add_post("/v1/conversations/{cid}/items", conversations.items)
    app.router.add_get("/v1/conversations/{cid}/items/{iid}", conversations.item)
    app.router.add_delete("/v1/conversations/{cid}/items/{iid}", conversations.item)
    app[files.FILES] = OrderedDict()
    app.router.add_route("*", "/v1/files", _files)
    app.router.add_route("*", "/v1/files/{fid}", files.one)
    app.router.add_get("/v1/files/{fid}/content", files.content)
    app.router.add_post("/v1/messages", other_apis.messages)
    app.router.add_post("/v1/messages/count_tokens", other_apis.count_message_tokens)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_post("/api/chat", ollama_api.chat)
    app.router.add_post("/api/generate", ollama_api.generate)
    app.router.add_post("/api/embed", ollama_api.embed)
    app.router.add_get("/api/tags", ollama_api.tags)
    app.router.add_get("/api/version", ollama_api.version)
    app.router.add_post("/generate", _generate)  # TGI's and SGLang's
    app.router.add_post("/generate_stream", tgi_api.generate_stream)
    app.router.add_post("/", tgi_api.compat)
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/sim/state", _state)
    app.router.add_get("/sim/config", _get_config)
    app.router.add_post("/sim/config", _post_config)
    app.router.add_post("/sim/reset", _reset)
    return app


@web.middleware
async def _openai_errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except GatewayError as exc:
        if request.path.startswith("/api/"):  # Ollama's own API: its own error shape
            return web.json_response({"error": str(exc)}, status=exc.status)
        body = error_body(str(exc), exc.type, exc.code)
        return web.json_response(body, status=exc.status)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = exc.reason.lower().replace(" ", "_")
        body = error_body(exc.reason, "invalid_request_error", code)
        return web.json_response(body, status=exc.status)


async def _files(request: web.Request) -> web.Response:
    """``POST /v1/files`` makes one, ``GET`` lists them."""
    if request.method == "POST":
        return await files.create(request)
    if request.method == "GET":
        return await files.listing(request)
    raise web.HTTPMethodNotAllowed(request.method, ["GET", "POST"])


async def _generate(request: web.Request) -> web.StreamResponse:
    """``/generate``: SGLang's for a body naming its prompt so, else TGI's."""
    try:
        sglang = sglang_api.asks_sglang(await req.read_body(request))
    except BadRequest:  # TGI's answers it and says why
        sglang = False
    return await (sglang_api.generate if sglang else tgi_api.generate)(request)


async def _health(request: web.Request) -> web.Response:
    if request.app[ENGINE].config.healthy:
        return web.json_response({"status": "ok"})
    return web.json_response({"status": "unhealthy"}, status=503)


async def _metrics(request: web.Request) -> web.Response:
    body = render(request.app[REGISTRY])
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _state(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE].state())


async def _get_config(request: web.Request) -> web.Response:
    return web.json_response(dataclasses.asdict(request.app[ENGINE].config))


async def _post_config(request: web.Request) -> web.Response:
    try:
        changes = await request.json()
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(changes, dict):
        raise BadRequest("send a JSON object of field: value")
    try:
        config = request.app[ENGINE].reconfigure(changes)
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    return web.json_response(dataclasses.asdict(config))


async def _reset(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    engine.reset()
    request.app[other_apis.STORED].clear()
    request.app[conversations.CONVERSATIONS].clear()
    return web.json_response(engine.state())


class SimServer:
    """A running sim: its ``url``, its live ``state()``, and ``close()``."""

    def __init__(self, runner: web.AppRunner, app: web.Application, host: str, port: int):
        self._runner = runner
        self.app = app
        self.url = f"http://{host}:{port}"

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE]

    def state(self) -> dict[str, Any]:
        """The same snapshot ``GET /sim/state`` answers."""
        return self.engine.state()

    def configure(self, **changes: Any) -> SimConfig:
        """Change fault knobs or latency while running, like ``POST /sim/config``."""
        return self.engine.reconfigure(changes)

    async def close(self) -> None:
        await self._runner.cleanup()

    async def __aenter__(self) -> SimServer:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<SimServer {self.url} {self.engine!r}>"


async def start_sim(config: SimConfig, clock: Clock | None = None) -> SimServer:
    """Serve a sim on ``config.host``/``config.port`` (0 picks a free port) in this loop."""
    app = build_app(config, clock)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        host, port = runner.addresses[0][:2]
    except BaseException:
        await runner.cleanup()
        raise
    return SimServer(runner, app, config.host or host, port)


async def run_sim(config: SimConfig) -> None:
    """Serve until cancelled, after printing ``sim listening on http://HOST:PORT``."""
    server = await start_sim(config)
    try:
        print(f"sim listening on {server.url}", flush=True)
        await asyncio.Event().wait()
    finally:
        await server.close()
