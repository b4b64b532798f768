"""Raw clients against the data plane, one per request a proxy must not serve as written:
each gets its status (OpenAI-shaped), the backend sees nothing it should not, the path
routed is the path forwarded, and the gateway serves on."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.helpers import CHAT, parse_responses, send_raw, write_policy
from tests.upstreams import Recorder


@pytest.fixture
async def v1_only(serve_app, start_gateway, tmp_path):
    """A gateway whose one route is ``/v1/*``: every other path must stay unreachable."""
    recorder = Recorder()
    url = await serve_app(recorder.app())
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{match: {{path: "/v1/*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    return recorder, gw


def get(target: str, extra: str = "") -> bytes:
    return f"GET {target} HTTP/1.1\r\nHost: gw\r\n{extra}Connection: close\r\n\r\n".encode()


@pytest.mark.parametrize(
    ("target", "status", "code"),
    [
        ("/v1/../internal/secret", 404, "no_route"),
        ("/v1/./../internal/secret", 404, "no_route"),
        ("/v1/%2e%2e/internal/secret", 400, "malformed_request"),
        ("/v1/.%2E/internal/secret", 400, "malformed_request"),
        ("/v1/..%2Finternal/secret", 400, "malformed_request"),
        ("/v1/%2F../internal/secret", 400, "malformed_request"),
        ("/v1/%5C../internal/secret", 400, "malformed_request"),
        ("/v1\\..\\internal\\secret", 400, "malformed_request"),
        ("/v1/models%zz", 400, "malformed_request"),
        ("/v1/models#fragment", 400, "malformed_request"),
        ("*", 400, "malformed_request"),
        ("ftp://admin.internal/v1/models", 400, "malformed_request"),
    ],
)
async def test_a_path_that_could_escape_the_route_is_refused_or_resolved(
    v1_only, target, status, code
):
    recorder, gw = v1_only
    [answer] = await send_raw(gw.url, get(target))
    assert answer.status == status
    assert answer.headers["content-type"] == "application/json"
    assert answer.json()["error"]["code"] == code
    assert recorder.seen == []


@pytest.mark.parametrize(
    ("target", "forwarded"),
    [
        ("/v1/./models", "/v1/models"),
        ("//v1//models", "/v1/models"),
        ("/v1/x/../models", "/v1/models"),
        ("/v1/%6Dodels?q=%2F..", "/v1/models?q=%2F.."),
        ("http://admin.internal/v1/models?x=1", "/v1/models?x=1"),
        ("HTTPS://admin.internal:8443/v1/models", "/v1/models"),
    ],
)
async def test_the_path_forwarded_is_the_normalised_path_routing_matched(
    v1_only, target, forwarded
):
    """Absolute-form becomes origin-form, and its host never reaches the backend: the Host
    the backend sees is its own URL's."""
    recorder, gw = v1_only
    [answer] = await send_raw(gw.url, get(target))
    assert answer.status == 200
    seen = recorder.seen[-1]
    assert seen.path_qs == forwarded
    assert seen.headers["Host"].startswith("127.0.0.1:")
    assert "admin.internal" not in json.dumps(seen.headers)


async def test_a_method_override_never_reaches_the_backend(v1_only):
    """The gateway decides on the request line's method (a listing refused, a control
    endpoint written to); a header naming another, which Rack, Laravel and middleware of
    Express and ASP.NET Core take for the method, is not passed on."""
    recorder, gw = v1_only
    overrides = ("X-HTTP-Method-Override", "X-HTTP-Method", "X-Method-Override")
    extra = "".join(f"{name}: GET\r\n" for name in overrides)
    request = (
        "POST /v1/files HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n"
        f"{extra}Connection: close\r\n\r\n{{}}"
    )
    [answer] = await send_raw(gw.url, request.encode())
    assert answer.status == 200
    seen = recorder.seen[-1]
    assert seen.method == "POST"
    assert not {name.lower() for name in overrides} & {h.lower() for h in seen.headers}


async def test_an_encoded_path_is_routed_as_the_endpoint_it_names(v1_only):
    """``/v1/%63hat/completions`` is the chat endpoint (an encoded unreserved letter is the
    same path), so its body is validated like any chat body."""
    recorder, gw = v1_only
    body = b"{not json"
    data = b"POST /v1/%63hat/completions HTTP/1.1\r\nHost: gw\r\n" + (
        b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(body), body)
    )
    [answer] = await send_raw(gw.url, data)
    assert answer.status == 400 and answer.json()["error"]["code"] == "invalid_json"
    assert recorder.seen == []


@pytest.mark.parametrize(
    ("data", "status"),
    [
        pytest.param(b"CONNECT admin.internal:443 HTTP/1.1\r\nHost: x\r\n\r\n", 405, id="CONNECT"),
        pytest.param(b"TRACE /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 405, id="TRACE"),
        pytest.param(b"OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="OPTIONS *"),
        pytest.param(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 505, id="HTTP/2 prior knowledge"),
        pytest.param(
            b"GET /v1/models HTTP/2.0\r\nHost: x\r\n\r\n", 505, id="HTTP/2.0 request line"
        ),
        pytest.param(b"GET /v1/models\r\n\r\n", 505, id="HTTP/0.9"),
        pytest.param(b"FOO /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="unknown method"),
        pytest.param(b"get /v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 400, id="lower-case method"),
        pytest.param(b"GET /v1/models HTTP/1.1\r\n\r\n", 400, id="HTTP/1.1 without Host"),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, id="two Host headers"
        ),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer a\r\n"
            b"Authorization: Bearer b\r\n\r\n",
            400,
            id="two Authorization headers",
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n"
            b"2\r\nhi\r\n0\r\n\r\n",
            400,
            id="transfer-encoding gzip, chunked",
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\nhi",
            400,
            id="transfer-encoding identity",
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n",
            400,
            id="content-length with transfer-encoding",
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nhi",
            400,
            id="two content-lengths",
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nContent-Length: +2\r\n\r\nhi",
            400,
            id="content-length +2",
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n0x2\r\nhi\r\n0\r\n\r\n",
            400,
            id="chunk size 0x2",
        ),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-A: a\r\n b\r\n\r\n", 400, id="folded header"
        ),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-A : b\r\n\r\n", 400, id="space before colon"
        ),
        pytest.param(b"GET /v1/models HTTP/1.1\nHost: a\n\n", 400, id="bare LF"),
        pytest.param(
            b"GET /v1/models HTTP/1.1\r\nHost: a\r\nX-A: a\x00b\r\n\r\n", 400, id="NUL in a value"
        ),
        pytest.param(
            b"POST /v1/x HTTP/1.1\r\nHost: a\r\nExpect: 200-ok\r\nContent-Length: 2\r\n\r\nhi",
            417,
            id="an Expect that cannot be met",
        ),
    ],
)
async def test_a_request_a_proxy_must_not_serve_is_refused_and_nothing_reaches_the_backend(
    v1_only, data, status
):
    recorder, gw = v1_only
    [answer] = await send_raw(gw.url, data)
    assert answer.status == status
    assert answer.headers["connection"] == "close"
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if status == 405:
        assert answer.headers["allow"].startswith("GET, HEAD, POST")
    assert recorder.seen == []
    async with httpx.AsyncClient() as client:
        ok = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200


async def test_pipelined_requests_are_answered_in_order(v1_only):
    recorder, gw = v1_only
    body = json.dumps(CHAT).encode()
    chat = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    answers = await send_raw(
        gw.url,
        get("/v1/models").replace(b"Connection: close\r\n", b"") * 2 + chat + get("/v1/models"),
    )
    assert [a.status for a in answers] == [200, 200, 200, 200]
    assert [s.path_qs for s in recorder.seen] == ["/v1/models"] * 2 + [
        "/v1/chat/completions",
        "/v1/models",
    ]
    assert answers[2].json()["choices"][0]["message"]["content"] == "echo: hello there"


@pytest.mark.parametrize("version", ["1.1", "1.0"])
async def test_nothing_after_a_request_that_closes_is_parsed_or_answered(
    serve_app, start_gateway, tmp_path, version
):
    """RFC 9112 9.6: after ``Connection: close`` (or an HTTP/1.0 request without keep-alive)
    the server processes no further request.  What the client sends after it, well formed
    or not, while its answer is still on the way, is read and discarded: the one answer is
    the last, and no "400" answers a request that was never processed."""
    recorder = Recorder()
    url = await serve_app(recorder.app())
    policy = (
        f"backends: {{main: {{url: '{url}'}}}}\nroutes: [{{match: {{path: '/*'}}, backend: main}}]"
    )
    gw = await start_gateway(policy=write_policy(tmp_path, policy))
    last = get("/slow")
    if version == "1.0":
        last = last.replace(b"HTTP/1.1", b"HTTP/1.0").replace(b"Connection: close\r\n", b"")
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(last)
    await asyncio.wait_for(recorder.arrived.wait(), 5)
    writer.write(get("/v1/models?never") + b"\x00 not HTTP at all\r\n\r\n")
    await writer.drain()
    await asyncio.sleep(0.05)  # read by the gateway while the answer is held
    recorder.release.set()
    raw = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert [a.status for a in parse_responses(raw)] == [200]
    assert raw.count(b"HTTP/1.1 ") == 1  # llhttp would stop reading at the close: count
    assert [s.path_qs for s in recorder.seen] == ["/slow"]


async def test_a_bad_request_after_a_good_one_is_answered_after_it_then_closed(v1_only):
    recorder, gw = v1_only
    good = get("/v1/models").replace(b"Connection: close\r\n", b"")
    answers = await send_raw(gw.url, good + b"TRACE / HTTP/1.1\r\nHost: gw\r\n\r\n" + good)
    assert [a.status for a in answers] == [200, 405]
    assert answers[1].headers["connection"] == "close"
    assert len(recorder.seen) == 1


async def test_expect_100_continue_gets_its_interim_answer_before_the_body(v1_only):
    recorder, gw = v1_only
    host, port = gw.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps(CHAT).encode()
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
    )
    interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(body)
    rest = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    assert rest.startswith(b"HTTP/1.1 200 OK\r\n")
    assert recorder.seen[-1].body == body


async def test_an_h2c_upgrade_offer_is_declined_and_the_body_still_read(v1_only):
    """The JDK's HttpClient offers h2c with a body; llhttp stops at such a head, so the
    body is read on by a fresh parser: all of it reaches the backend, none of the offer."""
    recorder, gw = v1_only
    body = json.dumps(CHAT).encode()
    for framing in (b"Content-Length: %d\r\n" % len(body), b"Transfer-Encoding: chunked\r\n"):
        sent = (
            body if framing.startswith(b"Content") else b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )
        data = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nConnection: Upgrade, HTTP2-Settings\r\n"
            b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\nContent-Type: application/json\r\n"
            + framing
            + b"\r\n"
            + sent
        )
        answers = await send_raw(gw.url, data + get("/v1/models"))
        assert [a.status for a in answers] == [200, 200]
        seen = recorder.seen[-2]
        assert seen.body == body
        assert not {"upgrade", "http2-settings", "connection"} & {k.lower() for k in seen.headers}


async def test_http_1_0_is_served_and_closed(v1_only):
    _recorder, gw = v1_only
    [answer] = await send_raw(gw.url, b"GET /v1/models HTTP/1.0\r\n\r\n")
    assert answer.status == 200 and answer.json()["object"] == "list"


@pytest.mark.parametrize(
    "connection",
    [
        [b"Connection: close", b"Connection: keep-alive"],
        [b"Connection: keep-alive, close"],
        [b"Connection: Keep-Alive", b"Connection: upgrade, CLOSE"],
    ],
)
async def test_close_wins_over_keep_alive_in_http_1_0(v1_only, connection):
    """llhttp keeps an HTTP/1.0 connection open when ``keep-alive`` is among its options even
    beside ``close`` (found by the client fuzzer); the gateway closes (RFC 9112 9.6), says
    so, and answers nothing the client sends after it."""
    recorder, gw = v1_only
    head = b"GET /v1/models HTTP/1.0\r\nHost: gw\r\n" + b"\r\n".join(connection) + b"\r\n\r\n"
    answers = await send_raw(gw.url, head + get("/v1/models"))
    assert [a.status for a in answers] == [200]
    assert answers[0].headers["connection"] == "close"
    assert len(recorder.seen) == 1


async def test_transfer_encoding_in_http_1_0_is_refused_and_closed(v1_only):
    """RFC 9112 6.1: an HTTP/1.0 message with Transfer-Encoding has faulty framing (a 1.0
    peer in between may have kept part of the body); as nginx does, a 400 and the close,
    and nothing sent after it reaches the backend."""
    recorder, gw = v1_only
    body = b'{"model": "m", "messages": []}'
    head = (
        b"POST /v1/chat/completions HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    answers = await send_raw(gw.url, head + chunked + get("/v1/models"))
    assert [a.status for a in answers] == [400]
    assert "HTTP/1.0" in answers[0].json()["error"]["message"]
    assert answers[0].headers["connection"] == "close"
    assert recorder.seen == []


async def test_http_1_0_keep_alive_is_kept(v1_only):
    recorder, gw = v1_only
    alive = b"GET /v1/models HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\n\r\n"
    answers = await send_raw(gw.url, alive + get("/v1/models"))
    assert [a.status for a in answers] == [200, 200]
    assert answers[0].headers["connection"] == "keep-alive"
    assert len(recorder.seen) == 2


async def test_a_flood_of_pipelined_requests_is_capped(v1_only):
    """Hundreds of tiny pipelined requests in one write: the first ones are answered in
    order, then a 400 once more than ``MAX_PIPELINED`` wait, and the connection closes."""
    recorder, gw = v1_only
    one = get("/v1/models").replace(b"Connection: close\r\n", b"")
    answers = await send_raw(gw.url, one * 500)
    statuses = [a.status for a in answers]
    assert statuses[-1] == 400 and set(statuses[:-1]) == {200}
    assert "pipelined" in answers[-1].json()["error"]["message"]
    assert len(recorder.seen) == len(statuses) - 1 < 100


async def test_an_answer_that_keeps_the_connection_says_how_long_it_waits_idle(v1_only):
    """``Keep-Alive: timeout=N`` (``server.keepalive_timeout_s``, 75 s by default) on every
    answer that keeps the connection, as Node's and Apache's servers send it: a client that
    reads it (Node's undici) closes an idle connection before the gateway does, rather than
    write a request into the gateway's close.  An answer that closes says only that."""
    _recorder, gw = v1_only
    alive = b"GET /v1/models HTTP/1.0\r\nHost: gw\r\nConnection: keep-alive\r\n\r\n"
    kept = b"GET /v1/models HTTP/1.1\r\nHost: gw\r\n\r\n"
    answers = await send_raw(gw.url, kept + alive + get("/v1/models"))
    assert [a.headers.get("keep-alive") for a in answers] == ["timeout=75"] * 2 + [None]
    assert answers[2].headers["connection"] == "close"
