"""A backend as several endpoints: each its own pool, picked by `balance` (round robin
in turn, least request by the power of two choices), an endpoint that cannot be reached
skipped without failing the request, one that keeps failing ejected for the breaker's open
time and then tried again, the policy's `url`/`endpoints` rules, and the endpoint metrics."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import Callable

import httpx
import pytest
from aiohttp import web

from gateway.errors import ConnectFailed
from gateway.metrics import Metrics
from gateway.openai.prefix import leading_key
from gateway.policy.model import (
    Backend,
    CircuitBreaker,
    ModelPool,
    TelemetrySource,
    WarmupRequest,
)
from gateway.testing import FakeClock, FakeTransport, json_reply
from gateway.transport import load
from gateway.transport.endpoints import EndpointSet
from tests.helpers import problems_of, until, write_policy


def named(name: str, gate: asyncio.Event | None = None, status: int = 200) -> web.Application:
    """An instance that answers its own name (after ``gate``, when given)."""

    async def handle(_: web.Request) -> web.Response:
        if gate is not None:
            await gate.wait()
        return web.json_response({"served_by": name}, status=status)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def recording(name: str, seen: list[str]) -> web.Application:
    """An instance that answers its name and notes each request's path in ``seen``."""

    async def handle(request: web.Request) -> web.Response:
        seen.append(f"{name} {request.path}")
        return web.json_response({"served_by": name})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens once closed


async def served_by(endpoints: EndpointSet, backend: Backend) -> tuple[int, str]:
    reply = await endpoints.send(backend, "GET", "/", [], b"", streaming=False)
    assert reply.body is not None
    return reply.status, reply.body.decode()


async def test_round_robin_takes_each_endpoint_in_turn(serve_app) -> None:
    urls = [await serve_app(named(n)) for n in "abc"]
    backend = Backend("m", endpoints=tuple(urls), balance="round_robin")
    endpoints = EndpointSet(backend, Metrics())
    try:
        served = [(await served_by(endpoints, backend))[1] for _ in range(9)]
    finally:
        await endpoints.aclose()
    assert sorted(served) == sorted([f'{{"served_by": "{n}"}}' for n in "abc"] * 3)
    assert len(set(served[:3])) == 3


async def test_least_request_sends_the_next_request_where_fewer_are_in_flight(
    serve_app,
) -> None:
    gate = asyncio.Event()
    urls = [await serve_app(named(n, gate)) for n in "abc"]
    backend = Backend("m", endpoints=tuple(urls))
    assert backend.balance == "least_request"
    metrics = Metrics()
    endpoints = EndpointSet(backend, metrics, rng=random.Random(3))
    tasks = []
    try:
        for n in range(1, 4):  # each waits at its instance, so in-flight counts stay put
            tasks.append(asyncio.create_task(served_by(endpoints, backend)))
            while endpoints.inflight < n:
                await asyncio.sleep(0)
        # of any two drawn, a busy one loses to an idle one: three requests, three instances
        assert sorted(e.inflight for e in endpoints.endpoints) == [1, 1, 1]
        text = metrics.exposition().decode()
        assert f'gateway_endpoint_inflight{{backend="m",endpoint="{urls[0]}"}} 1.0' in text
        gate.set()
        answers = await asyncio.gather(*tasks)
    finally:
        gate.set()
        await endpoints.aclose()
    assert len({body for _, body in answers}) == 3


async def test_an_unreachable_endpoint_costs_no_request_and_is_ejected_then_retried(
    serve_app,
) -> None:
    up = await serve_app(named("up"))
    dead = closed_port()
    clock = FakeClock()
    backend = Backend(
        "m",
        endpoints=(dead, up),
        balance="round_robin",
        circuit_breaker=CircuitBreaker(consecutive_failures=2, open_s=30),
    )
    metrics = Metrics()
    endpoints = EndpointSet(backend, metrics, clock=clock)
    try:
        answers = [await served_by(endpoints, backend) for _ in range(8)]
        assert all(status == 200 and "up" in body for status, body in answers)
        gone = endpoints.endpoints[0]
        assert gone.ejected_until and gone.ejections == 1
        assert [e.url for e in endpoints.healthy()] == [up]
        text = metrics.exposition().decode()
        assert (
            f'gateway_endpoint_state{{backend="m",endpoint="{dead}",state="ejected"}} 1.0' in text
        )
        assert 'gateway_pool_active_endpoints{backend="m"} 1.0' in text
        clock.advance(30)
        assert len(endpoints.healthy()) == 2  # its open time is over: tried again
        assert "healthy=2/2" in repr(endpoints)
    finally:
        await endpoints.aclose()


