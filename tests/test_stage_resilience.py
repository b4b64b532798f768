"""The resilience stage through a running gateway: admission queue, priorities, client
disconnects, rate limits, circuit breaker transitions, Retry-After, and reloads that change
limits under load.  Time comes from a FakeClock wherever it matters.

The helpers at the top (a steerable backend, a telemetry exporter, policy files) are shared
with ``test_fallback.py`` and ``test_gpu_*.py``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import yaml
from aiohttp import web

from gateway.resilience.stage import GUARDS
from gateway.testing import FakeClock
from tests.helpers import until

# -- helpers ---------------------------------------------------------------------------


class Model:
    """A small OpenAI-style backend a test steers: the status it answers, a gate that holds
    calls until let through, a stream that breaks, the logprobs it reports.  ``arrivals``
    holds each call's last user message, in arrival order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.retry_after: str | None = None
        self.gate: asyncio.Semaphore | None = None
        self.arrivals: list[str] = []
        self.active = 0
        self.max_active = 0
        self.break_stream_after: int | None = None
        self.logprob = -0.1
        self.bodies: list[dict[str, Any]] = []
        self.mid_stream: asyncio.Event | None = None

    def hold(self) -> None:
        """Hold every call until ``let`` lets it through."""
        self.gate = asyncio.Semaphore(0)

    def let(self, n: int = 1) -> None:
        assert self.gate is not None
        for _ in range(n):
            self.gate.release()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        data = await request.json()
        self.bodies.append(data)
        self.arrivals.append(data["messages"][-1]["content"])
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if self.gate is not None:
                await self.gate.acquire()
            if self.status != 200:
                headers = {"Retry-After": self.retry_after} if self.retry_after else {}
                error = {"error": {"message": f"{self.name} fails", "type": "server_error"}}
                return web.json_response(error, status=self.status, headers=headers)
            if data.get("stream"):
                return await self._stream(request)
            content = [{"token": "w", "logprob": self.logprob}] * 4
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": f"{self.name} answers"},
                "logprobs": {"content": content} if data.get("logprobs") else None,
                "finish_reason": "stop",
            }
            usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
            return web.json_response(
                {"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage}
            )
        finally:
            self.active -= 1

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(6):
            if self.break_stream_after is not None and i == self.break_stream_after:
                assert request.transport is not None
                request.transport.close()  # the backend dies mid-stream
                return response
            chunk = {"choices": [{"index": 0, "delta": {"content": f"{self.name}{i} "}}]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if i == 0 and self.mid_stream is not None:
                await self.mid_stream.wait()  # the stream has started; it goes on when set
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


class Exporter:
    """A DCGM exporter and a vLLM ``/metrics`` in one; the test sets the values, and
    ``broken`` makes the scrape answer 500."""

    def __init__(self) -> None:
        self.temperature = 50.0
        self.fb_used_mib = 10000
        self.fb_free_mib = 70000
        self.kv_cache = 0.1
        self.waiting = 0
        self.broken = False
        self.scrapes = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.broken:
            return web.Response(status=500, text="exporter down")
        labels = 'gpu="0",UUID="GPU-1",device="nvidia0",modelName="H100",Hostname="n"'
        lines = [
            f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} {self.temperature}",
            f"DCGM_FI_DEV_FB_USED{{{labels}}} {self.fb_used_mib}",
            f"DCGM_FI_DEV_FB_FREE{{{labels}}} {self.fb_free_mib}",
            f"DCGM_FI_DEV_GPU_UTIL{{{labels}}} 90",
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {self.kv_cache}',
            f'vllm:num_requests_waiting{{model_name="m"}} {self.waiting}',
        ]
        return web.Response(text="\n".join(lines) + "\n")


def chat(tag: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": tag}], **extra}


def write_policy(path: Path, policy: dict[str, Any]) -> Path:
    file = path / "policy.yaml"
    file.write_text(yaml.safe_dump(policy, sort_keys=False))
    return file


def policy(
    backends: dict[str, dict[str, Any]], route: dict[str, Any] | None = None, **more: Any
) -> dict[str, Any]:
    """A policy whose one route (chat) goes to the first backend."""
    first = next(iter(backends))
    routes = [{"name": "chat", "match": {"path": "/v1/*"}, "backend": first, **(route or {})}]
    return {"backends": backends, "routes": routes, **more}


async def post(client: httpx.AsyncClient, url: str, tag: str = "hello", **kw: Any):
    headers = kw.pop("headers", None)
    return await client.post(url + "/v1/chat/completions", json=chat(tag, **kw), headers=headers)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in a Prometheus exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            got = series[len(name) :].strip("{}")
            if ",".join(sorted(got.split(","))) == want or (not labels and not got):
                return float(value)
    return None


async def metrics_of(client: httpx.AsyncClient, gw: Any) -> str:
    return (await client.get(gw.admin_url + "/metrics")).text


# -- admission ---------------------------------------------------------------------------


async def test_a_full_queue_answers_503_at_once_with_retry_after(
    serve_app, start_gateway, tmp_path
):
    main = Model("main")
    main.hold()
    url = await serve_app(main.app())
    backends = {"main": {"url": url, "max_concurrency": 1, "queue": {"capacity": 1}}}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends)))
    async with httpx.AsyncClient(timeout=10) as client:
        first = asyncio.create_task(post(client, gw.url, "first"))
        await until(lambda: main.active == 1)
        second = asyncio.create_task(post(client, gw.url, "second"))
        admission = gw.gateway.registry.peek(GUARDS, "main").admission
        await until(lambda: admission.depth == 1)
        refused = await post(client, gw.url, "third")
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "overloaded"
        assert int(refused.headers["Retry-After"]) >= 1
        main.let(2)
        assert (await first).status_code == 200
        assert (await second).status_code == 200
        text = await metrics_of(client, gw)
    assert main.arrivals == ["first", "second"]
    assert metric(text, "gateway_shed_total", backend="main", reason="queue_full") == 1
    assert metric(text, "gateway_queue_depth", backend="main") == 0


