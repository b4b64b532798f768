"""Bounded fuzzing of the client side of the data plane: mutated request heads (framing
headers doubled, folded, misspelt or contradicting, bare line ends, stray bytes, other
versions, upgrades, ``Expect``, ``Connection: close``) and mutated bodies of chat, the
Responses API, Anthropic's Messages API, the servers' own APIs on a route that caches and
bounds them, and the gateway's own ``/cache/feedback`` (wide JSON past ``max_json_values``
and JSON nested past what a recursive parser reads among them), chunked bodies cut into tiny chunks with
extensions and trailers (some forbidden in a trailer), each followed on the same
connection by a well-formed request.  Whatever arrives:

- the gateway itself answers nothing 5xx but its documented 505 for an HTTP version it does
  not serve (every other 5xx must be the backend's, relayed);
- a connection carries at most the two answers, and a second one is the follow-up's (its
  ``X-Request-ID``), so no answer is ever another request's;
- nothing after a request that closes the connection is answered;
- the gateway logs no error and still answers an ordinary request afterwards.

The cases come from a seeded generator (``GATEWAY_FUZZ_CASES`` raises their number from
CI's 300, ``GATEWAY_FUZZ_SEED`` draws others); a failure prints the case's bytes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import re
from typing import Any

import httpx

from tests.helpers import CHAT, write_policy
from tests.upstreams import Recorder

CASES = int(os.environ.get("GATEWAY_FUZZ_CASES", "300"))
SEED = int(os.environ.get("GATEWAY_FUZZ_SEED", "20261201"))

HEADERS = [
    b"Transfer-Encoding: chunked",
    b"Transfer-Encoding: gzip, chunked",
    b"Transfer-Encoding:\tchunked",
    b"Transfer-Encoding : chunked",
    b"Content-Length: 0",
    b"Content-Length: 5",
    b"Content-Length: -1",
    b"Content-Length: 1e3",
    b"Content-Length: +65",
    b" folded",
    b"X-A: b\rc",
    b"X-A: \x00",
    b"Host: y",
    b"Connection: keep-alive, Upgrade",
    b"Upgrade: h2c",
    b"Expect: 100-continue",
    b"Expect: 999-nope",
    b"X-Big: " + b"a" * 9000,
    b"\x80bad: 1",
    b"Content-Encoding: gzip",
    b"Connection: close",
    b"Authorization: Bearer a",
    b"Authorization: Bearer b",
    b"Inference-Header-Content-Length: 60",  # KServe's binary tensor extension
    b"Inference-Header-Content-Length: " + b"9" * 5000,
]
LINES = [
    b"POST /v1/chat/completions HTTP/1.0",
    b"POST /v1/chat/completions HTTP/2.0",
    b"POST http://evil/v1/chat/completions HTTP/1.1",
    b"POST /v1/../admin HTTP/1.1",
    b"POST /v1/chat/completions?x=%00 HTTP/1.1",
    b"POST  /v1/chat/completions HTTP/1.1",
    b"GET /%2e%2e/metrics HTTP/1.1",
    b"PRI * HTTP/2.0",
    b"TRACE /v1/models HTTP/1.1",
]
JSON_VALUES: list[object] = [
    None,
    True,
    0,
    -1,
    1e308,
    2**70,
    "",
    "x" * 40,
    [],
    {},
    [1],
    {"a": 1},
    [[[]]],
]
MAX_JSON_VALUES = 1000  # the fuzzed gateway's server.max_json_values
WIDE: list[dict[str, object]] = [{}] * (MAX_JSON_VALUES + 1)
TRAILERS = [
    b"X-Checksum: abc",
    b"Authorization: Bearer evil",
    b"Content-Length: 5",
    b"Host: evil",
    b"Set-Cookie: a=b",
    b"X-Long: " + b"a" * 2000,
]
EXTENSIONS = [b"", b"", b";name=value", b";" + b"e" * 300, b';q="quoted"']


HI = [{"role": "user", "content": "hi"}]
BODIES: dict[bytes, dict[str, Any]] = {
    b"/v1/chat/completions": CHAT,
    b"/v1/responses": {"model": "m", "input": HI, "instructions": "brief", "max_output_tokens": 5},
    b"/v1/messages": {"model": "m", "system": "brief", "max_tokens": 5, "messages": HI},
    b"/v1/messages/count_tokens": {"model": "m", "messages": HI},
    # the servers' own APIs, read on a route that caches and bounds them, and the gateway's
    # own feedback path
    b"/completion": {"prompt": "p", "temperature": 0, "n_predict": 5, "stream": True},
    b"/api/chat": {"model": "m", "messages": HI, "options": {"temperature": 0}},
    b"/generate": {"inputs": "p", "parameters": {"max_new_tokens": 5}},
    b"/": {"inputs": "p", "stream": False, "parameters": {"do_sample": False}},
    b"/invocations": {"messages": HI, "max_tokens": 5},
    b"/chat/completions": {"messages": HI, "max_tokens": 5, "n": 1},
    b"/cache/feedback": {"key": "k", "verdict": "wrong"},
    b"/v2/models/m/infer": {  # Triton's: TensorRT-LLM's tensor, vLLM's backend's text
        "inputs": [
            {"name": "max_tokens", "datatype": "INT32", "shape": [1], "data": [5000]},
            {
                "name": "sampling_parameters",
                "datatype": "BYTES",
                "shape": [1],
                "data": ['{"max_tokens": 9000}'],
            },
        ],
        "parameters": {"max_tokens": 100},
    },
    b"/v2/models/m/generate": {"text_input": "p", "parameters": {"max_tokens": 5000}},
}
"""The bodies the gateway reads, by path: chat's most often, the Responses API's and
Anthropic's, the servers' own (cached and bounded) and the feedback among them."""


def mutated_body(rng: random.Random, path: bytes = b"/v1/chat/completions") -> bytes:
    if rng.random() < 0.05:  # nested past what a recursive parser reads
        return b"[" * rng.choice([1100, 3000]) + b"]" * rng.choice([0, 3000])
    data = dict(BODIES[path])
    keys = sorted({*data, "stream", "n", "temperature"})
    for key in rng.sample(keys, 2):
        if rng.random() < 0.5:
            data[key] = rng.choice(JSON_VALUES)
    if rng.random() < 0.1:
        data["metadata"] = WIDE
    raw = json.dumps(data).encode()
    if rng.random() < 0.2:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]
    return raw


def case(rng: random.Random) -> bytes:
    path = b"/v1/chat/completions" if rng.random() < 0.55 else rng.choice(list(BODIES))
    body = mutated_body(rng, path) if rng.random() < 0.5 else json.dumps(BODIES[path]).encode()
    lines = [
        rng.choice(LINES) if rng.random() < 0.2 else b"POST %s HTTP/1.1" % path,
        b"Host: gw",
        b"Content-Type: application/json",
        b"Content-Length: %d" % len(body),
    ]
    for _ in range(rng.randint(0, 3)):
        lines.insert(rng.randint(1, len(lines)), rng.choice(HEADERS))
    if any(line.lower().startswith(b"transfer-encoding") for line in lines) and rng.random() < 0.7:
        body = chunked(body, rng)
    end = rng.choice([b"\r\n"] * 8 + [b"\n", b"\r"])
    raw = end.join(lines) + end + end + body
    if rng.random() < 0.2:
        i = rng.randrange(len(raw))
        raw = raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]
    return raw


def chunked(body: bytes, rng: random.Random) -> bytes:
    """``body`` in chunks of one size (tiny ones often), with extensions and trailers."""
    size = rng.choice([max(len(body), 1), max(len(body), 1), 1, 2, 3, 64])
    parts = [
        b"%x%s\r\n%s\r\n" % (len(body[i : i + size]), rng.choice(EXTENSIONS), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    trailers = b"".join(t + b"\r\n" for t in rng.sample(TRAILERS, rng.choice([0, 0, 1, 2])))
    return b"".join(parts) + b"0\r\n" + trailers + b"\r\n"


def heads(data: bytes) -> list[tuple[int, bytes]]:
    """Each answer's status and head, in order (what a client reading them would see)."""
    found = []
    for match in re.finditer(rb"HTTP/1\.1 ([1-5]\d\d) ", data):
        end = data.find(b"\r\n\r\n", match.start())
        found.append((int(match.group(1)), data[match.start() : end if end >= 0 else None]))
    return found


