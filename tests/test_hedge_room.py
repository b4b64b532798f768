"""A hedge is a call in flight like any other: it is held to the backend's
``max_concurrency``, goes before no queued call, and is not made while a throttle rule
sheds or reroutes the backend or its breaker is not closed (``Call.spare``,
``BackendGuard.spare``).  Model servers on real sockets; the official ``openai`` SDK as the
client."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai

from gateway.metrics import Metrics
from gateway.policy.backend import CircuitBreaker
from gateway.policy.model import Backend
from gateway.resilience.admission import Priority
from gateway.resilience.breaker import Outcome
from gateway.resilience.guard import BackendGuard
from gateway.resilience.stage import GUARDS
from gateway.resilience.throttle import Decision
from gateway.testing import FakeClock
from tests.helpers import metric, policy, until, write_policy
from tests.test_hedge import Server


async def gateway_of(serve_app: Any, start_gateway: Any, tmp_path: Any, cap: int) -> Any:
    """A slow and a fast server behind one hedged backend capped at ``cap`` calls in flight;
    round robin asks the slow one first."""
    slow, fast = Server("slow"), Server("fast")
    urls = [await serve_app(slow.app()), await serve_app(fast.app())]
    backend = {
        "endpoints": urls,
        "balance": "round_robin",
        "hedge": {"after_ms": 30},
        "max_concurrency": cap,
        "queue": {"capacity": 8, "timeout_ms": 10_000},
    }
    gw = await start_gateway(policy=write_policy(tmp_path, policy({"m": backend})))
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    return gw, client, slow, fast


async def hedges(gw: Any, outcome: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(gw.admin_url + "/metrics")).text
    return metric(text, "gateway_hedges_total", backend="m", kind="answer", outcome=outcome) or 0


async def test_a_call_holding_the_backends_last_slot_is_not_hedged(
    serve_app, start_gateway, tmp_path
):
    gw, client, slow, fast = await gateway_of(serve_app, start_gateway, tmp_path, cap=1)
    slow.gate = fast.gate = asyncio.Event()  # whichever is asked holds the call
    try:
        call = asyncio.ensure_future(client.embeddings.create(model="m", input="q"))
        await until(lambda: slow.calls + fast.calls == 1)
        for _ in range(20):  # the hedge falls due after 30 ms, and finds no room
            if await hedges(gw, "no_room") == 1:
                break
            await asyncio.sleep(0.02)
        assert await hedges(gw, "no_room") == 1
        assert slow.calls + fast.calls == 1  # one call in flight: the cap
        slow.gate.set()
        await call
    finally:
        await client.close()
    assert await hedges(gw, "won") + await hedges(gw, "lost") == 0


async def test_a_hedge_takes_a_free_slot_and_a_call_arriving_meanwhile_waits_its_turn(
    serve_app, start_gateway, tmp_path
):
    gw, client, slow, fast = await gateway_of(serve_app, start_gateway, tmp_path, cap=2)
    slow.gate, fast.gate = asyncio.Event(), asyncio.Event()
    try:
        first = asyncio.ensure_future(client.embeddings.create(model="m", input="q1"))
        await until(lambda: slow.calls + fast.calls == 2)  # hedged: two in flight
        second = asyncio.ensure_future(client.embeddings.create(model="m", input="q2"))
        async with httpx.AsyncClient() as http:

            async def queued() -> float:
                text = (await http.get(gw.admin_url + "/metrics")).text
                return metric(text, "gateway_queue_depth", backend="m") or 0

            for _ in range(50):
                if await queued() == 1:
                    break
                await asyncio.sleep(0.02)
            assert await queued() == 1  # the cap holds the newcomer, hedge included
        assert slow.calls + fast.calls == 2
        fast.gate.set()
        assert (await first).model == "fast"
        await until(lambda: slow.left + fast.left == 1)  # the loser is cancelled, its slot
        await second  # given back: the newcomer is admitted (and may be hedged itself)
        assert slow.calls + fast.calls >= 3
    finally:
        slow.gate.set()
        await client.close()
    assert await hedges(gw, "won") + await hedges(gw, "lost") >= 1


async def test_a_guard_gives_no_room_to_a_hedge_when_full_shedding_or_its_breaker_is_open():
    clock = FakeClock()
    guard = BackendGuard("m", Metrics(), clock)
    breaker = CircuitBreaker(consecutive_failures=1, open_s=10, half_open_calls=1)
    backend = Backend("m", url="http://127.0.0.1:1", max_concurrency=2, circuit_breaker=breaker)
    guard.configure(backend, needs_admission=False)
    held = await guard.enter(Priority.NORMAL)
    release = guard.spare()
    assert release is not None  # the second slot
    assert guard.spare() is None  # two in flight: the cap
    release()
    release()  # a release given twice frees one slot only
    assert guard.admission is not None and guard.admission.in_flight == 1
    guard.apply(Decision("shed", "hot"))
    assert guard.spare() is None  # a rule shedding the backend's calls
    guard.apply(Decision())
    held.record(Outcome.FAILURE)  # opens the breaker
    held.release()
    assert guard.spare() is None  # open
    clock.advance(10)
    assert guard.breaker is not None and guard.breaker.state == "half_open"
    assert guard.spare() is None  # half-open: a hedge is no probe
    unbounded = BackendGuard("n", Metrics(), clock)
    unbounded.configure(Backend("n", url="http://127.0.0.1:1"), needs_admission=False)
    assert unbounded.spare() is not None  # nothing to hold it to but its max_ratio


async def test_a_client_leaving_mid_race_frees_both_slots_and_both_calls(
    serve_app, start_gateway, tmp_path
):
    gw, client, slow, fast = await gateway_of(serve_app, start_gateway, tmp_path, cap=2)
    slow.gate, fast.gate = asyncio.Event(), asyncio.Event()
    try:
        call = asyncio.ensure_future(client.embeddings.create(model="m", input="q"))
        await until(lambda: slow.calls + fast.calls == 2)  # the race is on
        admission = gw.gateway.registry.peek(GUARDS, "m").admission
        assert admission.in_flight == 2
        call.cancel()  # the client leaves
        await until(lambda: slow.left + fast.left == 2)  # both model servers see it leave
        await until(lambda: admission.in_flight == 0)  # the call's slot and the hedge's
    finally:
        await client.close()


async def test_the_access_log_says_how_a_calls_hedge_went(
    serve_app, start_gateway, tmp_path, capsys
):
    slow, fast = Server("slow"), Server("fast")
    urls = [await serve_app(slow.app()), await serve_app(fast.app())]
    backend = {"endpoints": urls, "balance": "round_robin", "hedge": {"after_ms": 30}}
    doc = policy({"m": backend}, server={"access_log": True})
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    slow.gate = asyncio.Event()  # whichever call lands there first is hedged to the other
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0)
    try:
        answers = [await client.embeddings.create(model="m", input=f"q{i}") for i in range(2)]
    finally:
        slow.gate.set()
        await client.close()
    assert {a.model for a in answers} == {"fast"}
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    hedged = [line for line in lines if "hedge" in line]
    assert [(h["hedge"], h["upstream_attempts"]) for h in hedged] == [("won", 2)]
    assert all("hedge" not in line for line in lines if line.get("upstream_attempts") is None)
