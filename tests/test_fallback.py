"""Fallback routing: order, reasons, the no-fallback-after-first-byte rule, the retry
budget, and quality fallback on low-confidence answers.  The gateway runs without sockets
(``gateway.testing.harness.Pipeline``), its backends ``Model``s behind a ``FakeTransport``; the
quality fallback is also shown end to end against the simulated GPU."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from gateway.errors import UpstreamTimeout, UpstreamUnavailable
from gateway.pipeline import Reply
from gateway.resilience.stage import RETRY_BUDGET
from gateway.sim import SimConfig, start_sim
from gateway.testing import FakeClock, Sent
from tests.backends import Model, post
from tests.helpers import chat, metric, policy, until, write_policy

CHAT = "/v1/chat/completions"


def three() -> tuple[Model, Model, Model, dict[str, dict[str, Any]]]:
    models = Model("main"), Model("first"), Model("second")
    backends: dict[str, dict[str, Any]] = {m.name: {"url": f"http://{m.name}.test"} for m in models}
    return *models, backends


def answering(*models: Model) -> dict[str, Model]:
    return {m.name: m for m in models}


async def test_fallbacks_are_tried_in_order_and_the_header_says_why(pipeline) -> None:
    main, first, second, backends = three()
    main.status, first.status = 500, 502
    route = {"fallback": ["first", "second"]}
    gw = await pipeline(policy(backends, route), answering(main, first, second))
    answer = await post(gw, "q")
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == "second answers"
    assert answer.headers["X-Gateway-Backend"] == "second"
    assert answer.headers["X-Gateway-Fallback"] == "upstream_5xx"
    assert (main.arrivals, first.arrivals, second.arrivals) == (["q"], ["q"], ["q"])
    assert gw.metric("gateway_fallbacks_total", route="chat", reason="upstream_5xx") == 1


async def test_a_primary_that_answers_is_used_and_no_fallback_header_is_set(pipeline) -> None:
    main, first, _, backends = three()
    gw = await pipeline(policy(backends, {"fallback": ["first"]}), answering(main, first))
    answer = await post(gw)
    assert answer.headers["X-Gateway-Backend"] == "main"
    assert "X-Gateway-Fallback" not in answer.headers
    assert first.arrivals == []


async def test_the_last_candidates_failure_reaches_the_client_as_it_was(pipeline) -> None:
    main, first, _, backends = three()
    main.status, first.status = 500, 503
    gw = await pipeline(policy(backends, {"fallback": ["first"]}), answering(main, first))
    answer = await post(gw)
    assert answer.status_code == 503
    assert answer.json()["error"]["message"] == "first fails"
    assert answer.headers["X-Gateway-Backend"] == "first"
    assert answer.headers["X-Gateway-Fallback"] == "upstream_5xx"
    assert answer.headers["Retry-After"] == "1"


async def test_a_refused_connection_and_a_timeout_fall_back(pipeline) -> None:
    _, first, _, backends = three()
    failures = [UpstreamUnavailable("connection refused"), UpstreamTimeout("timed out")]

    def main(sent: Sent) -> Reply:
        raise failures.pop(0)

    gw = await pipeline(policy(backends, {"fallback": ["first"]}), {"main": main, "first": first})
    refused, late = await post(gw), await post(gw)
    assert refused.headers["X-Gateway-Fallback"] == "unavailable"
    assert late.status_code == 200
    assert late.headers["X-Gateway-Fallback"] == "timeout"
    assert late.headers["X-Gateway-Backend"] == "first"


async def test_a_stream_that_started_is_never_replaced_even_when_it_breaks(pipeline) -> None:
    main, first, _, backends = three()
    main.break_stream_after = 2
    gw = await pipeline(policy(backends, {"fallback": ["first"]}), answering(main, first))
    answer = await post(gw, stream=True)
    assert answer.status_code == 200 and answer.headers["X-Gateway-Backend"] == "main"
    assert b"main0" in answer.body and b"main1" in answer.body
    assert not answer.complete  # cut: the connection closed without the last chunk
    assert b"[DONE]" not in answer.body
    assert first.arrivals == []
    assert gw.transport.open_streams == 0


async def test_a_stream_whose_backend_answers_5xx_before_any_byte_falls_back(pipeline) -> None:
    main, first, _, backends = three()
    main.status = 503
    gw = await pipeline(policy(backends, {"fallback": ["first"]}), answering(main, first))
    answer = await post(gw, stream=True)
    assert answer.status_code == 200 and answer.complete
    assert answer.headers["X-Gateway-Backend"] == "first"
    assert answer.headers["X-Gateway-Fallback"] == "upstream_5xx"
    assert b"first0" in answer.body and b"[DONE]" in answer.body


async def test_the_retry_budget_caps_retries_but_not_breaker_redirects(pipeline) -> None:
    main, first, _, backends = three()
    main.status = 500
    backends["main"]["circuit_breaker"] = {"min_calls": 3, "window_s": 10, "open_s": 30}
    route = {"fallback": ["first"]}
    budget = {"ratio": 0.0, "min_retries_per_s": 0.2, "window_s": 10}  # 2 retries in 10 s
    gw = await pipeline(
        policy(backends, route, retry_budget=budget), answering(main, first), clock=FakeClock()
    )
    answers = [await post(gw) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 500]  # the third: budget spent
    assert answers[2].headers["X-Gateway-Backend"] == "main"
    # The breaker is open now: sending elsewhere is not a retry, the budget is not asked.
    redirected = [await post(gw) for _ in range(5)]
    assert [a.status_code for a in redirected] == [200] * 5
    assert {a.headers["X-Gateway-Fallback"] for a in redirected} == {"circuit_open"}
    budget_state = gw.gateway.registry.peek(RETRY_BUDGET)
    assert "retries=2" in repr(budget_state) and "denied=1" in repr(budget_state)
    assert len(main.arrivals) == 3


async def test_a_primary_failing_with_5xx_shows_clients_no_error(pipeline) -> None:
    """The target: zero client-visible errors for non-streaming requests while the primary
    fails and a fallback exists (the default retry budget covers the calls before the
    breaker opens; after that, redirects do not spend it)."""
    main, first, _, backends = three()
    main.status = 500
    backends["main"]["circuit_breaker"] = {"min_calls": 10, "window_s": 10, "open_s": 30}
    gw = await pipeline(policy(backends, {"fallback": ["first"]}), answering(main, first))

    async def worker(n: int) -> list[int]:
        return [(await post(gw, f"{n}")).status_code for _ in range(25)]

    statuses = [s for batch in await asyncio.gather(*map(worker, range(8))) for s in batch]
    assert statuses == [200] * 200
    assert len(main.arrivals) < 20


async def test_queue_full_on_the_primary_overflows_to_the_fallback(pipeline) -> None:
    main, first, _, backends = three()
    main.hold()
    backends["main"].update({"max_concurrency": 1, "queue": {"capacity": 0}})
    budget = {"ratio": 0.0, "min_retries_per_s": 0.0}  # overflow is not a retry
    gw = await pipeline(
        policy(backends, {"fallback": ["first"]}, retry_budget=budget), answering(main, first)
    )
    busy = gw.send("POST", CHAT, json=chat("busy"))
    await until(lambda: main.active == 1)
    overflow = await post(gw, "overflow")
    main.let()
    assert (await busy.done()).headers["X-Gateway-Backend"] == "main"
    assert overflow.status_code == 200
    assert overflow.headers["X-Gateway-Backend"] == "first"
    assert overflow.headers["X-Gateway-Fallback"] == "queue_full"


# -- quality fallback --------------------------------------------------------------------


async def test_a_low_confidence_answer_is_replaced_by_the_fallbacks_end_to_end(
    start_gateway, tmp_path
) -> None:
    small = await start_sim(SimConfig(port=0, base_ms=1, token_ms=0, confidence=0.2))
    large = await start_sim(SimConfig(port=0, base_ms=1, token_ms=0, confidence=0.95))
    try:
        backends = {"small": {"url": small.url}, "large": {"url": large.url}}
        route = {"fallback": ["large"], "quality": {"min_mean_logprob": -0.5}}
        gw = await start_gateway(policy=write_policy(tmp_path, policy(backends, route)))
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(gw.url + CHAT, json=chat("Is it in stock?"))
            text = (await client.get(gw.admin_url + "/metrics")).text
    finally:
        await small.close()
        await large.close()
    assert answer.status_code == 200
    assert answer.headers["X-Gateway-Backend"] == "large"
    assert answer.headers["X-Gateway-Fallback"] == "low_confidence"
    assert answer.json()["choices"][0]["logprobs"] is None  # the client did not ask
    assert small.state()["calls"] == 1 and large.state()["calls"] == 1
    assert metric(text, "gateway_fallbacks_total", route="chat", reason="low_confidence") == 1


async def test_a_confident_answer_stays_and_logprobs_show_only_when_asked(pipeline) -> None:
    main, first, _, backends = three()
    main.logprob = -0.05
    route = {"fallback": ["first"], "quality": {"min_mean_logprob": -0.5}}
    gw = await pipeline(policy(backends, route), answering(main, first))
    plain = await post(gw)
    asked = await post(gw, logprobs=True)
    streamed = await post(gw, stream=True)
    assert plain.headers["X-Gateway-Backend"] == "main"
    assert plain.json()["choices"][0]["logprobs"] is None
    assert main.bodies[0]["logprobs"] is True  # the gateway asked for them
    assert asked.json()["choices"][0]["logprobs"]["content"][0]["logprob"] == -0.05
    assert "logprobs" not in main.bodies[2]  # streams are not judged: nothing asked
    assert streamed.status_code == 200 and first.arrivals == []


async def test_quality_fallback_spends_the_retry_budget_and_keeps_the_answer_when_spent(
    pipeline,
) -> None:
    main, first, _, backends = three()
    main.logprob = -3.0
    route = {"fallback": ["first"], "quality": {"min_mean_logprob": -0.5}}
    budget = {"ratio": 0.0, "min_retries_per_s": 0.1, "window_s": 10}  # one retry
    gw = await pipeline(policy(backends, route, retry_budget=budget), answering(main, first))
    replaced = await post(gw)
    kept = await post(gw)
    assert replaced.headers["X-Gateway-Backend"] == "first"
    assert kept.status_code == 200 and kept.headers["X-Gateway-Backend"] == "main"
    assert kept.json()["choices"][0]["logprobs"] is None  # still stripped


def test_reasons_are_documented() -> None:
    from gateway.resilience.stage import FALLBACK_REASONS, RETRY_REASONS

    assert RETRY_REASONS <= set(FALLBACK_REASONS)
    assert json.dumps(FALLBACK_REASONS)
