"""DNS discovery of a backend's endpoints (an injected resolver, a fake clock): the
endpoints follow the name's addresses without a reload, one that disappears drains its
requests in flight, a failed resolution keeps the last endpoints, and endpoints coming and
going under load fail no request."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.metrics import Metrics
from gateway.policy.model import Backend, Discovery
from gateway.testing import FakeClock, FakeResolver
from gateway.transport.discovery import urls_of
from gateway.transport.endpoints import EndpointSet
from tests.helpers import problems_of, until

HOSTS = ("127.0.0.2", "127.0.0.3", "127.0.0.4")  # all of 127/8 is loopback on Linux


def free_port_on_all() -> int:
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            for host in HOSTS:
                with socket.socket() as t:
                    t.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


@pytest.fixture
async def instances() -> AsyncIterator[tuple[int, dict[str, asyncio.Event]]]:
    """One server per loopback address, all on one port, each answering its address;
    a request to ``/gated`` waits for that address's event."""
    port = free_port_on_all()
    gates = {host: asyncio.Event() for host in HOSTS}
    runners = []
    for host in HOSTS:

        async def handle(request: web.Request, host: str = host) -> web.Response:
            if request.path == "/gated":
                await gates[host].wait()
            return web.Response(text=host)

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await runner.setup()
        await web.TCPSite(runner, host, port).start()
        runners.append(runner)
    yield port, gates
    for runner in runners:
        await runner.cleanup()


def discovered(port: int, interval_s: float = 5.0) -> Backend:
    return Backend(
        "llm",
        discovery=Discovery("llm.svc", port, interval_s=interval_s),
        balance="round_robin",
    )


async def answer(endpoints: EndpointSet, backend: Backend, path: str = "/") -> str:
    reply = await endpoints.send(backend, "GET", path, [], b"", streaming=False)
    assert reply.status == 200 and reply.body is not None
    return reply.body.decode()


def test_addresses_become_base_urls_ipv6_in_brackets() -> None:
    discovery = Discovery("x", 8000, path="/v1/")
    assert urls_of(discovery, ["10.0.0.2", "fd00::1", "10.0.0.2"]) == (
        "http://10.0.0.2:8000/v1",
        "http://[fd00::1]:8000/v1",
    )
    # a broken resolver's garbage never becomes a URL (nor a header-injection vector)
    garbage = ["not-an-ip", "10.0.0.3\r\nHost: evil", "", "10.0.0.3"]
    assert urls_of(discovery, garbage) == ("http://10.0.0.3:8000/v1",)


async def test_the_endpoints_follow_the_name_and_a_gone_one_drains(instances) -> None:
    port, gates = instances
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": list(HOSTS[:2])})
    backend = discovered(port)
    metrics = Metrics()
    endpoints = EndpointSet(backend, metrics, clock=clock)
    endpoints.follow(resolver)
    try:
        assert sorted({await answer(endpoints, backend) for _ in range(4)}) == list(HOSTS[:2])
        first = next(e for e in endpoints.endpoints if HOSTS[0] in e.url)
        # a request in flight on the first instance while it leaves the name
        held = asyncio.create_task(
            first.pool.send(backend, "GET", "/gated", [], b"", streaming=False)
        )
        await until(lambda: first.inflight == 1)
        resolver.set("llm.svc", list(HOSTS[1:]))
        clock.advance(5)
        await until(lambda: [HOSTS[0] in e.url for e in endpoints.endpoints] == [False, False])
        assert sorted({await answer(endpoints, backend) for _ in range(6)}) == list(HOSTS[1:])
        assert not first.pool.closed  # still draining
        gates[HOSTS[0]].set()
        assert (await held).status == 200
        await until(lambda: first.pool.closed)
        text = metrics.exposition().decode()
        assert f'endpoint="http://{HOSTS[0]}:{port}"' not in text  # its series went with it
        assert resolver.asked == 2
    finally:
        await endpoints.aclose()


async def test_a_flood_of_addresses_is_capped_at_64_endpoints(instances) -> None:
    port, _ = instances
    flood = [f"10.{i // 250}.{i % 250}.1" for i in range(1000)]
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": flood})
    endpoints = EndpointSet(discovered(port), Metrics(), clock=clock)
    endpoints.follow(resolver)
    try:
        await until(lambda: endpoints.resolved.is_set())
        assert len(endpoints.endpoints) == 64
    finally:
        await endpoints.aclose()


async def test_a_failed_resolution_keeps_the_last_endpoints(instances) -> None:
    port, _ = instances
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": [HOSTS[0]]})
    backend = discovered(port)
    endpoints = EndpointSet(backend, Metrics(), clock=clock)
    endpoints.follow(resolver)
    try:
        assert await answer(endpoints, backend) == HOSTS[0]
        resolver.set("llm.svc", OSError("SERVFAIL"))
        clock.advance(5)
        await until(lambda: resolver.asked == 2)
        assert await answer(endpoints, backend) == HOSTS[0]
    finally:
        await endpoints.aclose()


async def test_endpoints_coming_and_going_under_load_fail_no_request(instances) -> None:
    port, _ = instances
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": list(HOSTS[:2])})
    backend = discovered(port)
    endpoints = EndpointSet(backend, Metrics(), clock=clock)
    endpoints.follow(resolver)
    served: list[str] = []
    stop = asyncio.Event()

    async def client() -> None:
        while not stop.is_set():
            served.append(await answer(endpoints, backend))

    clients = [asyncio.create_task(client()) for _ in range(6)]
    try:
        for answer_set in (HOSTS[1:], HOSTS[:1], HOSTS, HOSTS[2:], HOSTS[:2]):
            before = len(served)
            resolver.set("llm.svc", list(answer_set))
            clock.advance(5)

            def thirty_more(before: int = before) -> bool:
                return len(served) >= before + 30

            await until(thirty_more)
        stop.set()
        await asyncio.gather(*clients)  # any failed request would raise here
    finally:
        stop.set()
        for task in clients:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, AssertionError):
                await task
        await endpoints.aclose()
    assert set(served) == set(HOSTS) and len(served) >= 150


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("{discovery: {dns: llm.svc, port: 0}}", "backends.main.discovery.port: must be"),
        ("{discovery: {dns: llm.svc, port: 80, interval_s: 0}}", "discovery.interval_s"),
        (
            '{url: "http://a", discovery: {dns: llm.svc, port: 80}}',
            "backends.main.discovery: give `url` (one instance) or `endpoints` or `discovery`",
        ),
        ("{timeout_s: 5}", "backends.main.url: is required (or `endpoints` or `discovery`)"),
    ],
)
def test_discovery_settings_that_cannot_work_are_refused(backend: str, message: str) -> None:
    found = problems_of(f"backends:\n  main: {backend}\nroutes: [{{backend: main}}]\n")
    assert any(message in p for p in found), found