async def test_a_queue_timeout_answers_503_with_retry_after(serve_app, start_gateway, tmp_path):
    clock = FakeClock()
    main = Model("main")
    main.hold()
    url = await serve_app(main.app())
    backends = {
        "main": {"url": url, "max_concurrency": 1, "queue": {"capacity": 5, "timeout_ms": 2000}}
    }
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends)), clock=clock)
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient(timeout=10) as client:
        first = asyncio.create_task(post(client, gw.url, "first"))
        await until(lambda: main.active == 1)
        queued = asyncio.create_task(post(client, gw.url, "queued"))
        await until(lambda: admission.depth == 1)
        clock.advance(1.9)
        assert admission.expire_due() == 0
        clock.advance(0.2)
        assert admission.expire_due() == 1
        timed_out = await queued
        assert timed_out.status_code == 503
        assert "timed out in the queue" in timed_out.json()["error"]["message"]
        assert int(timed_out.headers["Retry-After"]) >= 1
        main.let()
        assert (await first).status_code == 200
        text = await metrics_of(client, gw)
    assert main.arrivals == ["first"]
    assert metric(text, "gateway_shed_total", backend="main", reason="queue_timeout") == 1


async def test_queued_calls_go_upstream_by_priority_from_the_x_priority_header(
    serve_app, start_gateway, tmp_path
):
    main = Model("main")
    main.hold()
    url = await serve_app(main.app())
    backends = {"main": {"url": url, "max_concurrency": 1, "queue": {"capacity": 10}}}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends)))
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient(timeout=10) as client:
        tasks = [asyncio.create_task(post(client, gw.url, "busy"))]
        await until(lambda: main.active == 1)
        for n, (tag, priority) in enumerate(
            [
                ("low-1", "low"),
                ("normal-1", "normal"),
                ("high-1", "high"),
                ("low-2", "LOW"),
                ("high-2", "High"),
                ("bogus", "urgent"),
            ]
        ):
            headers = {"X-Priority": priority}
            tasks.append(asyncio.create_task(post(client, gw.url, tag, headers=headers)))
            await until(lambda n=n: admission.depth == n + 1)
        for _ in range(len(tasks)):
            main.let()
        answers = await asyncio.gather(*tasks)
    assert [a.status_code for a in answers] == [200] * len(tasks)
    # An unknown X-Priority falls back to the route's priority (normal), FIFO within one.
    assert main.arrivals == ["busy", "high-1", "high-2", "normal-1", "bogus", "low-1", "low-2"]