async def test_every_endpoint_unreachable_fails_with_a_connect_error(serve_app) -> None:
    backend = Backend("m", endpoints=(closed_port(), closed_port()))
    endpoints = EndpointSet(backend, Metrics())
    try:
        with pytest.raises(ConnectFailed):
            await served_by(endpoints, backend)
    finally:
        await endpoints.aclose()


async def test_an_endpoint_answering_5xx_is_ejected_and_the_backend_stays_up(serve_app) -> None:
    bad = await serve_app(named("bad", status=500))
    good = await serve_app(named("good"))
    clock = FakeClock()
    backend = Backend(
        "m",
        endpoints=(bad, good),
        balance="round_robin",
        circuit_breaker=CircuitBreaker(consecutive_failures=2, open_s=10),
    )
    endpoints = EndpointSet(backend, Metrics(), clock=clock)
    try:
        statuses = [(await served_by(endpoints, backend))[0] for _ in range(10)]
        assert statuses.count(500) == 2  # two in a row eject it; then only "good" answers
        assert statuses[-6:] == [200] * 6
        clock.advance(10)
        statuses = [(await served_by(endpoints, backend))[0] for _ in range(2)]
        assert 500 in statuses  # back in rotation after its open time
    finally:
        await endpoints.aclose()


async def test_a_gateway_spreads_a_route_over_the_endpoints(
    serve_app, start_gateway, tmp_path
) -> None:
    urls = [await serve_app(named(n)) for n in "ab"]
    policy = write_policy(
        tmp_path,
        {
            "backends": {"main": {"endpoints": urls, "balance": "round_robin"}},
            "routes": [{"backend": "main"}],
        },
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        served = [(await client.get(gw.url + "/x")).json()["served_by"] for _ in range(4)]
    assert sorted(served) == ["a", "a", "b", "b"]
    text = gw.gateway.metrics.exposition().decode()
    for url in urls:
        assert (
            f'gateway_endpoint_requests_total{{backend="main",endpoint="{url}",status="2xx"}} 2.0'
            in text
        )


@pytest.mark.parametrize(
    ("backend", "message"),
    [
        ("{timeout_s: 5}", "backends.main.url: is required (or `endpoints`"),
        (
            '{url: "http://a", endpoints: ["http://b"]}',
            "backends.main.endpoints: give `url` (one instance) or `endpoints` or `discovery`",
        ),
        ('{endpoints: ["http://a", "ftp://b"]}', "backends.main.endpoints[1]: must start"),
        ('{endpoints: ["http://a", "http://a/"]}', "an endpoint is listed twice"),
        ('{endpoints: ["http://a", "http://b"], pool: {core: 0}}', "backends.main.pool.core"),
        (
            '{endpoints: ["http://a", "http://b"], pool: {core: 2, max: 1}}',
            "backends.main.pool.max: must not be below pool.core",
        ),
        (
            "{endpoints: [" + ", ".join(f'"http://h{i}"' for i in range(65)) + "]}",
            "at most 64 endpoints per backend",
        ),
        ('{endpoints: ["http://a"], balance: random}', "backends.main.balance"),
    ],
)
def test_endpoint_settings_that_cannot_work_are_refused(backend: str, message: str) -> None:
    found = problems_of(f"backends:\n  main: {backend}\nroutes: [{{backend: main}}]\n")
    assert any(message in p for p in found), found


async def test_warm_up_reaches_every_endpoint_before_ready(serve_app, start_gateway, tmp_path):
    seen: list[str] = []
    urls = [await serve_app(recording(n, seen)) for n in "abc"]
    policy = write_policy(
        tmp_path,
        {
            "backends": {
                "main": {"endpoints": urls, "warmup": [{"path": "/v1/models", "method": "GET"}]}
            },
            "routes": [{"backend": "main"}],
        },
    )
    gw = await start_gateway(policy=policy)
    await until(lambda: gw.gateway.warm)
    assert sorted(seen) == ["a /v1/models", "b /v1/models", "c /v1/models"]


def chat_body(system: str, user: str) -> bytes:
    return json.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
        }
    ).encode()


