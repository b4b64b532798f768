"""Issue 17, limits across replicas: two ``gateway serve`` processes and a real
``redis-server`` enforce one ``store: redis`` limit per tenant between them, and when Redis
is killed under them, no request fails and each process enforces its local share (the
limit over ``replicas``), until Redis is back.

The bounds are counts over the window the test measured (rate x elapsed + burst, plus one
for the boundary): how fast the machine is never matters, only that no more got through.
A decision a process made locally (Redis late past its 25 ms budget on a busy machine)
is not the shared count's, so the shared bound allows one more success per local decision.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import CHAT, metric, write_policy
from tests.redis_server import RedisServer, redis_server  # noqa: F401
from tests.test_lifecycle import Process, serve_process, wait_ready  # noqa: F401
from tests.upstreams import Recorder

pytestmark = pytest.mark.redis
RATE, BURST, REPLICAS = 5.0, 4.0, 2
WORKERS = 3
"""Concurrent clients per gateway."""
PAUSE_S = 0.02
"""Between a client's requests: the window lasts its seconds, not MAX_REQUESTS' worth."""
MAX_REQUESTS = 600
"""Requests per gateway and window at most, whatever the machine's speed."""


@dataclass
class Tally:
    """The answers one gateway gave in one window."""

    statuses: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> int:
        return self.statuses.count(200)


async def hammer(
    client: httpx.AsyncClient, gateways: list[Process], tenant: str, seconds: float
) -> tuple[list[Tally], float]:
    """Send chat requests of one tenant to every gateway for ``seconds`` (at most
    ``MAX_REQUESTS`` each); each gateway's answers, and the seconds the window took."""
    headers = {"Authorization": f"Bearer {tenant}"}
    tallies = [Tally() for _ in gateways]
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + seconds

    async def worker(gw: Process, tally: Tally) -> None:
        while loop.time() < deadline and len(tally.statuses) + len(tally.errors) < MAX_REQUESTS:
            try:
                answer = await client.post(
                    gw.url + "/v1/chat/completions", json=CHAT, headers=headers
                )
            except httpx.HTTPError as exc:
                tally.errors.append(f"{type(exc).__name__}: {exc}")
            else:
                tally.statuses.append(answer.status_code)
            await asyncio.sleep(PAUSE_S)

    await asyncio.gather(
        *(
            worker(gw, tally)
            for gw, tally in zip(gateways, tallies, strict=True)
            for _ in range(WORKERS)
        )
    )
    return tallies, loop.time() - start


async def local_decisions(client: httpx.AsyncClient, gw: Process) -> float:
    text = (await client.get(gw.admin_url + "/metrics")).text
    return metric(text, "gateway_rate_limit_decisions_total", route="chat", store="local") or 0.0


async def series(client: httpx.AsyncClient, gw: Process, name: str, **labels: str) -> float | None:
    return metric((await client.get(gw.admin_url + "/metrics")).text, name, **labels)


async def two_gateways(serve_app: Any, start: Any, tmp_path: Path, redis: str) -> list[Process]:
    backend = await serve_app(Recorder().app())
    limit = {"requests_per_s": RATE, "burst": BURST, "store": "redis", "replicas": REPLICAS}
    path = write_policy(
        tmp_path,
        {
            "cache": {"redis_url": redis},
            "backends": {"main": {"url": backend}},
            "routes": [
                {"name": "chat", "match": {"path": "/v1/*"}, "backend": "main", "rate_limit": limit}
            ],
        },
    )
    return list(await asyncio.gather(*(start("--policy", str(path)) for _ in range(2))))


async def test_two_gateway_processes_admit_at_most_one_tenants_limit_between_them(
    serve_app: Any,
    serve_process: Any,  # noqa: F811
    redis_server: RedisServer,  # noqa: F811
    tmp_path: Path,
):
    gateways = await two_gateways(serve_app, serve_process, tmp_path, redis_server.url)
    async with httpx.AsyncClient(timeout=10) as client:
        for gw in gateways:
            await wait_ready(client, gw.admin_url)
        tallies, elapsed = await hammer(client, gateways, uuid.uuid4().hex, seconds=3.0)
        local = [await local_decisions(client, gw) for gw in gateways]
        shared = [
            await series(
                client, gw, "gateway_rate_limit_decisions_total", route="chat", store="redis"
            )
            for gw in gateways
        ]
    assert [t.errors for t in tallies] == [[], []]
    assert {s for t in tallies for s in t.statuses} <= {200, 429}
    ok = sum(t.ok for t in tallies)
    assert BURST <= ok <= RATE * elapsed + BURST + 1 + sum(local), (ok, elapsed, local)
    assert all(n and n > 0 for n in shared)  # both gateways asked Redis


async def test_redis_killed_under_two_gateways_fails_no_request_and_applies_local_shares(
    serve_app: Any,
    serve_process: Any,  # noqa: F811
    redis_server: RedisServer,  # noqa: F811
    tmp_path: Path,
):
    gateways = await two_gateways(serve_app, serve_process, tmp_path, redis_server.url)
    tenant = uuid.uuid4().hex
    async with httpx.AsyncClient(timeout=10) as client:
        for gw in gateways:
            await wait_ready(client, gw.admin_url)
        before, _ = await hammer(client, gateways, tenant, seconds=1.0)
        redis_server.stop()
        after, elapsed = await hammer(client, gateways, tenant, seconds=3.0)
        down = [
            await series(client, gw, "gateway_rate_limit_store_up", route="chat") for gw in gateways
        ]
        local = [await local_decisions(client, gw) for gw in gateways]
        redis_server.start()
        back = await until_shared_again(client, gateways, tenant)
    for tally in before + after:
        assert tally.errors == [] and set(tally.statuses) <= {200, 429}
    for tally in after:  # each process on its own share: the limit and burst over 2
        assert tally.ok <= RATE / REPLICAS * elapsed + BURST / REPLICAS + 1, (tally.ok, elapsed)
    assert down == [0, 0] and all(n > 0 for n in local)
    assert back == [1, 1]


async def until_shared_again(
    client: httpx.AsyncClient, gateways: list[Process], tenant: str
) -> list[float | None]:
    """Keep sending (a request after the back-off starts the background probe) until both
    gateways say their limits are shared again, for at most 15 s."""
    deadline = time.monotonic() + 15
    while True:
        await hammer(client, gateways, tenant, seconds=0.1)
        up = [
            await series(client, gw, "gateway_rate_limit_store_up", route="chat") for gw in gateways
        ]
        if up == [1, 1] or time.monotonic() > deadline:
            return up