async def test_a_higher_priority_call_sheds_the_newest_lowest_waiter_of_a_full_queue(
    serve_app, start_gateway, tmp_path
):
    main = Model("main")
    main.hold()
    url = await serve_app(main.app())
    backends = {"main": {"url": url, "max_concurrency": 1, "queue": {"capacity": 2}}}
    route = {"priority": "low"}  # the route's own priority; the header overrides it
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, route)))
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient(timeout=10) as client:
        busy = asyncio.create_task(post(client, gw.url, "busy"))
        await until(lambda: main.active == 1)
        low_1 = asyncio.create_task(post(client, gw.url, "low-1"))
        await until(lambda: admission.depth == 1)
        low_2 = asyncio.create_task(post(client, gw.url, "low-2"))
        await until(lambda: admission.depth == 2)
        high = asyncio.create_task(post(client, gw.url, "high", headers={"X-Priority": "high"}))
        shed = await low_2
        assert shed.status_code == 503 and "Retry-After" in shed.headers
        main.let(3)
        assert [r.status_code for r in await asyncio.gather(busy, low_1, high)] == [200] * 3
    assert main.arrivals == ["busy", "high", "low-1"]


async def test_a_queued_client_that_disconnects_leaves_the_queue_at_once(
    serve_app, start_gateway, tmp_path
):
    main = Model("main")
    main.hold()
    url = await serve_app(main.app())
    backends = {"main": {"url": url, "max_concurrency": 1, "queue": {"capacity": 5}}}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends)))
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient(timeout=10) as client:
        busy = asyncio.create_task(post(client, gw.url, "busy"))
        await until(lambda: main.active == 1)
        async with httpx.AsyncClient(timeout=10) as impatient:
            leaving = asyncio.create_task(post(impatient, gw.url, "leaving"))
            await until(lambda: admission.depth == 1)
            leaving.cancel()
        await until(lambda: admission.depth == 0)
        assert admission.in_flight == 1
        after = asyncio.create_task(post(client, gw.url, "after"))
        await until(lambda: admission.depth == 1)
        main.let(2)
        assert (await busy).status_code == 200
        assert (await after).status_code == 200
    assert main.arrivals == ["busy", "after"]


async def test_a_stream_holds_its_slot_until_it_ends(serve_app, start_gateway, tmp_path):
    main = Model("main")
    main.mid_stream = asyncio.Event()
    url = await serve_app(main.app())
    backends = {"main": {"url": url, "max_concurrency": 1, "queue": {"capacity": 5}}}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends)))
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream(
            "POST", gw.url + "/v1/chat/completions", json=chat("streamed", stream=True)
        ) as stream:
            assert stream.status_code == 200
            after = asyncio.create_task(post(client, gw.url, "after"))
            await until(lambda: admission.depth == 1)
            assert main.arrivals == ["streamed"]
            main.mid_stream.set()
            body = await stream.aread()
        assert b"[DONE]" in body
        assert (await after).status_code == 200
    assert main.arrivals == ["streamed", "after"]
    assert admission.in_flight == 0


async def test_a_reload_changes_limits_for_new_admissions_and_fails_nothing_in_flight(
    serve_app, start_gateway, tmp_path
):
    main = Model("main")
    main.hold()
    url = await serve_app(main.app())

    def backends(limit: int) -> dict[str, Any]:
        return {"main": {"url": url, "max_concurrency": limit, "queue": {"capacity": 10}}}

    file = write_policy(tmp_path, policy(backends(1)))
    gw = await start_gateway(policy=file, watch_interval_s=3600)
    admission = gw.gateway.registry.peek(GUARDS, "main").admission
    async with httpx.AsyncClient(timeout=10) as client:
        tasks = [asyncio.create_task(post(client, gw.url, f"r{i}")) for i in range(3)]
        await until(lambda: main.active == 1 and admission.depth == 2)
        write_policy(tmp_path, policy(backends(2)))
        assert gw.gateway.reload()
        assert gw.gateway.registry.peek(GUARDS, "main").admission is admission
        await until(lambda: main.active == 2 and admission.depth == 1)
        write_policy(tmp_path, policy(backends(1)))
        assert gw.gateway.reload()
        main.let()  # one finishes: 1 in flight, not below the new limit of 1
        await until(lambda: main.active == 1)
        assert admission.depth == 1 and admission.in_flight == 1
        main.let(5)
        answers = await asyncio.gather(*tasks)
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert main.max_active == 2


