"""The gateway as a drop-in base URL for JVM services: the JDK's own HTTP clients
(``java.net.http.HttpClient`` with its defaults, which offer HTTP/2 through an ``h2c``
upgrade, and ``HttpURLConnection`` with a chunked request body) get the same answers
through the gateway as from the upstream reached directly, and the upstream gets the
whole body and none of the client's hop-by-hop headers.

The client is ``tests/jvm/GatewayClient.java``; one JVM run per test drives both the
upstream (target ``direct``) and the gateway (target ``gateway``) and prints JSON lines.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from tests.conftest import ServeApp, StartGateway

pytestmark = pytest.mark.jvm

JVM_SOURCE = Path(__file__).parent / "jvm" / "GatewayClient.java"
JVM_TIMEOUT_S = 120.0
HOP_BY_HOP_SENT = ("upgrade", "http2-settings", "connection", "transfer-encoding", "keep-alive")
GATEWAY_ADDED = ("x-request-id", "x-gateway-backend")
STREAM_WORDS = ("Hello", ",", " JVM", "!")
MODELS = {
    "object": "list",
    "data": [{"id": "test-model", "object": "model", "created": 0, "owned_by": "tests"}],
}


# -- the upstream -------------------------------------------------------------------------
@dataclass
class Seen:
    """One request as the upstream received it."""

    target: str
    method: str
    path: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    peer: tuple[str, int]

    def header_names(self) -> set[str]:
        return {k.lower() for k, _ in self.headers}

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass
class Upstream:
    """An OpenAI-shaped upstream that records what it receives."""

    seen: list[Seen] = field(default_factory=list)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        return app

    async def _record(self, request: web.Request) -> Seen:
        seen = Seen(
            target=request.headers.get("X-Test-Target", ""),
            method=request.method,
            path=request.path,
            headers=tuple(
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers
            ),
            body=await request.read(),
            peer=request.transport.get_extra_info("peername") if request.transport else ("", 0),
        )
        self.seen.append(seen)
        return seen

    async def models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response(MODELS)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        seen = await self._record(request)
        data = json.loads(seen.body)
        if data.get("stream"):
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for chunk in stream_chunks(data["model"]):
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response(
            {
                "id": "chatcmpl-jvm",
                "object": "chat.completion",
                "created": 0,
                "model": data["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(STREAM_WORDS)},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11},
                "echo": {
                    "body_bytes": len(seen.body),
                    "body_sha256": hashlib.sha256(seen.body).hexdigest(),
                    "headers": {k.lower(): v for k, v in seen.headers},
                },
            }
        )


def stream_chunks(model: str) -> Iterator[dict[str, Any]]:
    """``chat.completion.chunk`` events: a role, one delta per word, then the finish."""

    def chunk(delta: dict[str, str], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": "chatcmpl-jvm",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    yield chunk({"role": "assistant"})
    for word in STREAM_WORDS:
        yield chunk({"content": word})
    yield chunk({}, "stop")


def expected_events(model: str = "test-model") -> list[str]:
    return [f"data: {json.dumps(c)}" for c in stream_chunks(model)] + ["data: [DONE]"]


# -- the JVM client -----------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Jvm:
    """The ``java`` launcher and the directory GatewayClient was compiled into."""

    java: str
    classes: Path


@pytest.fixture(scope="session")
def jvm(tmp_path_factory: pytest.TempPathFactory) -> Jvm:
    """GatewayClient.java compiled once per session."""
    javac, java = shutil.which("javac"), shutil.which("java")
    if javac is None or java is None:
        pytest.skip("no JDK on PATH (javac and java are needed for the JVM client tests)")
    out = tmp_path_factory.mktemp("jvm-classes")
    done = subprocess.run(
        [javac, "-d", str(out), str(JVM_SOURCE)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"javac failed:\n{done.stdout}{done.stderr}")
    return Jvm(java, out)


@dataclass
class Legs:
    """An upstream, a gateway in front of it, and the JVM client to drive both."""

    upstream: Upstream
    upstream_url: str
    gateway_url: str
    jvm: Jvm

    async def drive(self, *modes: str) -> dict[tuple[str, str], dict[str, Any]]:
        """Run the modes against ``direct`` then ``gateway`` in one JVM: (mode, target) ->
        what the client saw."""
        proc = await asyncio.create_subprocess_exec(
            self.jvm.java,
            "-XX:TieredStopAtLevel=1",
            "-cp",
            str(self.jvm.classes),
            "GatewayClient",
            ",".join(modes),
            f"direct={self.upstream_url}",
            f"gateway={self.gateway_url}",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            stdout, stderr = await asyncio.wait_for(proc.communicate(), JVM_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            pytest.fail(f"the JVM client did not finish {modes} in {JVM_TIMEOUT_S} s")
        assert proc.returncode == 0, stderr.decode()
        results = {}
        for line in stdout.decode().splitlines():
            result = json.loads(line)
            assert "error" not in result, result
            results[result["mode"], result["target"]] = result
        assert len(results) == 2 * len(modes), stdout.decode()
        return results

    def seen(self, target: str) -> list[Seen]:
        return [s for s in self.upstream.seen if s.target == target]


@pytest.fixture
async def legs(serve_app: ServeApp, start_gateway: StartGateway, jvm: Jvm) -> Legs:
    upstream = Upstream()
    url = await serve_app(upstream.app())
    gateway = await start_gateway(upstream=url)
    return Legs(upstream, url, gateway.url, jvm)


def without_gateway_headers(result: dict[str, Any]) -> dict[str, Any]:
    """What the client saw, less the headers the gateway adds and the echo of what the
    upstream received (which differs by design: the gateway adds and strips headers, so
    the Content-Length differs too; it is checked against the body instead)."""
    out = dict(result, target=None)
    headers = result["headers"]
    if "content-length" in headers and "body" in result:
        assert int(headers["content-length"]) == len(result["body"].encode())
    out["headers"] = {
        k: v for k, v in headers.items() if k not in (*GATEWAY_ADDED, "content-length")
    }
    if "body" in out and out["body"].startswith("{"):
        body = json.loads(out["body"])
        body.get("echo", {}).pop("headers", None)
        out["body"] = body
    return out


def assert_forwarded_cleanly(legs: Legs, result: dict[str, Any]) -> Seen:
    """The upstream got the client's whole body through the gateway, and no hop-by-hop
    header of the client's."""
    (seen,) = legs.seen("gateway")
    assert len(seen.body) == result["sent_bytes"]
    assert hashlib.sha256(seen.body).hexdigest() == result["sent_sha256"]
    leaked = seen.header_names() & set(HOP_BY_HOP_SENT)
    assert not leaked, f"hop-by-hop headers reached the upstream: {seen.headers}"
    assert seen.header("authorization") == "Bearer sk-test"
    assert seen.header("content-type") == "application/json"
    return seen


