"""The backend's cache rules win: an answer marked ``no-store``, ``private`` or
``no-cache`` (or ``Vary: *``) is not stored, ``max-age`` caps the entry's lifetime, the
values of the headers it varies on join its key, and the query string is part of every key
(parameter order aside).  Per-item embeddings follow the same rules; a route may opt out
(``ignore_backend_cache_control``).  On real sockets."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.testing import FakeClock
from tests.helpers import metric, write_policy

CHAT = "/v1/chat/completions"
EMBED = "/v1/embeddings"


def ask(text: str = "Name a prime number.") -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


class RuledBackend:
    """Answers with a fresh id each call and the headers ``answer_headers`` says."""

    def __init__(self) -> None:
        self.answer_headers: dict[str, str] = {}
        self.calls = 0
        self.ids = itertools.count(1)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(CHAT, self.chat)
        app.router.add_post(EMBED, self.embeddings)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        answer = {
            "id": f"c-{next(self.ids)}",
            "object": "chat.completion",
            "model": "m",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": request.path_qs},
                    "finish_reason": "stop",
                }
            ],
        }
        return web.json_response(answer, headers=self.answer_headers)

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.calls += 1
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        serial = float(next(self.ids))
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(t)), serial]}
            for i, t in enumerate(inputs)
        ]
        usage = {"prompt_tokens": len(inputs), "total_tokens": len(inputs)}
        answer = {"object": "list", "data": data, "model": "e", "usage": usage}
        return web.json_response(answer, headers=self.answer_headers)


@pytest.fixture
async def ruled(serve_app, start_gateway, tmp_path):
    async def start(cache: str = "{ttl_s: 600}", **kw: Any) -> tuple[RuledBackend, Any]:
        backend = RuledBackend()
        url = await serve_app(backend.app())
        policy = write_policy(
            tmp_path,
            f'backends: {{model: {{url: "{url}"}}}}\n'
            f"routes: [{{name: r, backend: model, cache: {cache}}}]\n",
        )
        return backend, await start_gateway(policy=policy, **kw)

    return start


@pytest.mark.parametrize(
    ("cache_control", "reason"),
    [
        ("no-store", "no-store"),
        ("private", "private"),
        ('private="set-cookie"', "private"),
        ("no-cache", "no-cache"),
        ("max-age=0", "max-age=0"),
        ("public, s-maxage=0, max-age=60", "max-age=0"),
    ],
)
async def test_an_answer_the_backend_marks_not_storable_is_never_replayed(
    ruled, cache_control, reason
):
    backend, gw = await ruled()
    backend.answer_headers = {"Cache-Control": cache_control}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        first = await client.post(CHAT, json=ask())
        second = await client.post(CHAT, json=ask())
        metrics = (await client.get(gw.admin_url + "/metrics")).text
    assert second.headers["X-Gateway-Cache"] == "miss"
    assert first.json()["id"] != second.json()["id"] and backend.calls == 2
    assert metric(metrics, "gateway_cache_not_stored_total", route="r", reason=reason) == 2


async def test_vary_star_is_not_stored_and_a_plain_answer_is(ruled):
    backend, gw = await ruled()
    async with httpx.AsyncClient(base_url=gw.url) as client:
        backend.answer_headers = {"Vary": "*"}
        await client.post(CHAT, json=ask("one"))
        assert (await client.post(CHAT, json=ask("one"))).headers["X-Gateway-Cache"] == "miss"
        backend.answer_headers = {"Cache-Control": "public, max-age=60"}
        await client.post(CHAT, json=ask("two"))
        assert (await client.post(CHAT, json=ask("two"))).headers["X-Gateway-Cache"] == "hit"


async def test_the_values_of_the_headers_an_answer_varies_on_join_its_key(ruled):
    backend, gw = await ruled()
    backend.answer_headers = {"Vary": "Accept-Language, Accept-Encoding"}
    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def post(language: str) -> httpx.Response:
            return await client.post(CHAT, json=ask(), headers={"Accept-Language": language})

        french = await post("fr")
        german = await post("de")
        assert german.headers["X-Gateway-Cache"] == "miss"
        assert german.json()["id"] != french.json()["id"]
        again = await post("fr")
        assert again.headers["X-Gateway-Cache"] == "hit"
        assert again.json()["id"] == french.json()["id"]
        assert (await post("de")).json()["id"] == german.json()["id"]
        assert (await client.post(CHAT, json=ask())).headers["X-Gateway-Cache"] == "miss"
    assert backend.calls == 3


async def test_the_query_string_is_part_of_the_key_in_any_parameter_order(ruled):
    _, gw = await ruled()
    async with httpx.AsyncClient(base_url=gw.url) as client:
        old = await client.post(CHAT + "?api-version=2024-01&deployment=a", json=ask())
        new = await client.post(CHAT + "?api-version=2099-12&deployment=a", json=ask())
        reordered = await client.post(CHAT + "?deployment=a&api-version=2024-01", json=ask())
        bare = await client.post(CHAT, json=ask())
    assert new.headers["X-Gateway-Cache"] == "miss"
    assert new.json()["choices"][0]["message"]["content"].endswith(
        "api-version=2099-12&deployment=a"
    )
    assert reordered.headers["X-Gateway-Cache"] == "hit"
    assert reordered.json()["id"] == old.json()["id"]
    assert bare.headers["X-Gateway-Cache"] == "miss"


async def test_max_age_caps_the_routes_ttl(ruled):
    clock = FakeClock()
    backend, gw = await ruled(clock=clock)
    backend.answer_headers = {"Cache-Control": "max-age=5"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.post(CHAT, json=ask())
        clock.advance(4)
        assert (await client.post(CHAT, json=ask())).headers["X-Gateway-Cache"] == "hit"
        clock.advance(2)
        assert (await client.post(CHAT, json=ask())).headers["X-Gateway-Cache"] == "miss"


async def test_a_route_may_ignore_the_backends_cache_control(ruled):
    backend, gw = await ruled("{ttl_s: 600, ignore_backend_cache_control: true}")
    backend.answer_headers = {"Cache-Control": "private, no-store", "Vary": "*"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        await client.post(CHAT, json=ask())
        assert (await client.post(CHAT, json=ask())).headers["X-Gateway-Cache"] == "hit"


async def test_per_item_embeddings_follow_the_backends_rules(ruled):
    backend, gw = await ruled()
    async with httpx.AsyncClient(base_url=gw.url) as client:

        async def embed(*texts: str, **headers: str) -> httpx.Response:
            body = {"model": "e", "input": list(texts)}
            return await client.post(EMBED, json=body, headers=headers)

        backend.answer_headers = {"Cache-Control": "no-store"}
        await embed("a", "bb")
        assert (await embed("a", "bb")).headers["X-Gateway-Cache-Items"] == "0/2"
        backend.answer_headers = {"Vary": "X-Dimensions"}
        first = await embed("a", "bb", **{"X-Dimensions": "2"})
        other = await embed("a", "ccc", **{"X-Dimensions": "3"})
        assert other.headers["X-Gateway-Cache-Items"] == "0/2"
        same = await embed("a", "ccc", **{"X-Dimensions": "2"})
        assert same.headers["X-Gateway-Cache-Items"] == "1/2"
        assert same.json()["data"][0] == first.json()["data"][0]