async def test_prefix_affinity_keeps_a_leading_context_on_one_endpoint(serve_app) -> None:
    """8 system prompts over 3 instances, none saturated: every request of a prefix lands
    where its first one did; a different later turn keeps the prefix's endpoint."""
    urls = [await serve_app(named(n)) for n in "abc"]
    backend = Backend("m", endpoints=tuple(urls), prefix_affinity=True)
    endpoints = EndpointSet(backend, Metrics(), rng=random.Random(5))
    landed: dict[str, list[str]] = {}
    try:
        for turn in range(10):
            for p in range(8):
                body = json.loads(chat_body(f"you are assistant {p}", "hello"))
                body["messages"].append({"role": "user", "content": f"turn {turn}"})
                key = leading_key(body)
                reply = await endpoints.send(
                    backend,
                    "POST",
                    "/",
                    [],
                    json.dumps(body).encode(),
                    streaming=False,
                    affinity=key,
                )
                assert reply.body is not None
                landed.setdefault(f"p{p}", []).append(json.loads(reply.body)["served_by"])
    finally:
        await endpoints.aclose()
    for served in landed.values():
        assert len(set(served)) == 1  # >= 90% asked; unsaturated, it is all of them
    assert len({s[0] for s in landed.values()}) >= 2  # the prefixes spread over instances
    assert endpoints.affinity_hits == 72


async def test_a_busy_affine_endpoint_gives_way(serve_app) -> None:
    gate = asyncio.Event()
    urls = [await serve_app(named(n, gate)) for n in "ab"]
    backend = Backend("m", endpoints=tuple(urls), prefix_affinity=True)
    endpoints = EndpointSet(backend, Metrics(), rng=random.Random(1))
    held = []
    try:
        first = endpoints.pick(affinity="k")
        for _ in range(5):  # five in flight on it, none elsewhere: more than the slack
            held.append(
                asyncio.create_task(first.pool.send(backend, "GET", "/", [], b"", streaming=False))
            )
        await until(lambda: first.inflight == 5)
        assert endpoints.pick(affinity="k") is not first
        gate.set()
        await asyncio.gather(*held)
        assert endpoints.pick(affinity="k") is first  # the overflow left its home as it was
    finally:
        gate.set()
        await asyncio.gather(*held)
        await endpoints.aclose()


async def test_the_forward_hands_the_leading_key_only_where_prefix_affinity_is_on(
    pipeline,
) -> None:
    transport = FakeTransport(lambda sent: json_reply({"ok": True}))
    body = json.loads(chat_body("sys", "hi"))
    gw = await pipeline(
        {
            "backends": {
                "on": {"endpoints": ["http://a", "http://b"], "prefix_affinity": True},
                "off": {"url": "http://c"},
            },
            "routes": [
                {"match": {"path": "/v1/chat/completions", "model": "m"}, "backend": "on"},
                {"match": {"path": "*"}, "backend": "off"},
            ],
        },
        transport,
    )
    await gw.post("/v1/chat/completions", body)
    await gw.post("/v1/chat/completions", {**body, "model": "other"})
    on, off = transport.to("on")[0], transport.to("off")[0]
    assert on.affinity == leading_key(body) and on.affinity is not None
    assert off.affinity is None


def reporting(name: str, figures: dict[str, float]) -> web.Application:
    """An instance that answers its name and serves vLLM's load figures at /metrics."""
    return exporting(
        name,
        lambda: (
            f"vllm:num_requests_waiting {figures['waiting']}\n"
            f"vllm:kv_cache_usage_perc {figures['kv']}\n"
        ),
    )


