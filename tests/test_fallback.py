"""Fallback routing through a running gateway: order, reasons, the no-fallback-after-first-
byte rule, the retry budget, and quality fallback on low-confidence answers."""

from __future__ import annotations

import asyncio
import json

import httpx

from gateway.resilience.stage import RETRY_BUDGET
from gateway.sim import SimConfig, start_sim
from gateway.testing import FakeClock
from tests.helpers import until
from tests.test_stage_resilience import (
    Model,
    metric,
    metrics_of,
    policy,
    post,
    write_policy,
)


async def three(serve_app) -> tuple[Model, Model, Model, dict[str, dict[str, str]]]:
    models = Model("main"), Model("first"), Model("second")
    urls = [await serve_app(m.app()) for m in models]
    backends = {m.name: {"url": u} for m, u in zip(models, urls, strict=True)}
    return *models, backends  # type: ignore[return-value]


async def test_fallbacks_are_tried_in_order_and_the_header_says_why(
    serve_app, start_gateway, tmp_path
):
    main, first, second, backends = await three(serve_app)
    main.status, first.status = 500, 502
    route = {"fallback": ["first", "second"]}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, route)))
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await post(client, gw.url, "q")
        text = await metrics_of(client, gw)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "second answers"
    assert answer.headers["X-Gateway-Backend"] == "second"
    assert answer.headers["X-Gateway-Fallback"] == "upstream_5xx"
    assert (main.arrivals, first.arrivals, second.arrivals) == (["q"], ["q"], ["q"])
    assert metric(text, "gateway_fallbacks_total", route="chat", reason="upstream_5xx") == 1


async def test_a_primary_that_answers_is_used_and_no_fallback_header_is_set(
    serve_app, start_gateway, tmp_path
):
    _main, first, _, backends = await three(serve_app)
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    )
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await post(client, gw.url)
    assert answer.headers["X-Gateway-Backend"] == "main"
    assert "X-Gateway-Fallback" not in answer.headers
    assert first.arrivals == []


async def test_the_last_candidates_failure_reaches_the_client_as_it_was(
    serve_app, start_gateway, tmp_path
):
    main, first, _, backends = await three(serve_app)
    main.status, first.status = 500, 503
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    )
    async with httpx.AsyncClient(timeout=10) as client:
        answer = await post(client, gw.url)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "first fails"
    assert answer.headers["X-Gateway-Backend"] == "first"
    assert answer.headers["X-Gateway-Fallback"] == "upstream_5xx"
    assert answer.headers["Retry-After"] == "1"


async def test_a_refused_connection_and_a_timeout_fall_back(
    serve_app, start_gateway, tmp_path, unused_tcp_port
):
    main, _first, _, backends = await three(serve_app)
    backends["main"] = {"url": f"http://127.0.0.1:{unused_tcp_port}"}
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    )
    async with httpx.AsyncClient(timeout=10) as client:
        refused = await post(client, gw.url)
    assert refused.headers["X-Gateway-Fallback"] == "unavailable"
    main.hold()  # never answers: the backend's timeout fires
    backends["main"] = {"url": await serve_app(main.app()), "timeout_s": 0.2}
    write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    gw.gateway.reload()
    async with httpx.AsyncClient(timeout=10) as client:
        late = await post(client, gw.url)
    assert late.status_code == 200
    assert late.headers["X-Gateway-Fallback"] == "timeout"
    assert late.headers["X-Gateway-Backend"] == "first"


async def test_a_stream_that_started_is_never_replaced_even_when_it_breaks(
    serve_app, start_gateway, tmp_path
):
    main, first, _, backends = await three(serve_app)
    main.break_stream_after = 2
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    )
    async with httpx.AsyncClient(timeout=10) as client:
        received = b""
        try:
            async with client.stream(
                "POST", gw.url + "/v1/chat/completions", json={**_chat(), "stream": True}
            ) as response:
                assert response.status_code == 200
                assert response.headers["X-Gateway-Backend"] == "main"
                async for chunk in response.aiter_bytes():
                    received += chunk
        except httpx.RemoteProtocolError:
            pass  # the cut stream: the connection closed without the last chunk
    assert b"main0" in received and b"main1" in received
    assert b"[DONE]" not in received
    assert first.arrivals == []


async def test_a_stream_whose_backend_answers_5xx_before_any_byte_falls_back(
    serve_app, start_gateway, tmp_path
):
    main, _first, _, backends = await three(serve_app)
    main.status = 503
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    )
    async with httpx.AsyncClient(timeout=10) as client:
        async with client.stream(
            "POST", gw.url + "/v1/chat/completions", json={**_chat(), "stream": True}
        ) as response:
            body = await response.aread()
    assert response.status_code == 200
    assert response.headers["X-Gateway-Backend"] == "first"
    assert response.headers["X-Gateway-Fallback"] == "upstream_5xx"
    assert b"first0" in body and b"[DONE]" in body


async def test_the_retry_budget_caps_retries_but_not_breaker_redirects(
    serve_app, start_gateway, tmp_path
):
    clock = FakeClock()
    main, _first, _, backends = await three(serve_app)
    main.status = 500
    backends["main"]["circuit_breaker"] = {"min_calls": 3, "window_s": 10, "open_s": 30}
    route = {"fallback": ["first"]}
    budget = {"ratio": 0.0, "min_retries_per_s": 0.2, "window_s": 10}  # 2 retries in 10 s
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, route, retry_budget=budget)), clock=clock
    )
    async with httpx.AsyncClient(timeout=10) as client:
        answers = [await post(client, gw.url) for _ in range(3)]
        assert [a.status_code for a in answers] == [200, 200, 500]  # the third: budget spent
        assert answers[2].headers["X-Gateway-Backend"] == "main"
        # The breaker is open now: sending elsewhere is not a retry, the budget is not asked.
        redirected = [await post(client, gw.url) for _ in range(5)]
        assert [a.status_code for a in redirected] == [200] * 5
        assert {a.headers["X-Gateway-Fallback"] for a in redirected} == {"circuit_open"}
    budget_state = gw.gateway.registry.peek(RETRY_BUDGET)
    assert "retries=2" in repr(budget_state) and "denied=1" in repr(budget_state)
    assert len(main.arrivals) == 3


