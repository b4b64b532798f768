"""Fixtures shared by the whole suite: real listeners on ephemeral ports, and gateways
without sockets (``pipeline``) for the stage tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiohttp import web

from gateway.app import Gateway
from gateway.policy.load import zero_config_policy
from gateway.policy.watch import PolicySource
from gateway.testing.harness import Pipeline
from tests.llama import llama, llama_pair, require_llm  # noqa: F401
from tests.test_response_ids import bound  # noqa: F401 (a storing server, a binding gateway)
from tests.upstreams import Answer, RawBackend, RawExchange

ServeApp = Callable[[web.Application], Awaitable[str]]
pytest_plugins = ("tests.redis_server", "tests.redis_cluster")
"""``redis_cluster`` (one per session, so never imported into a test module), and what
``redis_target`` asks for wherever it is used."""


def pytest_runtest_setup(item: pytest.Item) -> None:
    require_llm(item)


@pytest.fixture
async def serve_app() -> AsyncIterator[ServeApp]:
    """Start aiohttp apps on 127.0.0.1 ephemeral ports; returns each one's base URL."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=0.5, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in reversed(runners):
        await runner.cleanup()


@dataclass
class Running:
    """A gateway listening on ephemeral ports."""

    gateway: Gateway
    url: str
    admin_url: str


StartGateway = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    """Start gateways in-process: ``await start_gateway(upstream=URL)`` or ``policy=PATH``."""
    running: list[Running] = []

    async def start(
        *,
        upstream: str | None = None,
        policy: str | Path | None = None,
        warmup: bool = True,
        watch_interval_s: float = 0.05,
        **kwargs: object,
    ) -> Running:
        source = (
            PolicySource(policy)
            if policy is not None
            else PolicySource(fixed=zero_config_policy(str(upstream)))
        )
        gateway = Gateway(source, **kwargs)  # type: ignore[arg-type]
        url, admin = await gateway.start(
            "127.0.0.1", 0, "127.0.0.1", 0, watch_interval_s=watch_interval_s, warmup=warmup
        )
        r = Running(gateway, url, admin)
        running.append(r)
        return r

    yield start
    for r in reversed(running):
        await r.gateway.shutdown(0.5)


@pytest.fixture
async def raw_backend() -> AsyncIterator[Callable[..., Awaitable[tuple[str, RawBackend]]]]:
    """Start raw-socket backends: ``url, backend = await raw_backend(respond)``."""
    started: list[RawBackend] = []

    async def start(respond: Callable[[RawExchange], Answer]) -> tuple[str, RawBackend]:
        backend = RawBackend(respond)
        started.append(backend)
        return await backend.start(), backend

    yield start
    for backend in started:
        await backend.close()


StartPipeline = Callable[..., Awaitable[Pipeline]]


@pytest.fixture
async def pipeline() -> AsyncIterator[StartPipeline]:
    """Gateways without sockets: ``gw = await pipeline(policy, backends, **options)``, the
    policy as YAML text, data, a path or a ``PolicySource`` (``gateway.testing.harness.Pipeline``)."""
    opened: list[Pipeline] = []

    async def start(policy: Any, backends: Any, **options: Any) -> Pipeline:
        if isinstance(policy, dict):
            policy = yaml.safe_dump(policy, sort_keys=False)
        gw = Pipeline(policy, backends, **options)
        await gw.__aenter__()
        opened.append(gw)
        return gw

    yield start
    for gw in reversed(opened):
        await gw.__aexit__(None, None, None)