# -- rate limits ---------------------------------------------------------------------------


async def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_others_do_not(
    serve_app, start_gateway, tmp_path
):
    clock = FakeClock()
    main = Model("main")
    url = await serve_app(main.app())
    route = {"rate_limit": {"requests_per_s": 1, "burst": 2}}
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy({"main": {"url": url}}, route)), clock=clock
    )
    alice = {"Authorization": "Bearer alice"}
    bob = {"Authorization": "Bearer bob"}
    async with httpx.AsyncClient(timeout=10) as client:
        assert (await post(client, gw.url, headers=alice)).status_code == 200
        assert (await post(client, gw.url, headers=alice)).status_code == 200
        over = await post(client, gw.url, headers=alice)
        assert over.status_code == 429
        assert over.json()["error"]["type"] == "rate_limit_error"
        assert over.headers["Retry-After"] == "1"
        assert (await post(client, gw.url, headers=bob)).status_code == 200
        clock.advance(1.0)
        assert (await post(client, gw.url, headers=alice)).status_code == 200
        assert (await post(client, gw.url, headers=alice)).status_code == 429
        text = await metrics_of(client, gw)
    assert metric(text, "gateway_rate_limited_total", route="chat") == 2
    assert len(main.arrivals) == 4


async def test_a_tokens_per_minute_limit_settles_on_the_answers_usage(
    serve_app, start_gateway, tmp_path
):
    clock = FakeClock()
    main = Model("main")
    url = await serve_app(main.app())
    route = {"rate_limit": {"tokens_per_min": 300}}
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy({"main": {"url": url}}, route)), clock=clock
    )
    async with httpx.AsyncClient(timeout=10) as client:
        # Each call is estimated at body/4 + max_tokens = about 120 tokens; usage says 14.
        statuses = [(await post(client, gw.url, max_tokens=100)).status_code for _ in range(6)]
    assert statuses == [200] * 6  # without settling, the third would be refused


# -- the circuit breaker ---------------------------------------------------------------------


async def test_breaker_opens_on_failures_probes_after_open_s_and_closes(
    serve_app, start_gateway, tmp_path
):
    clock = FakeClock()
    main = Model("main")
    main.status = 500
    url = await serve_app(main.app())
    breaker = {
        "failure_rate": 0.5,
        "min_calls": 4,
        "window_s": 10,
        "open_s": 5,
        "half_open_calls": 2,
    }
    backends = {"main": {"url": url, "circuit_breaker": breaker}}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends)), clock=clock)
    guard = gw.gateway.registry.peek(GUARDS, "main")
    async with httpx.AsyncClient(timeout=10) as client:
        statuses = [(await post(client, gw.url)).status_code for _ in range(4)]
        assert statuses == [500] * 4  # no fallback: the backend's own errors pass through
        assert guard.breaker.state == "open"
        refused = await post(client, gw.url)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "circuit_open"
        assert refused.headers["Retry-After"] == "5"
        assert refused.headers["X-Gateway-Backend"] == "main"
        assert len(main.arrivals) == 4
        clock.advance(5.0)
        assert guard.breaker.state == "half_open"
        assert "probes=0ok+0out/2" in repr(guard)
        main.status = 200
        assert (await post(client, gw.url)).status_code == 200
        assert (await post(client, gw.url)).status_code == 200
        assert guard.breaker.state == "closed"
        text = await metrics_of(client, gw)
    assert metric(text, "gateway_breaker_state", backend="main") == 0
    for state in ("open", "half_open", "closed"):
        assert metric(text, "gateway_breaker_transitions_total", backend="main", to=state) == 1
    assert metric(text, "gateway_shed_total", backend="main", reason="circuit_open") == 1