async def test_a_primary_failing_with_5xx_shows_clients_no_error(
    serve_app, start_gateway, tmp_path
):
    """The target: zero client-visible errors for non-streaming requests while the primary
    fails and a fallback exists (the default retry budget covers the calls before the
    breaker opens; after that, redirects do not spend it)."""
    main, _first, _, backends = await three(serve_app)
    main.status = 500
    backends["main"]["circuit_breaker"] = {"min_calls": 10, "window_s": 10, "open_s": 30}
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, {"fallback": ["first"]}))
    )
    async with httpx.AsyncClient(timeout=10) as client:

        async def worker(n: int) -> list[int]:
            return [(await post(client, gw.url, f"{n}")).status_code for _ in range(25)]

        statuses = [s for batch in await asyncio.gather(*map(worker, range(8))) for s in batch]
    assert statuses == [200] * 200
    assert len(main.arrivals) < 20


async def test_queue_full_on_the_primary_overflows_to_the_fallback(
    serve_app, start_gateway, tmp_path
):
    main, _first, _, backends = await three(serve_app)
    main.hold()
    backends["main"].update({"max_concurrency": 1, "queue": {"capacity": 0}})
    budget = {"ratio": 0.0, "min_retries_per_s": 0.0}  # overflow is not a retry
    gw = await start_gateway(
        policy=write_policy(
            tmp_path, policy(backends, {"fallback": ["first"]}, retry_budget=budget)
        )
    )
    async with httpx.AsyncClient(timeout=10) as client:
        busy = asyncio.create_task(post(client, gw.url, "busy"))
        await until(lambda: main.active == 1)
        overflow = await post(client, gw.url, "overflow")
        main.let()
        assert (await busy).headers["X-Gateway-Backend"] == "main"
    assert overflow.status_code == 200
    assert overflow.headers["X-Gateway-Backend"] == "first"
    assert overflow.headers["X-Gateway-Fallback"] == "queue_full"


# -- quality fallback --------------------------------------------------------------------


async def test_a_low_confidence_answer_is_replaced_by_the_fallbacks(start_gateway, tmp_path):
    small = await start_sim(SimConfig(port=0, base_ms=1, token_ms=0, confidence=0.2))
    large = await start_sim(SimConfig(port=0, base_ms=1, token_ms=0, confidence=0.95))
    try:
        backends = {"small": {"url": small.url}, "large": {"url": large.url}}
        route = {"fallback": ["large"], "quality": {"min_mean_logprob": -0.5}}
        gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, route)))
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await post(client, gw.url, "Is it in stock?")
            text = await metrics_of(client, gw)
    finally:
        await small.close()
        await large.close()
    assert answer.status_code == 200
    assert answer.headers["X-Gateway-Backend"] == "large"
    assert answer.headers["X-Gateway-Fallback"] == "low_confidence"
    assert answer.json()["choices"][0]["logprobs"] is None  # the client did not ask
    assert small.state()["calls"] == 1 and large.state()["calls"] == 1
    assert metric(text, "gateway_fallbacks_total", route="chat", reason="low_confidence") == 1


async def test_a_confident_answer_stays_and_logprobs_show_only_when_asked(
    serve_app, start_gateway, tmp_path
):
    main, first, _, backends = await three(serve_app)
    main.logprob = -0.05
    route = {"fallback": ["first"], "quality": {"min_mean_logprob": -0.5}}
    gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, route)))
    async with httpx.AsyncClient(timeout=10) as client:
        plain = await post(client, gw.url)
        asked = await post(client, gw.url, logprobs=True)
        streamed = await client.post(
            gw.url + "/v1/chat/completions", json={**_chat(), "stream": True}
        )
    assert plain.headers["X-Gateway-Backend"] == "main"
    assert plain.json()["choices"][0]["logprobs"] is None
    assert main.bodies[0]["logprobs"] is True  # the gateway asked for them
    assert asked.json()["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.05
    assert "logprobs" not in main.bodies[2]  # streams are not judged: nothing asked
    assert streamed.status_code == 200 and first.arrivals == []


async def test_quality_fallback_spends_the_retry_budget_and_keeps_the_answer_when_spent(
    serve_app, start_gateway, tmp_path
):
    main, _first, _, backends = await three(serve_app)
    main.logprob = -3.0
    route = {"fallback": ["first"], "quality": {"min_mean_logprob": -0.5}}
    budget = {"ratio": 0.0, "min_retries_per_s": 0.1, "window_s": 10}  # one retry
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy(backends, route, retry_budget=budget))
    )
    async with httpx.AsyncClient(timeout=10) as client:
        replaced = await post(client, gw.url)
        kept = await post(client, gw.url)
    assert replaced.headers["X-Gateway-Backend"] == "first"
    assert kept.status_code == 200 and kept.headers["X-Gateway-Backend"] == "main"
    assert kept.json()["choices"][0]["logprobs"] is None  # still stripped


def _chat() -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": "s"}]}


def test_reasons_are_documented():
    from gateway.resilience.stage import FALLBACK_REASONS, RETRY_REASONS

    assert RETRY_REASONS <= set(FALLBACK_REASONS)
    assert json.dumps(FALLBACK_REASONS)
