"""A named tenant's cap on its calls in flight (``tenants.keys[].max_concurrency``,
``gateway/resilience/concurrency.py``): through the whole pipeline, a held backend, the
tenant's calls counted until their answers are done."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Awaitable
from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError, UpstreamUnavailable
from gateway.pipeline import Reply
from gateway.policy import parse_policy_text
from gateway.resilience.concurrency import IN_FLIGHT
from gateway.testing import Sent
from gateway.testing.harness import Answer, Pipeline
from tests.backends import Model, post, started
from tests.helpers import chat, policy, until
from tests.test_stage_resilience import CHAT, KEYS, URL, as_tenant

REFUSED_WITHIN_S = 5.0


def capped(acme: int | None = 2, clients: int | None = None, **more: Any) -> dict[str, Any]:
    """acme (capped at ``acme``) and globex (no cap), on one backend with no queue of its own;
    callers offering no listed key capped at ``clients`` each (``tenants.max_concurrency``)."""
    keys: list[dict[str, Any]] = [
        {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
        for name, key in KEYS.items()
    ]
    if acme is not None:
        keys[0]["max_concurrency"] = acme
    tenants: dict[str, Any] = {"keys": keys}
    if clients is not None:
        tenants["max_concurrency"] = clients
    return policy({"main": {"url": URL}}, tenants=tenants, **more)


async def refused(answer: Awaitable[Answer]) -> Answer:
    """An answer that must come at once, the backend being held: never a wait."""
    return await asyncio.wait_for(answer, REFUSED_WITHIN_S)


def in_flight(gw: Pipeline, tenant: str) -> int:
    counts = gw.gateway.registry.peek(IN_FLIGHT)
    assert counts is not None
    return counts.held(tenant)


async def test_a_tenant_past_its_cap_gets_429_and_other_tenants_do_not(pipeline):
    main = Model("main")
    main.hold()
    gw = await pipeline(capped(2), main)
    held = [started(gw, f"acme-{n}", headers=as_tenant("acme")) for n in (1, 2)]
    try:
        await until(lambda: main.active == 2)
        over = await refused(post(gw, "acme-3", headers=as_tenant("acme")))
        assert over.status_code == 429
        assert over.headers["Retry-After"] == "1"
        error = over.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "concurrency_limit_exceeded")
        assert "max_concurrency is 2" in error["message"]
        held += [
            started(gw, "globex", headers=as_tenant("globex")),  # not capped: not held back
            started(gw, "anonymous"),
        ]
        await until(lambda: main.active == 4)
        assert gw.metric("gateway_tenant_in_flight", tenant="acme") == 2
        assert gw.metric("gateway_tenant_concurrency_limited_total", tenant="acme") == 1
        main.let()  # acme-1 is answered: acme has a place again
        assert (await held[0]).status_code == 200
        assert in_flight(gw, "acme") == 1
        held.append(started(gw, "acme-4", headers=as_tenant("acme")))
        await until(lambda: main.active == 4)
    finally:
        main.let(len(held))
    answers = await asyncio.gather(*held)
    assert [a.status_code for a in answers] == [200] * 5
    assert main.arrivals == ["acme-1", "acme-2", "globex", "anonymous", "acme-4"]
    assert in_flight(gw, "acme") == 0
    assert gw.metric("gateway_tenant_in_flight", tenant="acme") == 0


async def test_a_stream_holds_its_place_until_it_ends_or_its_client_leaves(pipeline):
    main = Model("main")
    main.mid_stream = asyncio.Event()
    gw = await pipeline(capped(1), main)
    headers = as_tenant("acme")
    stream = gw.send("POST", CHAT, json=chat("streamed", stream=True), headers=headers)
    assert (await stream.until(lambda answer: b"main0" in answer.body)).status_code == 200
    assert (await refused(post(gw, "meanwhile", headers=headers))).status_code == 429
    main.mid_stream.set()
    assert b"[DONE]" in (await stream.done()).body
    await until(lambda: in_flight(gw, "acme") == 0)
    assert (await post(gw, "after", headers=headers)).status_code == 200

    main.mid_stream = asyncio.Event()
    leaving = gw.send("POST", CHAT, json=chat("left", stream=True), headers=headers)
    await leaving.until(lambda answer: b"main0" in answer.body)
    assert in_flight(gw, "acme") == 1
    await leaving.disconnect()
    await until(lambda: in_flight(gw, "acme") == 0)
    assert (await post(gw, "after the leaver", headers=headers)).status_code == 200


async def test_a_failed_call_gives_its_place_back(pipeline):
    main = Model("main")
    main.status = 502
    gw = await pipeline(capped(1), main)
    for _ in range(3):  # each failure frees the place for the next call
        assert (await post(gw, "fails", headers=as_tenant("acme"))).status_code == 502
    assert in_flight(gw, "acme") == 0

    async def unreachable(sent: Sent) -> Reply:
        raise UpstreamUnavailable("connection refused", backend="main")

    gw = await pipeline(capped(1), unreachable)
    for _ in range(3):
        assert (await post(gw, "refused", headers=as_tenant("acme"))).status_code == 502
    assert in_flight(gw, "acme") == 0


async def test_a_refused_call_spends_none_of_the_tenants_rate(pipeline):
    """The cap is checked before the rate limits: a call it refuses is not charged."""
    main = Model("main")
    main.hold()
    rate = {"requests_per_s": 0.001, "burst": 2}
    limited = capped(1)
    limited["tenants"]["keys"][0]["rate_limit"] = rate
    gw = await pipeline(limited, main)
    first = started(gw, "first", headers=as_tenant("acme"))
    await until(lambda: main.active == 1)
    for _ in range(3):
        over = await refused(post(gw, "over", headers=as_tenant("acme")))
        assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
    main.let(2)
    assert (await first).status_code == 200
    assert (await post(gw, "second", headers=as_tenant("acme"))).status_code == 200
    third = await post(gw, "third", headers=as_tenant("acme"))
    assert third.json()["error"]["code"] == "rate_limit_exceeded"  # the burst of 2, spent


async def test_a_cached_answer_is_not_a_call_in_flight(pipeline):
    main = Model("main")
    cached = capped(1)
    cached["routes"][0]["cache"] = {"ttl_s": 60}
    gw = await pipeline(cached, main)
    assert (await post(gw, "same", temperature=0, headers=as_tenant("acme"))).status_code == 200
    main.hold()
    held = started(gw, "other", headers=as_tenant("acme"))
    await until(lambda: main.active == 1)
    hit = await post(gw, "same", temperature=0, headers=as_tenant("acme"))
    assert (hit.status_code, hit.headers["X-Gateway-Cache"]) == (200, "hit")
    main.let()
    assert (await held).status_code == 200


async def test_a_client_offering_no_listed_key_is_capped_by_its_address(pipeline):
    """``tenants.max_concurrency``: nginx's ``limit_conn`` per address, for callers without a
    listed key; a named tenant is held to its own cap (none here), not to this one."""
    main = Model("main")
    main.hold()
    gw = await pipeline(capped(None, clients=1), main)

    def asked(tag: str, peer: str, headers: dict[str, str] | None = None) -> Any:
        return gw.send("POST", CHAT, json=chat(tag), headers=headers or {}, peer=peer)

    held = [asked("first", "10.0.0.1")]
    try:
        await until(lambda: main.active == 1)
        over = await refused(asked("second", "10.0.0.1").done())
        assert (over.status_code, over.json()["error"]["code"]) == (
            429,
            "concurrency_limit_exceeded",
        )
        assert "tenants.max_concurrency is 1" in over.json()["error"]["message"]
        held += [
            asked("other address", "10.0.0.2"),
            asked("globex", "10.0.0.1", as_tenant("globex")),  # a named tenant: its own cap
        ]
        await until(lambda: main.active == 3)
        assert gw.metric("gateway_client_in_flight") == 2
        assert gw.metric("gateway_client_concurrency_limited_total") == 1
    finally:
        main.let(len(held))
    assert [(await e.done()).status_code for e in held] == [200] * 3
    assert gw.metric("gateway_client_in_flight") == 0
    main.let()
    assert (await refused(asked("after", "10.0.0.1").done())).status_code == 200


def test_the_lowest_cap_over_a_tenants_keys_holds_and_a_cap_below_one_is_refused():
    text = yaml.safe_dump(capped(3))
    doubled = yaml.safe_load(text)
    doubled["tenants"]["keys"].append({**doubled["tenants"]["keys"][0], "max_concurrency": 5})
    doubled["tenants"]["keys"][-1]["sha256"] = "0" * 64
    assert parse_policy_text(yaml.safe_dump(doubled)).tenants.max_concurrencies() == {"acme": 3}
    assert parse_policy_text(yaml.safe_dump(capped(None))).tenants.max_concurrencies() == {}
    with pytest.raises(PolicyError, match=r"keys\[0\]\.max_concurrency.*at least 1"):
        parse_policy_text(yaml.safe_dump(capped(0)))
    with pytest.raises(PolicyError, match=r"tenants\.max_concurrency.*at least 1"):
        parse_policy_text(yaml.safe_dump(capped(None, clients=0)))
