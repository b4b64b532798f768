"""A whole gateway without sockets, for stage and pipeline tests (ours and our users').

``Pipeline`` runs the real ``Gateway`` (policy, stages, registry, metrics) and hands each
request to the real edge as a ``server.Request`` that writes its answer into memory; the
backends are a ``FakeTransport``.  What a test reads back is the answer as a client gets it:
status, headers and body parsed by llhttp from the bytes the edge wrote, so a stream cut
short reads as incomplete.  Only the sockets are missing: the server, the transport and the
end-to-end paths have socket tests of their own.

    async with Pipeline(POLICY, {"main": answer}) as gw:
        reply = await gw.request("POST", "/v1/chat/completions", json=chat("hi"))
        assert reply.status_code == 200 and gw.transport.to("main")
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httptools
from multidict import CIMultiDict
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import Gateway
from gateway.cache.embedding_seam import TierFactory
from gateway.clock import SYSTEM_CLOCK, Clock
from gateway.edge import Edge
from gateway.policy import parse_policy_text
from gateway.policy.model import Policy
from gateway.policy.watch import PolicySource
from gateway.server.request import Head, Request
from gateway.testing.transport import FakeTransport, Respond

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter


class MemoryWire:
    """The client connection a ``Request`` writes through, kept in memory."""

    closing = False
    write_paused = False
    draining = False
    keep_alive = ""  # no idle timeout to announce

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False
        self.moved = asyncio.Event()

    def write(self, data: bytes) -> None:
        self.data += data
        self.moved.set()

    def writelines(self, parts: tuple[bytes, ...]) -> None:
        self.write(b"".join(parts))

    async def drain(self) -> None:
        await asyncio.sleep(0)  # let the rest of the loop run, as a real drain may

    def close(self, *, abort: bool = False) -> None:
        self.closed = True
        self.moved.set()


class Answer:
    """An answer as the client read it: ``status_code``, ``headers`` (any case), ``body``;
    ``complete`` is False when the connection closed before the answer's end."""

    def __init__(self, data: bytes) -> None:
        self.status_code = 0
        self.headers: CIMultiDict[str] = CIMultiDict()
        self.complete = False
        body = bytearray()
        parser = httptools.HttpResponseParser(self)
        self._on_body = body.extend
        with contextlib.suppress(httptools.HttpParserError):
            parser.feed_data(bytes(data))
        self.status_code = parser.get_status_code() if self.headers or self.complete else 0
        self.body = bytes(body)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        self._on_body(body)

    def on_message_complete(self) -> None:
        self.complete = True

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        return jsonlib.loads(self.body)

    def __repr__(self) -> str:
        return f"<Answer {self.status_code} {len(self.body)} bytes complete={self.complete}>"


class Exchange:
    """One request in flight through the edge: read what has arrived so far (``answer``),
    wait for more (``until``), hang up as a client would (``disconnect``), or wait for the
    end (``done``)."""

    def __init__(self, wire: MemoryWire, task: asyncio.Task[None]) -> None:
        self.wire = wire
        self.task = task

    def answer(self) -> Answer:
        """What the client has received so far."""
        return Answer(bytes(self.wire.data))

    async def until(self, arrived: Callable[[Answer], bool], timeout_s: float = 5.0) -> Answer:
        """Wait until what has arrived satisfies ``arrived`` (or the exchange has ended)."""
        async with asyncio.timeout(timeout_s):
            while True:
                answer = self.answer()
                if arrived(answer) or self.task.done():
                    return answer
                self.wire.moved.clear()
                await self.wire.moved.wait()

    async def done(self) -> Answer:
        await self.task
        return self.answer()

    async def disconnect(self) -> None:
        """The client goes away: its request is cancelled, as the server does."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


class Pipeline:
    """The gateway of ``policy`` (YAML text, a path, a ``Policy`` or a ``PolicySource``)
    in front of ``backends``: a ``FakeTransport``, or what answers for it."""

    def __init__(
        self,
        policy: str | Path | Policy | PolicySource,
        backends: FakeTransport | Respond | Mapping[str, Respond],
        *,
        clock: Clock = SYSTEM_CLOCK,
        embedding_tiers: TierFactory | None = None,
        access_log: bool = False,
        span_exporter: SpanExporter | None = None,
    ) -> None:
        self.transport = (
            backends if isinstance(backends, FakeTransport) else FakeTransport(backends)
        )
        if isinstance(policy, str):
            policy = parse_policy_text(policy, "<pipeline>")
        source = (
            policy
            if isinstance(policy, PolicySource)
            else PolicySource(policy)
            if isinstance(policy, Path)
            else PolicySource(fixed=policy)
        )
        self.gateway = Gateway(
            source,
            transport=self.transport,
            clock=clock,
            access_log=access_log,
            embedding_tiers=embedding_tiers,
            span_exporter=span_exporter,
        )
        self._edge: Edge | None = None

    async def __aenter__(self) -> Pipeline:
        self.gateway.begin()
        self.gateway.warm = True
        self._edge = Edge(self.gateway)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.gateway.shutdown(0)

    def send(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] | Mapping[str, str] = (),
        peer: str = "127.0.0.1",
    ) -> Exchange:
        """Start one request; its ``Exchange`` follows it."""
        assert self._edge is not None, "use the pipeline as `async with Pipeline(...) as gw`"
        if json is not None:
            body = jsonlib.dumps(json).encode()
        pairs = list(headers.items() if isinstance(headers, Mapping) else headers)
        given = {k.lower() for k, _ in pairs}
        if "host" not in given:
            pairs.insert(0, ("Host", "gateway.test"))
        if json is not None and "content-type" not in given:
            pairs.append(("Content-Type", "application/json"))
        if body:
            pairs.append(("Content-Length", str(len(body))))
        target, _, query = path.partition("?")
        host = next(v for k, v in pairs if k.lower() == "host")
        wire = MemoryWire()
        request = Request(
            wire, Head(method, target, query, "1.1", host, None, False), pairs, True, peer
        )
        request.body = body
        task = asyncio.get_running_loop().create_task(self._edge.handle(request))
        return Exchange(wire, task)

    async def request(self, method: str, path: str, **given: Any) -> Answer:
        """One whole request and its answer."""
        return await self.send(method, path, **given).done()

    async def post(self, path: str, json: Any, **given: Any) -> Answer:
        return await self.request("POST", path, json=json, **given)

    def metric(self, name: str, **labels: str) -> float | None:
        """The value of one series of the gateway's ``/metrics`` (None when absent)."""
        exposition = self.gateway.metrics.exposition().decode()
        for family in text_string_to_metric_families(exposition):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def __repr__(self) -> str:
        return f"<Pipeline {self.gateway!r} {self.transport!r}>"