def exporting(name: str, text: Callable[[], str]) -> web.Application:
    """An instance that answers its name and serves ``text()`` at /metrics."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=text())

    async def handle(_: web.Request) -> web.Response:
        return web.json_response({"served_by": name})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def kv_aware(urls: list[str], clock: FakeClock, seed: int) -> tuple[Backend, EndpointSet]:
    """A kv_aware backend over ``urls``, scraped every 200 ms of ``clock``, its loop on."""
    backend = Backend(
        "m", endpoints=tuple(urls), balance="kv_aware", telemetry=TelemetrySource(interval_ms=200)
    )
    endpoints = EndpointSet(backend, Metrics(), clock=clock, rng=random.Random(seed))
    endpoints.watch_load()
    return backend, endpoints


async def next_scrape(clock: FakeClock) -> None:
    """Let the watcher's next round start: once it sleeps on the clock (a round may still be
    scraping when the test changes a figure; time moved before its sleep would be lost)."""
    await until(lambda: clock.sleepers == 1)
    clock.advance(0.2)


async def test_kv_aware_leaves_out_a_saturated_endpoint_until_it_clears(serve_app) -> None:
    figures = {n: {"waiting": 0.0, "kv": 0.2} for n in "abc"}
    figures["c"]["kv"] = 0.95
    urls = [await serve_app(reporting(n, figures[n])) for n in "abc"]
    clock = FakeClock()
    backend, endpoints = kv_aware(urls, clock, seed=2)
    try:
        await until(lambda: all(e.kv_cache_usage is not None for e in endpoints.endpoints))
        served = [(await served_by(endpoints, backend))[1] for _ in range(60)]
        assert sum('"c"' in s for s in served) <= 3  # <= 5% while saturated: here none
        figures["c"]["kv"] = 0.1
        await next_scrape(clock)
        await until(lambda: endpoints.endpoints[2].kv_cache_usage == 0.1)
        served = [(await served_by(endpoints, backend))[1] for _ in range(60)]
        assert sum('"c"' in s for s in served) >= 10  # its share returns
        for n in "abc":
            figures[n]["waiting"] = 9.0  # every one saturated: still served, least loaded
        await next_scrape(clock)
        await until(lambda: all(e.queue_waiting == 9.0 for e in endpoints.endpoints))
        assert (await served_by(endpoints, backend))[0] == 200
    finally:
        await endpoints.aclose()


async def test_a_pool_keeps_core_in_rotation_and_brings_standby_in_warm_then_returns_it(
    serve_app,
) -> None:
    """`pool: {core: 1, scale_up_inflight: 2, idle_timeout_s: 60}` over three instances:
    only the core one answers at first; with two requests held in flight the next standby
    one is warmed (its warm-up answered) and only then takes requests; after an idle minute
    (fake clock) it is back on standby."""
    gate = asyncio.Event()
    warmed: list[str] = []

    def instance(name: str) -> web.Application:
        async def handle(request: web.Request) -> web.Response:
            if request.path == "/warm":
                warmed.append(name)
            elif request.path == "/gated":
                await gate.wait()
            return web.json_response({"served_by": name})

        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        return app

    urls = [await serve_app(instance(n)) for n in "abc"]
    clock = FakeClock()
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        pool=ModelPool(core=1, scale_up_inflight=2, idle_timeout_s=60),
        warmup=(WarmupRequest("/warm", "GET"),),
    )
    endpoints = EndpointSet(backend, Metrics(), clock=clock, rng=random.Random(4))
    roles = lambda: [e.role for e in endpoints.endpoints]  # noqa: E731
    held: list[asyncio.Task] = []
    try:
        assert roles() == ["active", "standby", "standby"]
        assert {(await served_by(endpoints, backend))[1] for _ in range(4)} == {
            '{"served_by": "a"}'
        }
        for _ in range(2):
            held.append(
                asyncio.create_task(
                    endpoints.send(backend, "GET", "/gated", [], b"", streaming=False)
                )
            )
        await until(lambda: endpoints.inflight == 2)
        await served_by(endpoints, backend)  # the pick that sees the load
        await until(lambda: roles() == ["active", "active", "standby"])
        assert warmed == ["b"]  # warmed before it took any request
        served = {(await served_by(endpoints, backend))[1] for _ in range(10)}
        assert '{"served_by": "b"}' in served
        gate.set()
        await asyncio.gather(*held)
        clock.advance(61)
        assert (await served_by(endpoints, backend))[1] == '{"served_by": "a"}'
        assert roles() == ["active", "standby", "standby"]
        assert endpoints.sizing is not None and endpoints.sizing.demotions == 1
    finally:
        gate.set()
        await endpoints.aclose()


async def test_with_a_pool_warm_up_at_start_warms_only_the_core(
    serve_app, start_gateway, tmp_path
) -> None:
    seen: list[str] = []
    urls = [await serve_app(recording(n, seen)) for n in "abc"]
    policy = write_policy(
        tmp_path,
        {
            "backends": {
                "main": {
                    "endpoints": urls,
                    "pool": {"core": 2},
                    "warmup": [{"path": "/v1/models", "method": "GET"}],
                }
            },
            "routes": [{"backend": "main"}],
        },
    )
    gw = await start_gateway(policy=policy)
    await until(lambda: gw.gateway.warm)
    assert sorted(seen) == ["a /v1/models", "b /v1/models"]


async def test_a_forecast_that_wants_more_endpoints_warms_standby_ones_before_load(
    serve_app,
) -> None:
    """With `Demand` asking for two endpoints (a prewarm forecast), the next standby one is
    warmed and brought in on an unloaded pick: before the peak, not when it arrives."""
    seen: list[str] = []
    urls = [await serve_app(recording(n, seen)) for n in "ab"]
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        pool=ModelPool(core=1, scale_up_inflight=100),
        warmup=(WarmupRequest("/warm", "GET"),),
    )
    demand = {"m": lambda: 1}
    endpoints = EndpointSet(backend, Metrics(), demand=demand)
    try:
        await served_by(endpoints, backend)
        assert [e.role for e in endpoints.endpoints] == ["active", "standby"]  # 1 wanted
        demand["m"] = lambda: 2
        await served_by(endpoints, backend)
        await until(lambda: [e.role for e in endpoints.endpoints] == ["active", "active"])
        assert "b /warm" in seen
    finally:
        await endpoints.aclose()


async def test_an_idle_core_endpoint_is_kept_warm_every_half_idle_timeout(serve_app) -> None:
    seen: list[str] = []
    urls = [await serve_app(recording(n, seen)) for n in "ab"]
    clock = FakeClock()
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        pool=ModelPool(core=1, idle_timeout_s=60),
        warmup=(WarmupRequest("/warm", "GET"),),
    )
    endpoints = EndpointSet(backend, Metrics(), clock=clock)
    endpoints.keep_warm()
    try:
        await until(lambda: clock.sleepers == 1)
        clock.advance(30)  # idle for half the timeout: one warm-up to the core endpoint
        await until(lambda: "a /warm" in seen)
        assert "b /warm" not in seen  # standby endpoints are warmed when brought in
        await until(lambda: clock.sleepers == 1)
        clock.advance(15)
        await served_by(endpoints, backend)  # a request 15 s before the next tick
        seen.clear()
        clock.advance(15)  # the tick: idle only 15 s, so no warm-up is sent
        await until(lambda: clock.sleepers == 1)
        assert seen == []
        clock.advance(30)  # idle 45 s at this tick: warmed again
        await until(lambda: seen == ["a /warm"])
        assert endpoints.sizing is not None and endpoints.sizing.keep_warms == 2
    finally:
        await endpoints.aclose()


@pytest.mark.parametrize(
    ("status", "text"),
    [
        (500, "boom"),
        (200, "vllm:kv_cache_usage_perc{ not prometheus at all\n\x00\xff"),
        (200, "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_waiting +Inf\n"),
    ],
    ids=["5xx", "garbage", "nan-inf"],
)
async def test_a_broken_metrics_endpoint_is_neither_trusted_nor_fatal(
    serve_app, status: int, text: str
) -> None:
    """kv_aware over an instance whose /metrics fails or lies: no figure is taken from it
    that would leave it out for nothing, the scrape loop keeps running, requests answer."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(status=status, text=text)

    async def answer(_: web.Request) -> web.Response:
        return web.json_response({"served_by": "x"})

    broken = web.Application()
    broken.router.add_get("/metrics", metrics)
    broken.router.add_route("*", "/{tail:.*}", answer)
    urls = [await serve_app(broken), await serve_app(named("ok"))]
    clock = FakeClock()
    backend, endpoints = kv_aware(urls, clock, seed=3)
    try:
        await until(lambda: clock.sleepers == 1)  # one scrape round done
        bad = endpoints.endpoints[0]
        assert not load.saturated(bad, backend)
        clock.advance(0.2)
        await until(lambda: clock.sleepers == 1)  # and the loop goes on
        served = {(await served_by(endpoints, backend))[1] for _ in range(12)}
        assert len(served) == 2  # the broken one still takes its share
    finally:
        await endpoints.aclose()


