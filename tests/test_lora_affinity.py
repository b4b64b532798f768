"""LoRA affinity with ``balance: kv_aware``: a request for one of a vLLM fleet's LoRA
adapters goes to a server already serving it, else to one with room for another adapter, as
the Kubernetes inference extension's LoRA filter does; a request for the base model is
balanced as any other.  Model servers on real sockets serve vLLM's own
``vllm:lora_requests_info`` at ``/metrics``."""

from __future__ import annotations

import json
import random
from collections import Counter
from typing import Any

from aiohttp import web

from gateway.metrics import Metrics
from gateway.policy.model import Backend, TelemetrySource
from gateway.telemetry.prometheus import parse_exposition
from gateway.testing import FakeClock, FakeTransport, json_reply
from gateway.transport import load
from gateway.transport.endpoints import EndpointSet
from tests.helpers import metric, until
from tests.test_endpoints import exporting

BASE = "meta-llama/Llama-3.1-8B-Instruct"


def exposition(figures: dict[str, Any]) -> str:
    """vLLM's figures as it exports them: the queue and KV use under the base model's name,
    and the LoRA gauge, whose older label sets linger with older times."""
    model = f'model_name="{BASE}"'
    return (
        f"vllm:num_requests_waiting{{{model}}} {figures['waiting']}\n"
        f"vllm:kv_cache_usage_perc{{{model}}} 0.2\n"
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="stale",'
        f'waiting_lora_adapters=""}} 1700000000.0\n'
        f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="{figures["running"]}",'
        f'waiting_lora_adapters="{figures["waiting_adapters"]}"}} 1700000100.0\n'
    )


def server(name: str, figures: dict[str, Any]) -> web.Application:
    return exporting(name, lambda: exposition(figures))


async def served_by(endpoints: EndpointSet, backend: Backend, model: str) -> str:
    body = json.dumps({"model": model}).encode()
    reply = await endpoints.send(
        backend, "POST", "/v1/completions", [], body, streaming=False, model=model
    )
    assert reply.body is not None
    return str(json.loads(reply.body)["served_by"])


def test_a_servers_adapters_are_read_from_its_latest_lora_gauge():
    figures = {"waiting": 0, "running": "sql-lora, chat-lora", "waiting_adapters": "new"}
    series = parse_exposition(exposition(figures), load._READ)
    adapters = load.adapters_of(series)
    serving = frozenset({"sql-lora", "chat-lora", "new"})
    assert adapters == load.Adapters(BASE, serving, 2, ("chat-lora", "new", "sql-lora"))
    assert not adapters.room  # three for two places: it is swapping already
    assert load.adapters_of(parse_exposition("vllm:num_requests_waiting 0\n")) is None
    for most in ("many", "²", "9" * 5000):  # int() would raise on the last two
        odd = f'vllm:lora_requests_info{{max_lora="{most}",running_lora_adapters=""}} 1\n'
        assert load.adapters_of(parse_exposition(odd, load._READ)) == load.Adapters(
            None, frozenset(), None
        )


def test_an_exporter_naming_new_adapters_each_scrape_grows_no_memory():
    held = None
    for i in range(500):
        text = f'vllm:lora_requests_info{{max_lora="999999",running_lora_adapters="a{i}"}} 1\n'
        held = load.adapters_of(parse_exposition(text, load._READ), held)
    assert held is not None and len(held.resident) == load.MAX_RESIDENT
    assert held.resident[0] == "a499" and held.room


