"""Telemetry and throttle rules per endpoint (``telemetry.url`` with ``{host}``/``{port}``):
each instance is scraped at its own address, a rule firing on one instance takes it out of
rotation while the others serve, and the backend's own rule acts (here: sheds) only when
every instance is over it.  And ``saturation`` sets ``kv_aware``'s limits."""

from __future__ import annotations

import random

import httpx
from aiohttp import web

from gateway.metrics import Metrics
from gateway.policy.model import Backend, Saturation, TelemetrySource, ThrottleRule, When
from gateway.testing import FakeClock
from gateway.transport import load
from gateway.transport.endpoints import EndpointSet
from tests.helpers import metric, problems_of, until, write_policy
from tests.test_endpoints import reporting, served_by


def hot(name: str, celsius: dict[str, float], path: str = "/gpu") -> web.Application:
    """An instance that answers its name and serves a DCGM temperature at ``path``."""

    async def gpu(_: web.Request) -> web.Response:
        return web.Response(text=f'DCGM_FI_DEV_GPU_TEMP{{gpu="0"}} {celsius[name]}\n')

    async def handle(_: web.Request) -> web.Response:
        return web.json_response({"served_by": name})

    app = web.Application()
    app.router.add_get(path, gpu)
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def test_the_scrape_urls_put_in_each_endpoints_host_and_port() -> None:
    backend = Backend(
        "m",
        endpoints=("http://10.0.0.7:8000", "http://[fd00::1]:8000", "https://llm"),
        telemetry=TelemetrySource(
            source="prometheus",
            url="http://{host}:9400/metrics",
            extra_urls=("http://{host}:{port}/metrics",),
        ),
    )
    assert load.templated(backend)
    assert load.scrape_urls("http://10.0.0.7:8000", backend) == (
        "http://10.0.0.7:9400/metrics",
        "http://10.0.0.7:8000/metrics",
    )
    assert load.scrape_urls("http://[fd00::1]:8000", backend)[0] == "http://[fd00::1]:9400/metrics"
    assert load.scrape_urls("https://llm", backend)[1] == "http://llm:443/metrics"
    plain = Backend("p", endpoints=("http://a:1", "http://b:1"), balance="kv_aware")
    assert not load.templated(plain)
    assert load.scrape_urls("http://a:1", plain) == ("http://a:1/metrics",)


async def test_a_hot_instance_is_out_of_rotation_until_it_cools(
    serve_app, start_gateway, tmp_path
) -> None:
    celsius = {"a": 60.0, "b": 62.0, "c": 91.0}
    urls = [await serve_app(hot(n, celsius)) for n in "abc"]
    policy = write_policy(
        tmp_path,
        {
            "backends": {
                "main": {
                    "endpoints": urls,
                    "telemetry": {
                        "source": "prometheus",
                        "url": "http://{host}:{port}/gpu",
                        "interval_ms": 50,
                    },
                }
            },
            "routes": [{"backend": "main"}],
            "throttle": [
                {
                    "name": "hot",
                    "backend": "main",
                    "when": {"signal": "gpu_temperature_c", "above": 85, "clear_below": 80},
                    "action": "shed",
                }
            ],
        },
    )
    gw = await start_gateway(policy=policy)
    endpoints = gw.gateway.transport.endpoint_set("main")
    assert endpoints is not None

    def text() -> str:
        return gw.gateway.metrics.exposition().decode()

    def state(url: str) -> float | None:
        line = f'gateway_endpoint_state{{backend="main",endpoint="{url}",state="throttled"}} '
        found = [x for x in text().splitlines() if x.startswith(line)]
        return float(found[0].split()[-1]) if found else None

    async with httpx.AsyncClient() as client:
        await until(lambda: state(urls[2]) == 1.0)
        shown = metric(
            text(),
            "gateway_endpoint_signal",
            backend="main",
            endpoint=urls[2],
            signal="gpu_temperature_c",
        )
        assert shown == 91.0  # each endpoint's own reading, as a series of its own
        served = [(await client.get(gw.url + "/x")).json()["served_by"] for _ in range(30)]
        assert "c" not in served and set(served) == {"a", "b"}  # the backend stays up

        celsius["c"] = 83.0  # under `above`, over `clear_below`: hysteresis holds it out
        await until(lambda: endpoints.endpoints[2].signals.get("gpu_temperature_c") == 83.0)
        assert state(urls[2]) == 1.0
        celsius["c"] = 70.0
        await until(lambda: state(urls[2]) == 0.0)
        served = [(await client.get(gw.url + "/x")).json()["served_by"] for _ in range(30)]
        assert "c" in served

        celsius.update(a=90.0, b=90.0, c=92.0)  # every instance hot: the backend's rule sheds
        await until(
            lambda: metric(text(), "gateway_throttle_active", backend="main", rule="hot") == 1.0
        )
        r = await client.get(gw.url + "/x")
        assert r.status_code == 503 and "Retry-After" in r.headers


