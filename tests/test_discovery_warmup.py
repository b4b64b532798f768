"""An endpoint discovery adds to a backend with ``warmup`` requests is warmed before it takes
calls (``transport.joining``): it is ``warming`` while its warm-up runs, gets no call while
another endpoint can take it, joins once warmed, and joins all the same when its warm-up
gives up.  Servers on loopback addresses (real sockets), an injected resolver, a fake
clock."""

from __future__ import annotations

import asyncio

from gateway.metrics import Metrics
from gateway.policy import parse_policy_text
from gateway.policy.backend import WarmupRequest
from gateway.policy.model import Backend, Discovery, Policy
from gateway.testing import FakeClock, FakeResolver
from gateway.transport.backends import Upstreams
from gateway.transport.endpoints import EndpointSet
from tests.helpers import until
from tests.test_discovery import HOSTS, answer, instances

__all__ = ["instances"]  # the fixture, for pytest


def warmed_backend(port: int, timeout_s: float = 30.0) -> Backend:
    """Discovered endpoints whose warm-up waits on the server's ``/gated`` (its gate)."""
    return Backend(
        "llm",
        discovery=Discovery("llm.svc", port, interval_s=5),
        balance="round_robin",
        warmup=(WarmupRequest("/gated", method="GET"),),
        warmup_timeout_s=timeout_s,
    )


def state(metrics: Metrics, url: str, name: str) -> float:
    return float(metrics.endpoint_state.labels("llm", url, name)._value.get())


def warmups(metrics: Metrics, outcome: str) -> float:
    return float(metrics.endpoint_warmups.labels("llm", outcome)._value.get())


async def test_a_new_endpoint_takes_no_call_until_its_warm_up_has_answered(instances) -> None:
    port, gates = instances
    gates[HOSTS[0]].set()  # the first instance warms at once
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": [HOSTS[0]]})
    backend, metrics = warmed_backend(port), Metrics()
    endpoints = EndpointSet(backend, metrics, clock=clock)
    endpoints.follow(resolver)
    try:
        await until(lambda: warmups(metrics, "warmed") == 1)
        resolver.set("llm.svc", list(HOSTS[:2]))  # scaled up: a second replica
        clock.advance(5)
        await until(lambda: len(endpoints.endpoints) == 2)
        new = next(e for e in endpoints.endpoints if HOSTS[1] in e.url)
        assert new.warming and state(metrics, new.url, "warming") == 1
        # round robin would alternate; the cold replica gets none of them
        assert {await answer(endpoints, backend) for _ in range(6)} == {HOSTS[0]}
        gates[HOSTS[1]].set()  # its warm-up answers
        await until(lambda: not new.warming)
        assert state(metrics, new.url, "active") == 1
        assert {await answer(endpoints, backend) for _ in range(6)} == set(HOSTS[:2])
        assert warmups(metrics, "warmed") == 2
    finally:
        await endpoints.aclose()


async def test_a_new_endpoint_whose_warm_up_gives_up_joins_all_the_same(instances) -> None:
    port, gates = instances
    gates[HOSTS[0]].set()
    # a second address with nothing listening: every warm-up is refused
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": [HOSTS[0], "127.0.0.9"]})
    backend, metrics = warmed_backend(port, timeout_s=3), Metrics()
    endpoints = EndpointSet(backend, metrics, clock=clock)
    endpoints.follow(resolver)
    try:
        await until(lambda: len(endpoints.endpoints) == 2)
        dead = next(e for e in endpoints.endpoints if "127.0.0.9" in e.url)
        for _ in range(4):  # a retry a second, for the 3 s it has
            await until(lambda: clock.sleepers >= 2 or not dead.warming)
            clock.advance(1)
            await asyncio.sleep(0)
        await until(lambda: not dead.warming)
        assert warmups(metrics, "gave_up") == 1
        assert state(metrics, dead.url, "active") == 1  # joined; ejection judges it now
        # a call picked for it cannot connect, and goes to the other: no call fails
        assert {await answer(endpoints, backend) for _ in range(4)} == {HOSTS[0]}
    finally:
        await endpoints.aclose()


