"""Small helpers shared by the test modules."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httptools


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for a condition the gateway reaches over real sockets (a guard, not a delay:
    time itself never has to pass)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


@dataclass
class RawResponse:
    """One answer read off a raw connection."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every complete answer in ``data``, in order (llhttp reads them)."""
    answers: list[RawResponse] = []

    class Reader:
        def __init__(self) -> None:
            self.headers: dict[str, str] = {}
            self.body = bytearray()

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            answers.append(RawResponse(parser.get_status_code(), self.headers, bytes(self.body)))
            self.headers, self.body = {}, bytearray()

    parser = httptools.HttpResponseParser(Reader())
    with contextlib.suppress(httptools.HttpParserError):
        parser.feed_data(data)
    return answers


async def send_raw(url: str, data: bytes, timeout_s: float = 5.0) -> list[RawResponse]:
    """Write ``data`` on a fresh connection and read until the gateway closes it; every
    answer it sent."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout_s)
    writer.close()
    return parse_responses(raw)
