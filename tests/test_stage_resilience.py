"""The resilience stage: admission queue, priorities, client disconnects, rate limits,
circuit breaker transitions, Retry-After, and reloads that change limits under load.  The
gateway runs without sockets (``gateway.testing.harness.Pipeline``) in front of steerable ``Model``
backends; time comes from a FakeClock wherever it matters.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.policy import parse_policy_text
from gateway.resilience.admission import Priority
from gateway.resilience.stage import GUARDS
from gateway.testing import FakeClock
from gateway.testing.harness import Pipeline
from tests.backends import Model, post, started
from tests.helpers import chat, policy, until, write_policy

CHAT = "/v1/chat/completions"
URL = "http://main.test"


def admission_of(gw: Pipeline) -> Any:
    guard = gw.gateway.registry.peek(GUARDS, "main")
    assert guard is not None and guard.admission is not None
    return guard.admission


# -- admission ---------------------------------------------------------------------------


async def test_a_full_queue_answers_503_at_once_with_retry_after(pipeline):
    main = Model("main")
    main.hold()
    backends = {"main": {"url": URL, "max_concurrency": 1, "queue": {"capacity": 1}}}
    gw = await pipeline(policy(backends), main)
    first = started(gw, "first")
    await until(lambda: main.active == 1)
    second = started(gw, "second")
    admission = admission_of(gw)
    await until(lambda: admission.depth == 1)
    refused = await post(gw, "third")
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "overloaded"
    assert int(refused.headers["Retry-After"]) >= 1
    main.let(2)
    assert (await first).status_code == 200
    assert (await second).status_code == 200
    assert main.arrivals == ["first", "second"]
    assert gw.metric("gateway_shed_total", backend="main", reason="queue_full") == 1
    assert gw.metric("gateway_queue_depth", backend="main") == 0


async def test_a_queue_timeout_answers_503_with_retry_after(pipeline):
    clock = FakeClock()
    main = Model("main")
    main.hold()
    backends = {
        "main": {"url": URL, "max_concurrency": 1, "queue": {"capacity": 5, "timeout_ms": 2000}}
    }
    gw = await pipeline(policy(backends), main, clock=clock)
    admission = admission_of(gw)
    first = started(gw, "first")
    await until(lambda: main.active == 1)
    queued = started(gw, "queued")
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
    assert main.arrivals == ["first"]
    assert gw.metric("gateway_shed_total", backend="main", reason="queue_timeout") == 1


async def test_queued_calls_go_upstream_by_priority_from_the_x_priority_header(pipeline):
    main = Model("main")
    main.hold()
    backends = {"main": {"url": URL, "max_concurrency": 1, "queue": {"capacity": 10}}}
    gw = await pipeline(policy(backends), main)
    admission = admission_of(gw)
    tasks = [started(gw, "busy")]
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
        tasks.append(started(gw, tag, headers=headers))

        def queued(n: int = n) -> bool:
            return admission.depth == n + 1

        await until(queued)
    for _ in range(len(tasks)):
        main.let()
    answers = await asyncio.gather(*tasks)
    assert [a.status_code for a in answers] == [200] * len(tasks)
    # An unknown X-Priority falls back to the route's priority (normal), FIFO within one.
    assert main.arrivals == ["busy", "high-1", "high-2", "normal-1", "bogus", "low-1", "low-2"]


async def test_a_higher_priority_call_sheds_the_newest_lowest_waiter_of_a_full_queue(pipeline):
    main = Model("main")
    main.hold()
    backends = {"main": {"url": URL, "max_concurrency": 1, "queue": {"capacity": 2}}}
    route = {"priority": "low"}  # the route's own priority; the header overrides it
    gw = await pipeline(policy(backends, route), main)
    admission = admission_of(gw)
    busy = started(gw, "busy")
    await until(lambda: main.active == 1)
    low_1 = started(gw, "low-1")
    await until(lambda: admission.depth == 1)
    low_2 = started(gw, "low-2")
    await until(lambda: admission.depth == 2)
    high = started(gw, "high", headers={"X-Priority": "high"})
    shed = await low_2
    assert shed.status_code == 503 and "Retry-After" in shed.headers
    main.let(3)
    assert [r.status_code for r in await asyncio.gather(busy, low_1, high)] == [200] * 3
    assert main.arrivals == ["busy", "high", "low-1"]


KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key"}


def tenants_policy(fairness: str = "tenant", capacity: int = 4, **tenants: Any) -> dict[str, Any]:
    """Two named tenants, acme and globex (``tenants`` adds to the section: a key's fields
    by its tenant's name, other keys as they are)."""
    queue = {"capacity": capacity, "fairness": fairness}
    keys = [
        {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(), **tenants.pop(name, {})}
        for name, key in KEYS.items()
    ]
    return policy(
        {"main": {"url": URL, "max_concurrency": 1, "queue": queue}},
        tenants={"keys": keys, **tenants},
    )


def as_tenant(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


async def flooded(pipeline: Any, fairness: str) -> tuple[Model, Pipeline, list[Any]]:
    """A gateway whose one slot and queue of four acme holds: its calls, answered in tasks."""
    main = Model("main")
    main.hold()
    gw = await pipeline(tenants_policy(fairness), main)
    admission = admission_of(gw)
    acme = [started(gw, "busy", headers=as_tenant("acme"))]
    await until(lambda: main.active == 1)
    for n in range(1, 5):
        acme.append(started(gw, f"acme-{n}", headers=as_tenant("acme")))
        await until(lambda n=n: admission.depth == n)  # type: ignore[misc]
    return main, gw, acme


async def test_a_tenant_flooding_the_queue_keeps_neither_its_places_nor_its_turns(pipeline):
    """acme fills the queue; globex still gets a place (acme's newest is shed) and the next
    free slot, ahead of acme's three other waiting calls."""
    main, gw, acme = await flooded(pipeline, "tenant")
    globex = started(gw, "globex", headers=as_tenant("globex"))
    shed = await acme[4]
    assert shed.status_code == 503 and int(shed.headers["Retry-After"]) >= 1
    assert "share it between tenants" in shed.json()["error"]["message"]
    main.let(5)
    answers = await asyncio.gather(*acme[:4], globex)
    assert [a.status_code for a in answers] == [200] * 5
    assert main.arrivals == ["busy", "acme-1", "globex", "acme-2", "acme-3"]
    assert gw.metric("gateway_shed_total", backend="main", reason="queue_share") == 1
    waited = "gateway_tenant_queue_wait_seconds_count"
    assert (gw.metric(waited, tenant="acme"), gw.metric(waited, tenant="globex")) == (4, 1)


async def test_fifo_serves_the_queue_in_arrival_order_and_refuses_at_its_end(pipeline):
    main, gw, acme = await flooded(pipeline, "fifo")
    refused = await post(gw, "globex", headers=as_tenant("globex"))
    assert refused.status_code == 503 and "queue is full" in refused.json()["error"]["message"]
    main.let(5)
    assert [a.status_code for a in await asyncio.gather(*acme)] == [200] * 5
    assert main.arrivals == ["busy", "acme-1", "acme-2", "acme-3", "acme-4"]
    assert gw.metric("gateway_shed_total", backend="main", reason="queue_share") == 0


async def test_a_callers_priority_is_capped_whatever_its_x_priority_header_asks(pipeline):
    """``X-Priority`` is the client's wish: globex (``max_priority: low``) and callers with no
    listed key (``tenants.max_priority: normal``) asking ``high`` wait behind acme's high."""
    main = Model("main")
    main.hold()
    capped = tenants_policy(capacity=10, globex={"max_priority": "low"}, max_priority="normal")
    gw = await pipeline(capped, main)
    admission = admission_of(gw)
    high = {"X-Priority": "high"}
    tasks = [started(gw, "busy", headers=as_tenant("acme"))]
    await until(lambda: main.active == 1)
    for n, (tag, headers) in enumerate(
        [
            ("anonymous-high", high),
            ("globex-high", {**high, **as_tenant("globex")}),
            ("acme-normal", as_tenant("acme")),
            ("acme-high", {**high, **as_tenant("acme")}),
        ],
        start=1,
    ):
        tasks.append(started(gw, tag, headers=headers))
        await until(lambda n=n: admission.depth == n)  # type: ignore[misc]
    assert [admission.depth_of(p) for p in Priority] == [1, 2, 1]
    main.let(len(tasks))
    assert [a.status_code for a in await asyncio.gather(*tasks)] == [200] * len(tasks)
    assert main.arrivals == ["busy", "acme-high", "anonymous-high", "acme-normal", "globex-high"]


async def test_a_weighted_tenant_gets_its_weight_of_the_turns(pipeline):
    """``tenants.keys[].weight: 2``: acme's turns are two calls, globex's one."""
    main = Model("main")
    main.hold()
    gw = await pipeline(tenants_policy(capacity=10, acme={"weight": 2}), main)
    admission = admission_of(gw)
    tasks = [started(gw, "busy", headers=as_tenant("globex"))]
    await until(lambda: main.active == 1)
    queued = [("acme", n) for n in range(1, 5)] + [("globex", n) for n in range(1, 3)]
    for depth, (tenant, n) in enumerate(queued, start=1):
        tasks.append(started(gw, f"{tenant}-{n}", headers=as_tenant(tenant)))
        await until(lambda depth=depth: admission.depth == depth)  # type: ignore[misc]
    main.let(len(tasks))
    assert [a.status_code for a in await asyncio.gather(*tasks)] == [200] * len(tasks)
    assert main.arrivals == ["busy", "acme-1", "acme-2", "globex-1", "acme-3", "acme-4", "globex-2"]


def test_a_tenants_cap_is_the_lowest_given_on_its_keys():
    tenants = parse_policy_text(
        yaml.safe_dump(
            tenants_policy(globex={"max_priority": "normal"}, acme={"max_priority": "high"})
        )
    ).tenants
    assert tenants.max_priorities() == {"globex": "normal"}
    assert tenants.max_priority == "high"  # callers without a listed key: as before
    weighted = tenants_policy(acme={"weight": 3})
    weighted["tenants"]["keys"].append({**weighted["tenants"]["keys"][0], "weight": 5})
    weighted["tenants"]["keys"][-1]["sha256"] = "0" * 64
    assert parse_policy_text(yaml.safe_dump(weighted)).tenants.weights() == {"acme": 3}
    weighted["tenants"]["keys"][0]["weight"] = 101
    with pytest.raises(PolicyError, match=r"keys\[0\]\.weight.*1 to 100"):
        parse_policy_text(yaml.safe_dump(weighted))


async def test_a_vllm_backend_is_told_the_gateways_priority_in_place_of_the_clients(pipeline):
    """``upstream_priority: vllm``: the body carries the call's priority as vLLM's
    ``priority`` (high -1, normal 0, low 1), capped as the gateway's is, whatever the client
    wrote there; without it the body goes as written.  No queue is needed for it."""
    main = Model("main")
    told = tenants_policy(globex={"max_priority": "normal"})
    told["backends"]["main"] = {"url": URL, "upstream_priority": "vllm"}
    told["backends"]["other"] = {"url": "http://other.test"}
    told["routes"].insert(0, {"match": {"path": "/v1/*", "model": "other"}, "backend": "other"})
    other = Model("other")
    gw = await pipeline(told, {"main": main, "other": other})
    high, jump = {"X-Priority": "high"}, {"priority": -100}
    for tag, headers, extra in [
        ("acme-high", {**high, **as_tenant("acme")}, {}),
        ("acme-low", {"X-Priority": "low", **as_tenant("acme")}, {}),
        ("globex-high", {**high, **as_tenant("globex")}, jump),  # capped: normal
        ("plain", as_tenant("acme"), {}),
    ]:
        assert (await post(gw, tag, headers=headers, **extra)).status_code == 200
    assert (await post(gw, "elsewhere", model="other", **jump)).status_code == 200
    told_priority = {b["messages"][-1]["content"]: b.get("priority") for b in main.bodies}
    assert told_priority == {"acme-high": -1, "acme-low": 1, "globex-high": 0, "plain": None}
    assert other.bodies[0]["priority"] == -100  # a backend not told: as the client wrote it
    raw = [json.loads(s.body) for s in gw.transport.to("main")]
    assert [b.get("priority") for b in raw] == [-1, 1, 0, None]  # the bytes sent, too


async def test_a_queued_client_that_disconnects_leaves_the_queue_at_once(pipeline):
    main = Model("main")
    main.hold()
    backends = {"main": {"url": URL, "max_concurrency": 1, "queue": {"capacity": 5}}}
    gw = await pipeline(policy(backends), main)
    admission = admission_of(gw)
    busy = started(gw, "busy")
    await until(lambda: main.active == 1)
    leaving = gw.send("POST", CHAT, json=chat("leaving"))
    await until(lambda: admission.depth == 1)
    await leaving.disconnect()
    await until(lambda: admission.depth == 0)
    assert admission.in_flight == 1
    after = started(gw, "after")
    await until(lambda: admission.depth == 1)
    main.let(2)
    assert (await busy).status_code == 200
    assert (await after).status_code == 200
    assert main.arrivals == ["busy", "after"]


async def test_a_stream_holds_its_slot_until_it_ends(pipeline):
    main = Model("main")
    main.mid_stream = asyncio.Event()
    backends = {"main": {"url": URL, "max_concurrency": 1, "queue": {"capacity": 5}}}
    gw = await pipeline(policy(backends), main)
    admission = admission_of(gw)
    stream = gw.send("POST", CHAT, json=chat("streamed", stream=True))
    head = await stream.until(lambda answer: b"main0" in answer.body)
    assert head.status_code == 200
    after = started(gw, "after")
    await until(lambda: admission.depth == 1)
    assert main.arrivals == ["streamed"]
    main.mid_stream.set()
    body = (await stream.done()).body
    assert b"[DONE]" in body
    assert (await after).status_code == 200
    assert main.arrivals == ["streamed", "after"]
    assert admission.in_flight == 0


async def test_a_reload_changes_limits_for_new_admissions_and_fails_nothing_in_flight(
    pipeline, tmp_path
):
    main = Model("main")
    main.hold()

    def backends(limit: int) -> dict[str, Any]:
        return {"main": {"url": URL, "max_concurrency": limit, "queue": {"capacity": 10}}}

    file = write_policy(tmp_path, policy(backends(1)))
    gw = await pipeline(file, main)
    admission = admission_of(gw)
    tasks = [started(gw, f"r{i}") for i in range(3)]
    await until(lambda: main.active == 1 and admission.depth == 2)
    write_policy(tmp_path, policy(backends(2)))
    assert gw.gateway.reload()
    assert admission_of(gw) is admission
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


async def test_a_tenant_over_its_rate_gets_429_with_retry_after_and_others_do_not(pipeline):
    clock = FakeClock()
    main = Model("main")
    route = {"rate_limit": {"requests_per_s": 1, "burst": 2}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), main, clock=clock)
    alice = {"Authorization": "Bearer alice"}
    bob = {"Authorization": "Bearer bob"}
    assert (await post(gw, headers=alice)).status_code == 200
    assert (await post(gw, headers=alice)).status_code == 200
    over = await post(gw, headers=alice)
    assert over.status_code == 429
    assert over.json()["error"]["type"] == "rate_limit_error"
    assert over.headers["Retry-After"] == "1"
    assert (await post(gw, headers=bob)).status_code == 200
    clock.advance(1.0)
    assert (await post(gw, headers=alice)).status_code == 200
    assert (await post(gw, headers=alice)).status_code == 429
    assert gw.metric("gateway_rate_limited_total", route="chat") == 2
    assert len(main.arrivals) == 4


async def test_a_tokens_per_minute_limit_settles_on_the_answers_usage(pipeline):
    clock = FakeClock()
    main = Model("main")
    route = {"rate_limit": {"tokens_per_min": 300}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), main, clock=clock)
    # Each call is estimated at body/4 + max_tokens = about 120 tokens; usage says 14.
    statuses = [(await post(gw, max_tokens=100)).status_code for _ in range(6)]
    assert statuses == [200] * 6  # without settling, the third would be refused