async def test_an_adapter_between_two_requests_is_still_held_where_it_was_served():
    """vLLM names only the adapters of its requests in flight, but keeps the ``max_lora``
    used last in GPU memory: an adapter whose requests ended a moment ago is still there,
    and its next request belongs there, not on a server that would evict another for it."""

    def scraped(before: load.Adapters | None, running: str) -> load.Adapters:
        figures = {"waiting": 0, "running": running, "waiting_adapters": ""}
        found = load.adapters_of(parse_exposition(exposition(figures), load._READ), before)
        assert found is not None
        return found

    held = scraped(scraped(None, "sql-lora"), "chat-lora")
    assert held.resident == ("chat-lora", "sql-lora") and not held.room
    assert held.holds("sql-lora")  # no request of it in flight: still in memory
    later = scraped(scraped(held, ""), "new-lora")
    assert later.resident == ("new-lora", "chat-lora")  # the least recently used went
    assert not later.holds("sql-lora")

    backend = Backend("m", endpoints=("http://a", "http://b"), balance="kv_aware")
    endpoints = EndpointSet(backend, Metrics(), clock=FakeClock())
    a, b = endpoints.endpoints
    a.adapters, b.adapters = held, scraped(scraped(None, "x-lora"), "y-lora")
    assert load.for_model("sql-lora", [a, b], backend) == ([a], "serving")
    await endpoints.aclose()


async def test_an_adapters_requests_go_where_it_is_served_else_where_there_is_room(serve_app):
    figures = {
        "a": {"waiting": 0, "running": "", "waiting_adapters": ""},
        "b": {"waiting": 0, "running": "sql-lora", "waiting_adapters": ""},
        "c": {"waiting": 0, "running": "chat-lora", "waiting_adapters": "other"},  # full
    }
    urls = [await serve_app(server(n, figures[n])) for n in "abc"]
    clock = FakeClock()
    backend = Backend(
        "m", endpoints=tuple(urls), balance="kv_aware", telemetry=TelemetrySource(interval_ms=200)
    )
    metrics = Metrics()
    endpoints = EndpointSet(backend, metrics, clock=clock, rng=random.Random(26))
    endpoints.watch_load()
    try:
        await until(lambda: all(e.adapters is not None for e in endpoints.endpoints))
        assert {await served_by(endpoints, backend, "sql-lora") for _ in range(20)} == {"b"}
        assert {await served_by(endpoints, backend, "chat-lora") for _ in range(20)} == {"c"}
        cold = Counter([await served_by(endpoints, backend, "new-lora") for _ in range(40)])
        assert set(cold) == {"a", "b"}  # c holds all it can
        base = Counter([await served_by(endpoints, backend, BASE) for _ in range(60)])
        assert set(base) == {"a", "b", "c"}  # the base model: any of them
        figures["b"]["waiting"] = 9  # saturated: sql-lora goes where there is room
        await until(lambda: clock.sleepers == 1)
        clock.advance(0.2)
        await until(lambda: endpoints.endpoints[1].queue_waiting == 9)
        assert {await served_by(endpoints, backend, "sql-lora") for _ in range(20)} == {"a"}
        text = metrics.exposition().decode()
        name = "gateway_endpoint_adapter_picks_total"
        assert {
            why: metric(text, name, backend="m", outcome=why) for why in ("serving", "room")
        } == {
            "serving": 40,
            "room": 60,  # new-lora's 40, then sql-lora's 20 while its server is saturated
        }
    finally:
        await endpoints.aclose()


async def test_the_forward_names_the_model_only_to_a_kv_aware_backend(pipeline):
    transport = FakeTransport(lambda sent: json_reply({"ok": True}))
    gw = await pipeline(
        {
            "backends": {
                "fleet": {"endpoints": ["http://a", "http://b"], "balance": "kv_aware"},
                "other": {"endpoints": ["http://c", "http://d"]},
            },
            "routes": [
                {"match": {"path": "/v1/*", "model": "sql-*"}, "backend": "fleet"},
                {"match": {"path": "*"}, "backend": "other"},
            ],
        },
        transport,
    )
    await gw.post("/v1/completions", {"model": "sql-lora", "prompt": "hi"})
    await gw.post("/v1/completions", {"model": "chat", "prompt": "hi"})
    fleet, other = transport.to("fleet")[0], transport.to("other")[0]
    assert (fleet.model, other.model) == ("sql-lora", None)