def assert_gateway_headers(result: dict[str, Any]) -> None:
    headers = result["headers"]
    assert headers.get("x-gateway-backend") == "upstream"
    request_id = headers.get("x-request-id", "")
    assert len(request_id) == 24 and int(request_id, 16) >= 0


# -- java.net.http.HttpClient, defaults (h2c upgrade offered) -----------------------------
async def test_http_client_chat_through_gateway_matches_direct(legs: Legs) -> None:
    """A default HttpClient POST, sent with ``Upgrade: h2c``, gets an HTTP/1.1 answer with
    the upstream's body, and the upstream gets the whole body without the upgrade offer."""
    results = await legs.drive("client-chat")
    direct, via = results["client-chat", "direct"], results["client-chat", "gateway"]
    assert direct["status"] == via["status"] == 200
    assert via["version"] == "HTTP_1_1"
    assert without_gateway_headers(via) == without_gateway_headers(direct)
    assert json.loads(via["body"])["echo"]["body_bytes"] == via["sent_bytes"]
    assert_gateway_headers(via)

    (direct_seen,) = legs.seen("direct")
    assert direct_seen.header("upgrade") == "h2c", "the JDK client no longer offers h2c"
    assert "http2-settings" in direct_seen.header_names()
    assert_forwarded_cleanly(legs, via)


async def test_http_client_stream_events_arrive_and_end_with_done(legs: Legs) -> None:
    """A default HttpClient reading an SSE chat stream with ``ofLines()`` gets every
    ``chat.completion.chunk`` event, then ``data: [DONE]``, through the gateway."""
    results = await legs.drive("client-stream")
    direct, via = results["client-stream", "direct"], results["client-stream", "gateway"]
    assert direct["status"] == via["status"] == 200
    assert via["version"] == "HTTP_1_1"
    assert via["headers"]["content-type"].startswith("text/event-stream")
    assert via["events"] == direct["events"] == expected_events()
    assert without_gateway_headers(via) == without_gateway_headers(direct)
    assert_gateway_headers(via)
    assert_forwarded_cleanly(legs, via)


async def test_http_client_lists_models(legs: Legs) -> None:
    """A default HttpClient GET /v1/models gets the upstream's list through the gateway."""
    results = await legs.drive("client-models")
    direct, via = results["client-models", "direct"], results["client-models", "gateway"]
    assert direct["status"] == via["status"] == 200
    assert via["version"] == "HTTP_1_1"
    assert json.loads(via["body"]) == json.loads(direct["body"]) == MODELS
    assert without_gateway_headers(via) == without_gateway_headers(direct)
    assert_gateway_headers(via)
    (seen,) = legs.seen("gateway")
    assert (seen.method, seen.path, seen.body) == ("GET", "/v1/models", b"")
    assert not seen.header_names() & set(HOP_BY_HOP_SENT), seen.headers