# -- the circuit breaker ---------------------------------------------------------------------


async def test_breaker_opens_on_failures_probes_after_open_s_and_closes(pipeline):
    clock = FakeClock()
    main = Model("main")
    main.status = 500
    breaker = {
        "failure_rate": 0.5,
        "min_calls": 4,
        "window_s": 10,
        "open_s": 5,
        "half_open_calls": 2,
    }
    backends = {"main": {"url": URL, "circuit_breaker": breaker}}
    gw = await pipeline(policy(backends), main, clock=clock)
    guard = gw.gateway.registry.peek(GUARDS, "main")
    statuses = [(await post(gw)).status_code for _ in range(4)]
    assert statuses == [500] * 4  # no fallback: the backend's own errors pass through
    assert guard.breaker.state == "open"
    refused = await post(gw)
    assert refused.status_code == 503
    assert refused.json()["error"]["code"] == "circuit_open"
    assert refused.headers["Retry-After"] == "5"
    assert refused.headers["X-Gateway-Backend"] == "main"
    assert len(main.arrivals) == 4
    clock.advance(5.0)
    assert guard.breaker.state == "half_open"
    assert "probes=0ok+0out/2" in repr(guard)
    main.status = 200
    assert (await post(gw)).status_code == 200
    assert (await post(gw)).status_code == 200
    assert guard.breaker.state == "closed"
    assert gw.metric("gateway_breaker_state", backend="main") == 0
    for state in ("open", "half_open", "closed"):
        assert gw.metric("gateway_breaker_transitions_total", backend="main", to=state) == 1
    assert gw.metric("gateway_shed_total", backend="main", reason="circuit_open") == 1