def test_the_leading_key_is_the_system_prompt_else_the_first_turn() -> None:
    """Every conversation under one system prompt shares its key (they all start with its
    tokens); without one, a conversation's turns share its first message's."""

    def chat(*messages: tuple[str, str], model: str = "m") -> dict:
        return {"model": model, "messages": [{"role": r, "content": c} for r, c in messages]}

    sys_a = ("system", "You are A.")
    assert leading_key(chat(sys_a, ("user", "q1"))) == leading_key(chat(sys_a, ("user", "q2")))
    assert leading_key(chat(sys_a, ("user", "q1"))) != leading_key(
        chat(("system", "You are B."), ("user", "q1"))
    )
    assert leading_key(chat(sys_a, ("user", "q"))) != leading_key(
        chat(sys_a, ("user", "q"), model="other")
    )
    first = chat(("user", "hello"), ("assistant", "hi"), ("user", "more"))
    assert leading_key(first) == leading_key(chat(("user", "hello")))
    assert leading_key(chat(("developer", "Be terse."), ("user", "x"))) == leading_key(
        chat(("developer", "Be terse."), ("user", "y"))
    )
    assert leading_key({"messages": "not a list"}) is None


async def test_kv_aware_affinity_gives_way_while_its_server_is_saturated(serve_app) -> None:
    """A prefix's server queueing requests (over ``saturation``) sends the prefix elsewhere
    while another has room; once it clears, the prefix is back home."""
    figures = {n: {"waiting": 0.0, "kv": 0.1} for n in "ab"}
    urls = [await serve_app(reporting(n, figures[n])) for n in "ab"]
    clock = FakeClock()
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        balance="kv_aware",
        prefix_affinity=True,
        telemetry=TelemetrySource(interval_ms=200),
    )
    endpoints = EndpointSet(backend, Metrics(), clock=clock, rng=random.Random(3))
    endpoints.watch_load()
    try:
        await until(lambda: all(e.queue_waiting == 0.0 for e in endpoints.endpoints))
        home = endpoints.pick(affinity="k")
        other = next(e for e in endpoints.endpoints if e is not home)
        assert endpoints.pick(affinity="k") is home
        name = "ab"[endpoints.endpoints.index(home)]
        figures[name]["waiting"] = 9.0
        await next_scrape(clock)
        await until(lambda: home.queue_waiting == 9.0)
        assert {endpoints.pick(affinity="k") for _ in range(5)} == {other}
        figures[name]["waiting"] = 0.0
        await next_scrape(clock)
        await until(lambda: home.queue_waiting == 0.0)
        assert endpoints.pick(affinity="k") is home
    finally:
        await endpoints.aclose()