async def test_http_client_chunked_body_with_h2c_offer_reaches_upstream_whole(
    legs: Legs,
) -> None:
    """A default HttpClient POST whose body has no known length goes out chunked *and*
    with the h2c offer; the gateway still reads all of it and answers like the upstream."""
    results = await legs.drive("client-chunked")
    direct, via = results["client-chunked", "direct"], results["client-chunked", "gateway"]
    assert direct["status"] == via["status"] == 200
    assert via["version"] == "HTTP_1_1"
    assert without_gateway_headers(via) == without_gateway_headers(direct)
    assert_gateway_headers(via)

    (direct_seen,) = legs.seen("direct")
    assert direct_seen.header("transfer-encoding") == "chunked"
    assert direct_seen.header("upgrade") == "h2c"
    assert_forwarded_cleanly(legs, via)


# -- java.net.HttpURLConnection, chunked request body -------------------------------------
async def test_url_connection_chunked_chat_through_gateway_matches_direct(legs: Legs) -> None:
    """A chunked HttpURLConnection POST reaches the upstream whole, and its answer comes
    back as the upstream gave it."""
    results = await legs.drive("urlconn-chat")
    direct, via = results["urlconn-chat", "direct"], results["urlconn-chat", "gateway"]
    assert direct["status"] == via["status"] == 200
    assert without_gateway_headers(via) == without_gateway_headers(direct)
    assert json.loads(via["body"])["echo"]["body_bytes"] == via["sent_bytes"]
    assert_gateway_headers(via)

    (direct_seen,) = legs.seen("direct")
    assert direct_seen.header("transfer-encoding") == "chunked"
    assert len(direct_seen.body) == direct["sent_bytes"]
    assert_forwarded_cleanly(legs, via)


async def test_url_connection_chunked_stream_events_end_with_done(legs: Legs) -> None:
    """A chunked HttpURLConnection streaming chat reads every SSE event and ``[DONE]``."""
    results = await legs.drive("urlconn-stream")
    direct, via = results["urlconn-stream", "direct"], results["urlconn-stream", "gateway"]
    assert direct["status"] == via["status"] == 200
    assert via["headers"]["content-type"].startswith("text/event-stream")
    assert via["events"] == direct["events"] == expected_events()
    assert without_gateway_headers(via) == without_gateway_headers(direct)
    assert_gateway_headers(via)
    assert_forwarded_cleanly(legs, via)


# -- request ids --------------------------------------------------------------------------
async def test_client_request_id_is_echoed_and_forwarded(legs: Legs) -> None:
    """A client-supplied X-Request-ID comes back on the response and reaches the upstream,
    from both JDK clients."""
    results = await legs.drive("client-reqid", "urlconn-reqid")
    for mode in ("client-reqid", "urlconn-reqid"):
        via = results[mode, "gateway"]
        assert via["status"] == 200
        assert via["headers"]["x-request-id"] == f"jvm-{mode}-gateway"
        assert via["headers"]["x-gateway-backend"] == "upstream"
    forwarded = [s.header("x-request-id") for s in legs.seen("gateway")]
    assert forwarded == ["jvm-client-reqid-gateway", "jvm-urlconn-reqid-gateway"]


async def test_http_client_keeps_working_on_a_reused_connection(legs: Legs) -> None:
    """One default HttpClient, as a Spring app holds, sends chat, stream, models and chat
    again in turn: after the declined h2c offer its kept-alive HTTP/1.1 connection keeps
    giving the same answers through the gateway as directly."""
    modes = ("client-chat", "client-stream", "client-models", "client-reqid")
    results = await legs.drive(*modes)
    for mode in modes:
        direct, via = results[mode, "direct"], results[mode, "gateway"]
        assert direct["status"] == via["status"] == 200, mode
        assert via["version"] == "HTTP_1_1", mode
        assert without_gateway_headers(via) == without_gateway_headers(direct), mode
    assert results["client-stream", "gateway"]["events"] == expected_events()
    # The JDK client did reuse its connection (seen directly), so the gateway leg ran on
    # a reused connection too.
    assert len({s.peer for s in legs.seen("direct")}) == 1
    for seen in legs.seen("gateway"):
        assert not seen.header_names() & set(HOP_BY_HOP_SENT), seen.headers
    assert [len(s.body) for s in legs.seen("gateway")] == [
        results[m, "gateway"].get("sent_bytes", 0) for m in modes
    ]
