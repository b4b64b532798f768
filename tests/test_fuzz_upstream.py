"""Property-based fuzzing of the upstream response path (hypothesis, bounded): whatever
bytes a backend sends, in whatever pieces, then a clean close, a reset or nothing, the
upstream client (``transport.connection.Connection``) either delivers a correctly framed answer or fails
with an ``UpstreamError``; nothing else escapes, and the connection is reusable only after
a clean exchange.  h11, a strict parser written apart from llhttp, is the oracle: where the
client calls an answer complete, h11 reads the same status and the same body, and where
the client would pool the connection, h11 agrees the answer ended cleanly with keep-alive
and nothing after it but empty lines (which llhttp passes over between messages, as RFC
9112 2.2 allows).  The client may refuse more than h11 does (it is meant to be strict).
``GATEWAY_FUZZ_EXAMPLES`` raises the number of examples per test from CI's 400.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h11
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import Gateway
from gateway.errors import UpstreamError
from gateway.policy.watch import PolicySource
from gateway.testing import FakeSocket
from gateway.transport.connection import Connection
from tests.upstreams import RawBackend

SETTINGS = settings(
    max_examples=int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "400")),  # CI: 400; more by hand
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
LOOP = asyncio.new_event_loop()


@dataclass
class Seen:
    """What the upstream client made of the bytes."""

    status: int | None = None
    body: bytes = b""
    complete: bool = False
    error: BaseException | None = None
    reusable: bool = False


@dataclass
class Oracle:
    """What h11 made of the same bytes."""

    status: int | None = None
    body: bytes = b""
    complete: bool = False
    error: bool = False
    clean: bool = False


async def upstream_client(pieces: list[bytes], ending: str, head: bool) -> Seen:
    conn = Connection("fuzz", asyncio.get_running_loop())
    sock = FakeSocket()
    conn.connection_made(sock)  # type: ignore[arg-type]
    waiter = conn.send(
        b"GET / HTTP/1.1\r\nHost: b\r\n\r\n", b"", no_body=head, timeout_s=60, idle_s=60
    )
    for piece in pieces:
        if sock.closed:
            break  # the client closed or aborted: the backend's bytes go nowhere now
        conn.data_received(piece)
    seen = Seen(reusable=conn.reusable and not sock.closed)
    if ending == "eof" and not sock.closed:
        conn.eof_received()
        conn.connection_lost(None)
    elif ending == "reset" or sock.closed:
        conn.connection_lost(ConnectionResetError() if ending == "reset" else None)
    if not waiter.done():
        assert ending == "keep", "a closed connection left its exchange waiting"
        waiter.cancel()
        return seen
    if waiter.exception() is not None:
        seen.error = waiter.exception()
        return seen
    seen.status = waiter.result().status
    body = bytearray()
    try:
        async with asyncio.timeout(0.05):  # only what already arrived: nothing is waited for
            async for chunk in conn.body_chunks():
                body += chunk
        seen.complete = conn.complete
    except TimeoutError:
        assert ending == "keep", "a closed connection left its body waiting"
    except UpstreamError as exc:
        seen.error = exc
    seen.body = bytes(body)
    return seen


def h11_reading(data: bytes, ending: str, head: bool) -> Oracle:
    """h11 on ``data`` then ``ending``; ``clean`` as it stands before the ending (when the
    upstream client decides whether to pool)."""
    oracle = _h11(data, ending, head)
    oracle.clean = _h11(data, "keep", head).clean
    return oracle


def _h11(data: bytes, ending: str, head: bool) -> Oracle:
    oracle = Oracle()
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="HEAD" if head else "GET", target="/", headers=[("Host", "b")]))
    conn.send(h11.EndOfMessage())
    body = bytearray()
    try:
        conn.receive_data(data)
        if ending == "eof":
            conn.receive_data(b"")
        while True:
            event = conn.next_event()
            if event in (h11.NEED_DATA, h11.PAUSED) or isinstance(event, h11.ConnectionClosed):
                break
            if isinstance(event, h11.Response):
                oracle.status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                oracle.complete = True
                break
    except h11.RemoteProtocolError:
        oracle.error = True
    oracle.body = bytes(body)
    trailing, closed = conn.trailing_data
    oracle.clean = (
        oracle.complete
        and conn.their_state is h11.DONE
        and conn.our_state is h11.DONE
        # llhttp, like RFC 9112 2.2 allows, passes over empty lines between messages
        and not trailing.strip(b"\r\n")
        and not closed
    )
    return oracle


def check(data: bytes, cuts: list[int], ending: str, head: bool) -> None:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    pieces = [p for p in pieces if p]
    seen = LOOP.run_until_complete(upstream_client(pieces, ending, head))
    if seen.error is not None:
        assert isinstance(seen.error, UpstreamError), repr(seen.error)
    oracle = h11_reading(data, ending, head)
    if seen.complete:
        assert not oracle.error, f"complete here, h11 refuses: {data!r}"
        assert oracle.complete, f"complete here, h11 wants more: {data!r}"
        assert (seen.status, seen.body) == (oracle.status, oracle.body), data
    if seen.reusable:
        assert seen.complete or seen.status is not None
        assert oracle.clean, f"pooled, but h11 finds the exchange unclean: {data!r}"


# -- structured answers: framings parsers read differently, cut and ended anyhow ----------
STATUS = st.sampled_from(
    [
        b"200 OK",
        b"204 No Content",
        b"304 Not Modified",
        b"404 Not Found",
        b"500 Oops",
        b"200",
        b"2000 OK",
        b"600 Odd",
        b"099 Odd",
        b"20 OK",
        b"abc OK",
        b"200 OK\x00",
    ]
)
VERSION = st.sampled_from(
    [b"HTTP/1.1", b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.9", b"http/1.1"]
)
EOL = st.sampled_from([b"\r\n"] * 6 + [b"\n", b"\r"])
EXTRA = st.sampled_from(
    [
        b"Content-Type: application/json",
        b"X-A: a",
        b"X-A: a\r\n b",
        b"X-A : a",
        b" X-A: a",
        b"X-A: a\x00b",
        b"X-A:",
        b": v",
        b"Connection: close",
        b"Connection: keep-alive",
        b"Keep-Alive: timeout=5",
        b"X-Obs: caf\xe9",
        b"Content-Length: 3",
        b"Content-Length: +3",
        b"Content-Length: 1_0",
        b"Content-Length: 3, 3",
        b"Transfer-Encoding: chunked",
        b"Transfer-Encoding: xchunked",
        b"Transfer-Encoding: gzip, chunked",
        b"Upgrade: h2c",
    ]
)
CHUNK_SIZE = st.sampled_from(
    ["{:x}", "{:X}", "00{:x}", "0x{:x}", "-{:x}", "{:x} ", "{:x};e=1", "{:d}"]
)


@st.composite
def answers(draw: st.DrawFn) -> bytes:
    eol = draw(EOL)
    lines = [draw(VERSION) + b" " + draw(STATUS)]
    if draw(st.booleans()):
        lines = [b"HTTP/1.1 100 Continue", b"", *lines] if draw(st.booleans()) else lines
    lines += draw(st.lists(EXTRA, max_size=3))
    body = draw(st.binary(max_size=40))
    framing = draw(st.sampled_from(["length", "short", "long", "chunked", "close", "both"]))
    payload = body
    if framing in ("length", "short", "long"):
        n = len(body) + {"length": 0, "short": -1, "long": 3}[framing]
        lines.append(b"Content-Length: %d" % max(n, 0))
    elif framing in ("chunked", "both"):
        lines.append(b"Transfer-Encoding: chunked")
        if framing == "both":
            lines.append(b"Content-Length: %d" % len(body))
        parts = draw(st.lists(st.binary(min_size=1, max_size=12), max_size=3))
        payload = (
            b"".join(draw(CHUNK_SIZE).format(len(p)).encode() + eol + p + eol for p in parts)
            + b"0"
            + eol
            + (b"X-Trailer: t" + eol if draw(st.booleans()) else b"")
            + eol
        )
    head = eol.join(lines) + eol + eol
    after = draw(
        st.sampled_from(
            [b"", b"", b"", b"garbage", b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"]
        )
    )
    return head + payload + after


@SETTINGS
@given(
    data=answers(),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6),
    ending=st.sampled_from(["eof", "reset", "keep"]),
    head=st.booleans(),
)
def test_structured_answers_are_framed_right_or_refused(data, cuts, ending, head):
    check(data, cuts, ending, head)


@SETTINGS
@given(
    data=st.one_of(
        st.binary(max_size=120),
        st.binary(max_size=120).map(lambda b: b"HTTP/1.1 200 OK\r\n" + b),
        st.binary(max_size=60).map(lambda b: b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n" + b),
        st.binary(max_size=60).map(
            lambda b: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b
        ),
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=6),
    ending=st.sampled_from(["eof", "reset", "keep"]),
    head=st.booleans(),
)
def test_arbitrary_bytes_never_escape_as_anything_but_an_upstream_error(data, cuts, ending, head):
    check(data, cuts, ending, head)


# -- end to end: the same answers from a raw backend, through a running gateway ----------
class Harness:
    """One raw backend and one gateway in front of it, on ``LOOP``, shared by the examples."""

    def __init__(self) -> None:
        self.answer: tuple[bytes, str] = (b"", "close")
        self.backend = RawBackend(lambda ex: self.answer)
        self.gateway: Gateway | None = None
        self.url = ""

    async def start(self, policy_dir: Path) -> None:
        backend_url = await self.backend.start()
        policy = policy_dir / "policy.yaml"
        policy.write_text(
            f'backends: {{main: {{url: "{backend_url}", timeout_s: 3, idle_timeout_s: 0.3}}}}\n'
            "routes: [{backend: main}]\n"
        )
        self.gateway = Gateway(PolicySource(policy))
        self.url, _ = await self.gateway.start("127.0.0.1", 0, "127.0.0.1", 0, warmup=False)

    async def stop(self) -> None:
        if self.gateway is not None:
            await self.gateway.shutdown(0.5)
        await self.backend.close()

    async def ask(self) -> tuple[int, bytes] | type[Exception]:
        async with httpx.AsyncClient(timeout=15) as client:
            try:
                r = await client.get(self.url + "/x")
            except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
                return type(exc)
            return r.status_code, r.content


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Iterator[Harness]:
    harness = Harness()
    LOOP.run_until_complete(harness.start(tmp_path_factory.mktemp("fuzz")))
    yield harness
    LOOP.run_until_complete(harness.stop())


@settings(SETTINGS, max_examples=int(os.environ.get("GATEWAY_FUZZ_EXAMPLES", "400")) // 5)
@given(data=answers(), ending=st.sampled_from(["close", "reset", "hang"]))
def test_through_the_gateway_a_client_gets_the_answer_a_502_or_a_cut_stream(harness, data, ending):
    harness.answer = (data, ending)
    got = LOOP.run_until_complete(harness.ask())
    oracle = _h11(data, "eof" if ending == "close" else "keep", False)
    if isinstance(got, type):
        return  # a cut stream: the head had gone out before the framing broke
    status, body = got
    if body.startswith(b'{"error"'):  # the gateway's own answer: only an upstream failure
        code = json.loads(body)["error"]["code"]
        assert status in (502, 504), body
        assert code in ("bad_upstream_response", "upstream_unavailable", "upstream_timeout")
    else:  # the backend's answer, exactly as h11 reads it
        assert oracle.complete, data
        assert (status, body) == (oracle.status, oracle.body)
    # And it serves on, also after the backend drops a connection it left hanging.
    harness.backend.drop_connections()
    harness.answer = (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", "keep")
    assert LOOP.run_until_complete(harness.ask()) == (200, b"ok")
