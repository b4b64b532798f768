"""The one resend: a pooled keep-alive connection the backend closes without answering.
The backend may have run the request before closing, so only a request that may be
repeated is sent again: safe methods, inference calls (OpenAI, KServe V2, TF Serving, TEI),
and any request with an ``Idempotency-Key``; any other POST, a PUT, PATCH or DELETE gets a
502 instead."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.helpers import CHAT
from tests.upstreams import RawExchange

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


def closes_its_second_request(exchanges: list[RawExchange]):
    """Answer the first request of connection 1, then close it on the second unanswered."""

    def respond(ex: RawExchange):
        on_first = [e for e in exchanges if e.connection == 1]
        if ex.connection == 1 and len(on_first) == 2:
            return b"", "close"
        return OK

    return respond


@pytest.mark.parametrize(
    ("method", "path", "headers", "resent"),
    [
        ("GET", "/v1/models", {}, True),
        ("HEAD", "/v1/models", {}, True),
        ("OPTIONS", "/v1/models", {}, True),
        ("POST", "/v1/chat/completions", {}, True),
        ("POST", "/v1/embeddings", {}, True),
        ("POST", "/v2/models/rowsum/infer", {}, True),
        ("POST", "/v1/models/sum:predict", {}, True),
        ("POST", "/embed", {}, True),
        ("POST", "/v1/orders", {}, False),
        ("POST", "/v1/orders", {"Idempotency-Key": "k-1"}, True),
        ("PUT", "/v1/files/a", {}, False),
        ("PATCH", "/v1/files/a", {}, False),
        ("DELETE", "/v1/files/a", {}, False),
    ],
)
async def test_a_stale_connection_resends_only_what_may_be_repeated(
    raw_backend, start_gateway, method, path, headers, resent
):
    exchanges: list[RawExchange] = []
    url, backend = await raw_backend(closes_its_second_request(exchanges))
    backend.exchanges = exchanges
    gw = await start_gateway(upstream=url)
    body = CHAT if path == "/v1/chat/completions" else {"model": "m", "input": "x"}
    async with httpx.AsyncClient() as client:
        assert (await client.get(gw.url + "/v1/models")).status_code == 200
        kwargs: dict[str, Any] = {"json": body} if method in ("POST", "PUT", "PATCH") else {}
        r = await client.request(method, gw.url + path, headers=headers, **kwargs)
    if resent:
        assert r.status_code == 200
        assert [e.connection for e in exchanges] == [1, 1, 2]
        assert gw.gateway.metrics.upstream_retries.labels("upstream")._value.get() == 1
    else:
        assert r.status_code == 502
        assert r.json()["error"]["code"] == "upstream_unavailable"
        assert f"a {method} is not sent twice" in r.json()["error"]["message"]
        assert [e.connection for e in exchanges] == [1, 1]
