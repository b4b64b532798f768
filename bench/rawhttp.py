"""What the fault benches see of the gateway: ``gateway serve`` as its own process on a policy
file the bench may rewrite, and a raw HTTP/1.1 client that reads each answer as it came
(status, framing, a stream's events) or tells that none came (``NoAnswer``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import free_port, wait_port

POLL_S = 0.02
"""How often a bench reads the gateway's admin port (a policy generation, breaker state)."""

# -- the client ---------------------------------------------------------------------------


@dataclass(slots=True)
class Answer:
    """An answer as the client read it; ``whole`` when its framing ended as declared (the
    last chunk, or all of its Content-Length)."""

    status: int
    headers: dict[str, str]
    body: bytes
    whole: bool

    @property
    def closes(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"

    def error_message(self) -> str:
        with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
            return str(json.loads(self.body)["error"]["message"])
        return ""


class NoAnswer(Exception):
    """The connection ended before any byte of an answer: ``how`` is eof or reset."""

    def __init__(self, how: str) -> None:
        super().__init__(how)
        self.how = how


class Conn:
    """One client connection speaking raw HTTP/1.1."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.answered = 0

    @classmethod
    async def open(cls, port: int) -> Conn:
        return cls(*await asyncio.open_connection("127.0.0.1", port))

    def send(self, *requests: bytes) -> None:
        self.writer.write(b"".join(requests))

    async def answer(self) -> Answer:
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError as exc:
            raise NoAnswer("eof" if not exc.partial else "partial head") from exc
        except ConnectionError as exc:
            raise NoAnswer("reset") from exc
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        body, whole = await self._body(headers)
        self.answered += 1
        return Answer(int(lines[0].split()[1]), headers, body, whole)

    async def _body(self, headers: dict[str, str]) -> tuple[bytes, bool]:
        parts: list[bytes] = []
        try:
            if headers.get("transfer-encoding", "").lower() == "chunked":
                while True:
                    size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    if size == 0:
                        while await self.reader.readuntil(b"\r\n") != b"\r\n":
                            pass  # trailers
                        return b"".join(parts), True
                    parts.append((await self.reader.readexactly(size + 2))[:-2])
            length = int(headers.get("content-length", "0"))
            return await self.reader.readexactly(length), True
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            return b"".join(parts), False

    async def closed_by_peer(self) -> bool:
        """Whether the gateway closed this idle connection: what a pooled client checks
        before it reuses one (httpcore: an idle socket that reads as ready is closed)."""
        await asyncio.sleep(0)
        return self.reader.at_eof() or self.reader.exception() is not None

    def close(self) -> None:
        self.writer.close()


def post(path: str, body: Any, request_id: str = "") -> bytes:
    data = json.dumps(body).encode()
    rid = f"X-Request-ID: {request_id}\r\n" if request_id else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n{rid}"
        f"Content-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


# -- streams, both ways ------------------------------------------------------------------


def chunk(content: str, finish: str | None = None) -> bytes:
    """One OpenAI chat stream event, as a backend writes it."""
    event = {
        "id": "c",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(event).encode() + b"\n\n"


async def stream_answer(
    request: web.Request, parts: list[bytes], pause_s: float
) -> web.StreamResponse:
    """A backend's event stream: ``parts`` written ``pause_s`` apart."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    try:
        for part in parts:
            await asyncio.sleep(pause_s)
            await response.write(part)
        await response.write_eof()
    except ConnectionError:
        pass  # the gateway went away (the drain's end)
    return response


def events(body: bytes) -> list[bytes]:
    """The ``data:`` payloads of an SSE body, in order."""
    return [line[5:].strip() for line in body.split(b"\n") if line.startswith(b"data:")]


def stream_problem(body: bytes) -> str | None:
    """What is wrong with an OpenAI chat stream as a client sees it, or None: an error
    event, a line that is not JSON, no ``finish_reason``, no ``[DONE]``."""
    finished = False
    payloads = events(body)
    for payload in payloads:
        if payload == b"[DONE]":
            continue
        try:
            event = json.loads(payload)
        except ValueError:
            return "malformed"
        if not isinstance(event, dict):
            return "malformed"
        if "error" in event:
            return "error event"
        finished |= any(c.get("finish_reason") for c in event.get("choices") or ())
    if not payloads or payloads[-1] != b"[DONE]":
        return "no [DONE]"
    return None if finished else "no finish_reason"


# -- the gateway --------------------------------------------------------------------------


class GatewayProcess:
    """``python -m gateway serve`` on ``directory/policy.yaml``; its stderr (the access log
    with ``access_log``) in ``directory/gateway.stderr``."""

    def __init__(self, directory: Path, policy: str, *, access_log: bool = False) -> None:
        self.port, self.admin_port = free_port(), free_port()
        self.policy = directory / "policy.yaml"
        self.policy.write_text(policy)
        self.stderr = directory / "gateway.stderr"
        self.args = [
            *(sys.executable, "-m", "gateway", "--log-level", "error", "serve"),
            *("--policy", str(self.policy), "--port", str(self.port)),
            *("--admin-port", str(self.admin_port)),
            *(("--access-log",) if access_log else ()),
        ]
        self.proc: asyncio.subprocess.Process | None = None
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> GatewayProcess:
        with self.stderr.open("wb") as err:
            self.proc = await asyncio.create_subprocess_exec(
                *self.args, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
            )
        await asyncio.to_thread(wait_port, self.port)
        await asyncio.to_thread(wait_port, self.admin_port)
        self._session = aiohttp.ClientSession(f"http://127.0.0.1:{self.admin_port}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()
        assert self.proc is not None
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                os.killpg(self.proc.pid, signal.SIGKILL)
                await self.proc.wait()

    async def terminate(self) -> tuple[float, float]:
        """SIGTERM; when it was sent and when the process had exited (perf_counter)."""
        assert self.proc is not None
        sent = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        await self.proc.wait()
        return sent, time.perf_counter()

    async def get(self, path: str) -> str:
        assert self._session is not None
        async with self._session.get(path) as response:
            return await response.text()

    async def series(self, name: str) -> dict[str, float]:
        """Every sample of the metric ``name``: its labels as written -> its value."""
        out = {}
        for line in (await self.get("/metrics")).splitlines():
            if line.startswith((name + "{", name + " ")):
                key, _, value = line.rpartition(" ")
                out[key[len(name) :]] = float(value)
        return out

    async def generation(self) -> int:
        return int(json.loads(await self.get("/policy"))["generation"])

    def access_log(self) -> dict[str, int]:
        """Request id -> status, from the access log lines of its stderr."""
        out = {}
        for line in self.stderr.read_text().splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError, KeyError):
                    entry = json.loads(line)
                    out[entry["id"]] = int(entry["status"])
        return out