async def test_half_open_lets_at_most_half_open_calls_probes_through(pipeline):
    clock = FakeClock()
    main, spare = Model("main"), Model("spare")
    main.status = 500
    breaker = {"min_calls": 2, "window_s": 10, "open_s": 5, "half_open_calls": 2}
    backends: dict[str, dict[str, Any]] = {
        "main": {"url": URL, "circuit_breaker": breaker},
        "spare": {"url": URL},
    }
    route = {"fallback": ["spare"]}
    gw = await pipeline(policy(backends, route), {"main": main, "spare": spare}, clock=clock)
    guard = gw.gateway.registry.peek(GUARDS, "main")
    for _ in range(2):
        assert (await post(gw)).status_code == 200
    assert guard.breaker.state == "open"
    for cycle in range(3):
        clock.advance(5.0)
        main.hold()
        burst = [started(gw, f"c{cycle}") for _ in range(6)]
        await until(lambda: main.active == 2)
        main.let(2)  # both probes fail: open again for another open_s
        answers = await asyncio.gather(*burst)
        assert [a.status_code for a in answers] == [200] * 6
        assert all(a.headers["X-Gateway-Backend"] == "spare" for a in answers)
        assert guard.breaker.state == "open"
        main.gate = None
    probes = [a for a in main.arrivals if a.startswith("c")]
    assert len(probes) == 3 * 2  # half_open_calls per open_s, never more


async def test_429_and_503_from_the_backend_never_trip_the_breaker(pipeline):
    main = Model("main")
    breaker = {"min_calls": 2, "window_s": 10, "open_s": 5}
    gw = await pipeline(policy({"main": {"url": URL, "circuit_breaker": breaker}}), main)
    guard = gw.gateway.registry.peek(GUARDS, "main")
    for status in (429, 503, 429, 503, 429):
        main.status = status
        answer = await post(gw)
        assert answer.status_code == status
        assert answer.headers["Retry-After"] == "1"  # added: the backend sent none
    main.status, main.retry_after = 503, "7"
    assert (await post(gw)).headers["Retry-After"] == "7"  # kept as sent
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
