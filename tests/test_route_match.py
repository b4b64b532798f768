"""A route's ``match`` beyond path and model: the caller's named tenant (``tenants``: a
dedicated backend for one tenant) and request headers (``headers``: a variant a client asks
for).  First match wins; a route whose tenants or headers do not match passes the request to
the next route."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import yaml

from gateway.testing import FakeTransport, json_reply
from tests.helpers import chat, problems_of

KEYS = {"acme": "acme-secret-key", "globex": "globex-secret-key"}


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tenant]}"}


def routed(routes: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "backends": {name: {"url": f"http://{name}"} for name in ("shared", "dedicated", "canary")},
        "routes": routes,
        "tenants": {
            "keys": [
                {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                for name, key in KEYS.items()
            ]
        },
    }


def served(transport: FakeTransport) -> list[str]:
    return [sent.backend for sent in transport.sent]


async def test_a_tenants_requests_go_to_its_own_backend(pipeline):
    transport = FakeTransport(lambda sent: json_reply({"ok": True}))
    policy = routed(
        [
            {"match": {"path": "/v1/*", "tenants": ["acme"]}, "backend": "dedicated"},
            {"match": {"path": "/v1/*"}, "backend": "shared"},
        ]
    )
    gw = await pipeline(policy, transport)
    for headers in (bearer("acme"), bearer("globex"), {}, bearer("acme")):
        answer = await gw.post("/v1/chat/completions", chat(), headers=headers)
        assert answer.status_code == 200
    assert served(transport) == ["dedicated", "shared", "shared", "dedicated"]


async def test_a_header_picks_a_route_by_a_glob_on_its_value(pipeline):
    transport = FakeTransport(lambda sent: json_reply({"ok": True}))
    policy = routed(
        [
            {
                "name": "canary",
                "match": {"path": "/v1/*", "headers": {"X-Variant": "canary*"}},
                "backend": "canary",
            },
            {
                "name": "acme-beta",
                "match": {"path": "/v1/*", "tenants": ["acme"], "headers": {"X-Beta": "1"}},
                "backend": "dedicated",
            },
            {"name": "rest", "match": {"path": "/v1/*"}, "backend": "shared"},
        ]
    )
    gw = await pipeline(policy, transport)
    asked = [
        {"x-variant": "canary-2"},  # the name in any case
        {"X-Variant": "stable"},
        {},
        {"X-Beta": "1", **bearer("acme")},
        {"X-Beta": "1", **bearer("globex")},  # the header alone is not enough
        {"X-Beta": "1"},
    ]
    for headers in asked:
        assert (await gw.post("/v1/chat/completions", chat(), headers=headers)).status_code == 200
    assert served(transport) == ["canary", "shared", "shared", "dedicated", "shared", "shared"]
    assert "cached=0" in repr(gw.gateway.snapshot.router)  # header values are not cached


async def test_a_request_no_route_takes_is_a_404(pipeline):
    transport = FakeTransport(lambda sent: json_reply({"ok": True}))
    policy = routed([{"match": {"path": "/v1/*", "tenants": ["acme"]}, "backend": "dedicated"}])
    gw = await pipeline(policy, transport)
    answer = await gw.post("/v1/chat/completions", chat(), headers=bearer("globex"))
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert transport.sent == []


@pytest.mark.parametrize(
    ("match", "problem"),
    [
        ({"tenants": ["initech"]}, "routes[0].match.tenants[0]: no tenant is named 'initech'"),
        ({"headers": {"X Bad": "1"}}, "routes[0].match.headers.X Bad: not a header name"),
    ],
)
def test_a_match_is_checked(match: dict[str, Any], problem: str):
    policy = routed([{"match": {"path": "/v1/*", **match}, "backend": "shared"}])
    assert any(problem in p for p in problems_of(yaml.safe_dump(policy)))


async def test_a_tenants_own_model_name_is_listed_to_that_tenant_only(pipeline):
    """``GET /v1/models`` lists a route's alias (``target_models`` under one model name)
    only to the callers that route would take."""

    def respond(sent: Any) -> Any:
        if sent.target == "/v1/models":
            listing = {"object": "list", "data": [{"id": "base", "object": "model"}]}
            return json_reply(listing)
        return json_reply({"error": {"message": "no such model"}}, status=404)

    transport = FakeTransport(respond)
    assistant = {"path": "/v1/*", "model": "assistant", "tenants": ["acme"]}
    policy = routed(
        [
            {"match": assistant, "backend": "dedicated", "target_models": [{"model": "ft"}]},
            {"match": {"path": "/v1/*"}, "backend": "shared"},
        ]
    )
    gw = await pipeline(policy, transport)

    async def listed(headers: dict[str, str]) -> list[str]:
        answer = await gw.request("GET", "/v1/models", headers=headers)
        return [m["id"] for m in answer.json()["data"]]

    assert await listed(bearer("acme")) == ["base", "assistant"]
    assert await listed(bearer("globex")) == ["base"]
    assert await listed({}) == ["base"]
    one = await gw.request("GET", "/v1/models/assistant", headers=bearer("globex"))
    assert one.status_code == 404  # the backend's answer: the alias is not globex's
    mine = await gw.request("GET", "/v1/models/assistant", headers=bearer("acme"))
    assert mine.json()["id"] == "assistant"