async def test_half_open_lets_at_most_half_open_calls_probes_through(
    serve_app, start_gateway, tmp_path
):
    clock = FakeClock()
    main, spare = Model("main"), Model("spare")
    main.status = 500
    main_url, spare_url = await serve_app(main.app()), await serve_app(spare.app())
    breaker = {"min_calls": 2, "window_s": 10, "open_s": 5, "half_open_calls": 2}
    backends = {"main": {"url": main_url, "circuit_breaker": breaker}, "spare": {"url": spare_url}}
    route = {"fallback": ["spare"]}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, route)), clock=clock)
    guard = gw.gateway.registry.peek(GUARDS, "main")
    async with httpx.AsyncClient(timeout=10) as client:
        for _ in range(2):
            assert (await post(client, gw.url)).status_code == 200
        assert guard.breaker.state == "open"
        for cycle in range(3):
            clock.advance(5.0)
            main.hold()
            burst = [asyncio.create_task(post(client, gw.url, f"c{cycle}")) for _ in range(6)]
            await until(lambda: main.active == 2)
            main.let(2)  # both probes fail: open again for another open_s
            answers = await asyncio.gather(*burst)
            assert [a.status_code for a in answers] == [200] * 6
            assert all(a.headers["X-Gateway-Backend"] == "spare" for a in answers)
            assert guard.breaker.state == "open"
            main.gate = None
    probes = [a for a in main.arrivals if a.startswith("c")]
    assert len(probes) == 3 * 2  # half_open_calls per open_s, never more


async def test_429_and_503_from_the_backend_never_trip_the_breaker(
    serve_app, start_gateway, tmp_path
):
    main = Model("main")
    url = await serve_app(main.app())
    breaker = {"min_calls": 2, "window_s": 10, "open_s": 5}
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy({"main": {"url": url, "circuit_breaker": breaker}}))
    )
    guard = gw.gateway.registry.peek(GUARDS, "main")
    async with httpx.AsyncClient(timeout=10) as client:
        for status in (429, 503, 429, 503, 429):
            main.status = status
            answer = await post(client, gw.url)
            assert answer.status_code == status
            assert answer.headers["Retry-After"] == "1"  # added: the backend sent none
        main.status, main.retry_after = 503, "7"
        assert (await post(client, gw.url)).headers["Retry-After"] == "7"  # kept as sent
    assert guard.breaker.state == "closed"


def test_a_policy_without_resilience_settings_adds_no_stage():
    from gateway.clock import SYSTEM_CLOCK
    from gateway.metrics import Metrics
    from gateway.policy.load import zero_config_policy
    from gateway.resilience.stage import build
    from gateway.runtime import Runtime
    from gateway.state import Registry

    registry = Registry()
    runtime = Runtime(Metrics(), registry, SYSTEM_CLOCK, transport=None)  # type: ignore[arg-type]
    assert build(zero_config_policy("http://127.0.0.1:1"), runtime) == []
    assert repr(registry) == "<Registry {'gpu_control': 1}>"


async def test_a_slot_freed_while_a_cancelled_waiter_has_not_resumed_goes_to_the_next():
    """Regression: a client leaves (its task is cancelled) and, before that task runs again,
    a call finishes; the slot must pass to the next waiter, not fail the release."""
    from gateway.policy.model import Queue
    from gateway.resilience.admission import Admission, AdmissionConfig

    admission = Admission("main", AdmissionConfig(1, Queue(capacity=5)))
    ticket = await admission.acquire()
    leaving = asyncio.create_task(admission.acquire())
    staying = asyncio.create_task(admission.acquire())
    await until(lambda: admission.depth == 2)
    leaving.cancel()
    ticket.release()  # before the cancelled task has resumed
    second = await staying
    await asyncio.gather(leaving, return_exceptions=True)
    assert leaving.cancelled()
    assert admission.in_flight == 1 and admission.depth == 0
    second.release()
    assert admission.in_flight == 0
