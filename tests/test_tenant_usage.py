"""What each named tenant used, for chargeback (and the access log's ``tenant``): ``gateway_tenant_requests_total{tenant,
status}`` and ``gateway_tenant_tokens_total{tenant, kind, source}``, the tokens of every
answer it got by who computed them (the backend, the cache, another request's flight).
``gateway_tokens_total`` counts only what the backend computed: a cache hit or a shared
answer is not the backend's work again.  The official ``openai`` SDK as the client, a
model server on a real socket that holds its answers until told."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from tests.helpers import metric, problems_of, scrape_when_recorded, until, write_policy

KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key"}
USAGE = {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}


class Chat:
    """A chat server whose answers wait for ``gate`` (open unless a test closes it)."""

    def __init__(self) -> None:
        self.calls = 0
        self.gate = asyncio.Event()
        self.gate.set()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls += 1
        await self.gate.wait()
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        answer = {
            "id": f"c-{self.calls}",
            "object": "chat.completion",
            "created": 1,
            "model": body["model"],
            "choices": [choice],
            "usage": USAGE,
        }
        return web.json_response(answer)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


POLICY = """
backends: {{main: {{url: "{url}", price: {{input_per_million: 2.5, output_per_million: 10}}}}}}
routes:
  - {{match: {{path: /v1/chat/completions}}, backend: main, cache: {{ttl_s: 60}}}}
tenants:
  keys:
    - {{name: acme, sha256: {acme}}}
    - {{name: globex, sha256: {globex}}}
server: {{access_log: true}}
"""


@pytest.fixture
async def served(serve_app, start_gateway, tmp_path):
    chat = Chat()
    url = await serve_app(chat.app())
    text = POLICY.format(url=url, acme=digest(KEYS["acme"]), globex=digest(KEYS["globex"]))
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    return chat, gw


def sdk(gw: Any, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def ask(gw: Any, key: str, question: str) -> str:
    async with sdk(gw, key) as client:
        answer = await client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], temperature=0
        )
    return answer.id


async def scrape(gw: Any) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(gw.admin_url + "/metrics")).text


async def test_each_tenants_tokens_are_counted_by_who_computed_them(served):
    chat, gw = served
    await ask(gw, KEYS["acme"], "hello")  # computed for acme
    await ask(gw, KEYS["acme"], "hello")  # acme's cache hit
    await ask(gw, KEYS["globex"], "hello")  # another scope: computed for globex
    await ask(gw, "an-unlisted-key", "hello")  # no named tenant: no tenant series
    chat.gate.clear()
    leader = asyncio.create_task(ask(gw, KEYS["globex"], "shared"))
    await until(lambda: chat.calls == 4)
    joiner = asyncio.create_task(ask(gw, KEYS["globex"], "shared"))
    await until_coalesced(gw)
    chat.gate.set()
    assert await leader == await joiner  # one answer, computed once
    text = await scrape_when_recorded(gw.admin_url, 6)

    def tokens(tenant: str, kind: str, source: str) -> float | None:
        return metric(text, "gateway_tenant_tokens_total", tenant=tenant, kind=kind, source=source)

    assert (tokens("acme", "prompt", "backend"), tokens("acme", "completion", "backend")) == (5, 7)
    assert (tokens("acme", "prompt", "cache"), tokens("acme", "completion", "cache")) == (5, 7)
    assert tokens("acme", "prompt", "coalesced") is None
    assert tokens("globex", "completion", "backend") == 14  # its own, and the leader's
    assert tokens("globex", "completion", "coalesced") == 7
    assert tokens("globex", "completion", "cache") is None
    assert metric(text, "gateway_tenant_requests_total", tenant="acme", status="200") == 2
    assert metric(text, "gateway_tenant_requests_total", tenant="globex", status="200") == 3
    assert 'tenant=""' not in text
    # the backend computed four answers: acme's, globex's, the unlisted key's, the shared one
    assert chat.calls == 4
    assert metric(text, "gateway_tokens_total", backend="main", kind="completion") == 28
    # at 2.5 a million prompt tokens and 10 a million generated: 0.0000825 an answer
    one = (5 * 2.5 + 7 * 10) / 1e6

    def cost(tenant: str, source: str) -> float | None:
        return metric(text, "gateway_tenant_cost_total", tenant=tenant, source=source)

    assert cost("acme", "backend") == pytest.approx(one)
    assert cost("acme", "cache") == pytest.approx(one)  # what the cache saved it
    assert cost("globex", "backend") == pytest.approx(2 * one)
    assert cost("globex", "coalesced") == pytest.approx(one)


async def until_coalesced(gw: Any) -> None:
    for _ in range(200):
        if metric(
            await scrape(gw), "gateway_coalesced_requests_total", route="/v1/chat/completions"
        ):
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the second request never joined the first")


async def test_a_tenants_refusals_are_counted_by_status_and_logged_with_its_name(served, capsys):
    _, gw = served
    async with httpx.AsyncClient(base_url=gw.url) as client:
        headers = {"Authorization": f"Bearer {KEYS['acme']}"}
        bad = await client.post("/v1/chat/completions", content=b"{", headers=headers)
        nowhere = await client.post(
            "/v1/embeddings", json={"model": "m", "input": "x"}, headers=headers
        )
    text = await scrape_when_recorded(gw.admin_url, 2)
    assert (bad.status_code, nowhere.status_code) == (400, 404)
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line[:1] == "{"]
    assert all("cost" not in entry for entry in logged)  # no tokens, no cost
    assert [(entry["status"], entry.get("tenant")) for entry in logged] == [
        (400, "acme"),
        (404, "acme"),
    ]
    assert metric(text, "gateway_tenant_requests_total", tenant="acme", status="400") == 1
    assert metric(text, "gateway_tenant_requests_total", tenant="acme", status="404") == 1
    assert (
        metric(text, "gateway_tenant_tokens_total", tenant="acme", kind="prompt", source="backend")
        is None
    )


async def test_an_answers_cost_is_logged_and_a_negative_price_refused(served, capsys):
    _, gw = served
    await ask(gw, KEYS["acme"], "what does it cost?")
    await scrape_when_recorded(gw.admin_url, 1)
    logged = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line[:1] == "{"]
    assert [entry["cost"] for entry in logged] == [pytest.approx((5 * 2.5 + 7 * 10) / 1e6)]
    text = 'backends: {main: {url: "http://m", price: {output_per_million: -1}}}\nroutes: []\n'
    assert any("backends.main.price: must not be negative" in p for p in problems_of(text))