async def exchange(url: str, raw: bytes, marker: str) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    follow = (
        f"GET /v1/models HTTP/1.1\r\nHost: gw\r\nX-Request-ID: {marker}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    try:
        writer.write(raw)
        await asyncio.sleep(0)
        writer.write(follow)
        await writer.drain()
    except ConnectionError:
        pass
    data = b""
    try:
        data = await asyncio.wait_for(reader.read(), 10)
    except ConnectionError:
        pass  # a reset after the answers (the client wrote past a close): read what came
    finally:
        writer.close()
    return data


def relayed(head: bytes) -> bool:
    """The backend's own 5xx, relayed: aiohttp answers a body it cannot decode (a
    ``Content-Encoding: gzip`` that is not, on a path the gateway passes through untouched)
    with a plain-text 500.  The gateway's own errors are OpenAI-shaped JSON."""
    return b"\r\nX-Gateway-Backend: main\r\n" in head and b"\r\nContent-Type: text/plain" in head


async def test_no_mutated_request_gets_a_gateway_5xx_or_another_requests_answer(
    serve_app, start_gateway, tmp_path, caplog
):
    recorder = Recorder()
    url = await serve_app(recorder.app())
    # A mutated byte can make a valid, larger Content-Length ("Content-Length:978"): the
    # gateway rightly waits for the promised body, so its timeouts are kept well below the
    # client's 10 s read, and such a case ends in a 408.
    policy = (
        f"backends: {{main: {{url: '{url}'}}}}\n"
        "routes: [{match: {path: '/v1/*'}, backend: main},\n"
        "  {match: {path: '*'}, backend: main, cache: {ttl_s: 60},"
        " generation: {max_tokens: 50, max_choices: 1}}]\n"
        f"server: {{body_timeout_s: 2, header_timeout_s: 2, max_json_values: {MAX_JSON_VALUES}}}"
    )
    gw = await start_gateway(policy=write_policy(tmp_path, policy))
    rng = random.Random(SEED)
    with caplog.at_level(logging.ERROR):
        for n in range(CASES):
            raw, marker = case(rng), f"follow-{n}"
            data = await exchange(gw.url, raw, marker)
            finals = [(status, head) for status, head in heads(data) if status >= 200]
            where = f"case {n}: {raw[:300]!r} -> {data[:600]!r}"
            assert finals, where
            assert len(finals) <= 2, where
            assert all(status < 500 or status == 505 or relayed(head) for status, head in finals), (
                where
            )
            if len(finals) == 2:  # the follow-up's answer, or the refusal of bytes that were
                status, head = finals[1]  # the first request's (misframed) body
                follow_up = f"\r\nX-Request-ID: {marker}\r\n".encode() in head
                refusal = 400 <= status < 500 and b"X-Gateway-Backend" not in head
                assert follow_up or refusal, where
            if b"\nConnection: close\r" in raw.split(b"\r\n\r\n", 1)[0]:
                assert len(finals) == 1, where
    # (the backend, aiohttp, logs its own refusals of what the gateway relays: not counted)
    errors = [r for r in caplog.records if r.name.startswith("gateway")]
    assert not [r for r in errors if r.levelno >= logging.ERROR]
    async with httpx.AsyncClient() as client:
        ok = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert ok.status_code == 200