async def test_a_pinned_request_goes_to_its_endpoint_and_to_no_other(serve_app) -> None:
    """A request naming what one endpoint holds (``pin``) goes there whatever the balance
    says, ejected or not; if that endpoint cannot be reached it is not tried elsewhere
    (another would say it has no such thing); a pin no endpoint matches any more is
    balanced as any request."""
    a, b, gone = await serve_app(named("a")), await serve_app(named("b")), closed_port()
    backend = Backend("m", endpoints=(a, b, gone), balance="round_robin")
    metrics = Metrics()
    endpoints = EndpointSet(backend, metrics)

    async def pinned(url: str) -> str:
        reply = await endpoints.send(
            backend, "GET", "/", [], b"", streaming=False, pin=lambda u: u == url
        )
        assert reply.body is not None
        return json.loads(reply.body)["served_by"]

    try:
        assert [await pinned(b) for _ in range(4)] == ["b"] * 4
        endpoints.endpoints[1].ejected_until = float("inf")  # b ejected: still b's to answer
        assert await pinned(b) == "b"
        with pytest.raises(ConnectFailed):
            await pinned(gone)
        assert endpoints.endpoints[2].failures == 1  # tried once, and nothing else tried
        assert endpoints.endpoints[0].pool.inflight == 0
        assert await pinned("http://127.0.0.1:1") == "a"  # left: balanced (b is ejected)
    finally:
        await endpoints.aclose()
    pins = metrics.endpoint_pins
    assert pins.labels("m", "kept")._value.get() == 6
    assert pins.labels("m", "gone")._value.get() == 1