async def test_a_joining_endpoint_that_leaves_stops_its_warm_up_and_leaves_no_series(
    instances,
) -> None:
    port, gates = instances
    gates[HOSTS[0]].set()
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": list(HOSTS[:2])})
    backend, metrics = warmed_backend(port), Metrics()
    endpoints = EndpointSet(backend, metrics, clock=clock)
    endpoints.follow(resolver)
    try:
        await until(lambda: warmups(metrics, "warmed") == 1)  # the first; the second waits
        leaving = next(e for e in endpoints.endpoints if HOSTS[1] in e.url)
        assert leaving.warming
        resolver.set("llm.svc", [HOSTS[0]])  # scaled back down before it was warm
        clock.advance(5)
        await until(lambda: len(endpoints.endpoints) == 1)
        await until(lambda: not leaving.warming)  # its warm-up was cancelled, and ended
        text = metrics.exposition().decode()
        assert HOSTS[1] not in text  # none of its series came back
        assert warmups(metrics, "gave_up") == 0
    finally:
        await endpoints.aclose()


async def test_without_warm_up_requests_a_new_endpoint_takes_calls_at_once(instances) -> None:
    port, _ = instances
    clock, resolver = FakeClock(), FakeResolver({"llm.svc": list(HOSTS[:2])})
    backend = Backend("llm", discovery=Discovery("llm.svc", port), balance="round_robin")
    endpoints = EndpointSet(backend, Metrics(), clock=clock)
    endpoints.follow(resolver)
    try:
        await until(lambda: len(endpoints.endpoints) == 2)
        assert not any(e.warming for e in endpoints.endpoints)
        assert {await answer(endpoints, backend) for _ in range(4)} == set(HOSTS[:2])
    finally:
        await endpoints.aclose()


async def test_an_endpoint_a_reload_adds_to_a_static_list_is_warmed_and_the_others_are_not():
    def listed(*urls: str) -> Policy:
        text = (
            f"backends:\n  llm:\n    endpoints: [{', '.join(urls)}]\n"
            "    warmup: [{path: /health, method: GET}]\n"
            "routes: [{match: {path: '/v1/*'}, backend: llm}]\n"
        )
        return parse_policy_text(text, "p.yaml")

    kept, added = "http://127.0.0.1:9", "http://127.0.0.9:9"  # nothing listens: it stays cold
    upstreams = Upstreams(Metrics(), FakeClock(), FakeResolver())
    try:
        upstreams.sync(listed(kept, "http://127.0.0.8:9"))  # at start: warm_up's to warm
        first = upstreams.endpoint_set("llm")
        assert first is not None and not any(e.warming for e in first.endpoints)
        upstreams.sync(listed(kept, added))  # a policy edit: one replica out, one in
        second = upstreams.endpoint_set("llm")
        assert second is not None and second is not first
        assert {e.url: e.warming for e in second.endpoints} == {kept: False, added: True}
    finally:
        await upstreams.aclose()


async def test_a_reload_that_changes_the_warm_up_applies_to_the_endpoints_joining_after_it():
    def parsed(warmup: str) -> Policy:
        text = (
            "backends:\n  llm:\n    discovery: {dns: llm.svc, port: 8000}\n"
            f"    warmup: [{{path: {warmup}, method: GET}}]\n"
            "routes: [{match: {path: '/v1/*'}, backend: llm}]\n"
        )
        return parse_policy_text(text, "p.yaml")

    upstreams = Upstreams(Metrics(), FakeClock(), FakeResolver({"llm.svc": []}))
    try:
        upstreams.sync(parsed("/health"))
        endpoints = upstreams.endpoint_set("llm")
        assert endpoints is not None and endpoints.joining is not None
        upstreams.sync(parsed("/v1/models"))
        assert upstreams.endpoint_set("llm") is endpoints  # kept across the reload
        assert endpoints.joining.backend.warmup[0].path == "/v1/models"
    finally:
        await upstreams.aclose()