async def test_telemetry_at_another_address_is_read_over_a_pool_of_its_own(serve_app) -> None:
    """A node's exporter on another port than the model server (``{host}`` only): read
    there, and the model server's own pool carries none of it."""
    celsius = {"a": 95.0, "b": 40.0}
    exporter = await serve_app(hot("a", celsius, "/metrics"))
    port = exporter.rsplit(":", 1)[1]
    urls = [await serve_app(reporting(n, {"waiting": 0.0, "kv": 0.1})) for n in "ab"]
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        telemetry=TelemetrySource(
            source="prometheus", url="http://{host}:" + port + "/metrics", interval_ms=200
        ),
    )
    clock = FakeClock()
    endpoints = EndpointSet(backend, Metrics(), clock=clock, rng=random.Random(1))
    endpoints.watch_load()
    try:
        await until(lambda: clock.sleepers == 1)
        assert [e.signals.get("gpu_temperature_c") for e in endpoints.endpoints] == [95.0, 95.0]
        assert all(e.pool.inflight == 0 and e.kv_cache_usage is None for e in endpoints.endpoints)
        assert endpoints.scraped_at == clock.now()
    finally:
        await endpoints.aclose()


async def test_saturation_sets_kv_awares_limits(serve_app) -> None:
    figures = {"a": {"waiting": 0.0, "kv": 0.1}, "b": {"waiting": 0.0, "kv": 0.6}}
    urls = [await serve_app(reporting(n, figures[n])) for n in "ab"]
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        balance="kv_aware",
        saturation=Saturation(queue_waiting=2, kv_cache_usage=0.5),
        telemetry=TelemetrySource(interval_ms=200),
    )
    clock = FakeClock()
    endpoints = EndpointSet(backend, Metrics(), clock=clock, rng=random.Random(4))
    endpoints.watch_load()
    try:
        await until(lambda: all(e.kv_cache_usage is not None for e in endpoints.endpoints))
        served = [(await served_by(endpoints, backend))[1] for _ in range(20)]
        assert all('"a"' in s for s in served)  # 0.6 is over this backend's 0.5
    finally:
        await endpoints.aclose()


def test_telemetry_url_placeholders_and_saturation_are_checked() -> None:
    base = '{endpoints: ["http://a", "http://b"], telemetry: {source: prometheus, url: '
    found = problems_of(
        f"backends:\n  main: {base}" + '"http://{pod}:9400/metrics"}}\nroutes: [{backend: main}]'
    )
    assert any("telemetry.url: only {host} and {port}" in p for p in found), found
    found = problems_of(
        'backends:\n  main: {endpoints: ["http://a", "http://b"], '
        "saturation: {kv_cache_usage: 1.5}}\nroutes: [{backend: main}]"
    )
    assert any("backends.main.saturation" in p for p in found), found


async def test_a_metrics_endpoint_that_never_answers_costs_one_interval(serve_app) -> None:
    """An exporter that accepts and hangs: its endpoint's figures go unknown after one
    telemetry interval (the rule that fired on them clears: fail open), the scrape loop goes
    on, and requests still answer."""
    import asyncio

    hang = asyncio.Event()
    celsius = {"a": 95.0, "b": 40.0}

    async def gpu(_: web.Request) -> web.Response:
        if hang.is_set():
            await asyncio.sleep(30)
        return web.Response(text=f'DCGM_FI_DEV_GPU_TEMP{{gpu="0"}} {celsius["a"]}\n')

    async def handle(_: web.Request) -> web.Response:
        return web.json_response({"served_by": "a"})

    app = web.Application()
    app.router.add_get("/gpu", gpu)
    app.router.add_route("*", "/{tail:.*}", handle)
    urls = [await serve_app(app), await serve_app(hot("b", celsius))]
    backend = Backend(
        "m",
        endpoints=tuple(urls),
        telemetry=TelemetrySource(
            source="prometheus", url="http://{host}:{port}/gpu", interval_ms=100
        ),
    )
    rule = ThrottleRule("hot", "m", When("gpu_temperature_c", above=85, clear_below=80))
    metrics = Metrics()
    endpoints = EndpointSet(backend, metrics, rng=random.Random(2))
    endpoints.rules = (rule,)
    endpoints.watch_load()
    try:
        await until(lambda: endpoints.endpoints[0].throttled == {"hot"})
        hang.set()
        hung = endpoints.endpoints[0]
        await until(lambda: not hung.signals and not hung.throttled, timeout_s=3)  # fail open
        await until(lambda: f'endpoint="{urls[0]}",signal=' not in metrics.exposition().decode())
        assert endpoints.endpoints[1].signals == {"gpu_temperature_c": 40.0}  # still read
        assert (await served_by(endpoints, backend))[0] == 200
    finally:
        await endpoints.aclose()
