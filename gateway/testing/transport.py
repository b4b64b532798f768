"""Fakes of the transport boundary: ``FakeTransport`` (answers upstream calls from a
handler, httpx's ``MockTransport`` as the model) and ``FakeResolver`` (DNS for discovery)."""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.pipeline import Headers, Reply, Spare, first_header

if TYPE_CHECKING:
    from gateway.policy.model import Backend


@dataclass(frozen=True, slots=True)
class Sent:
    """One call a ``FakeTransport`` was given: to ``backend``, as the gateway sends it."""

    backend: str
    method: str
    target: str
    headers: Headers
    body: bytes
    streaming: bool
    affinity: str | None = None
    """The leading-context key, for a backend with ``prefix_affinity``."""
    pin: Callable[[str], bool] | None = None
    """The test of the endpoint that holds what the call names (``Call.pin``)."""
    model: str | None = None
    """The model the call asks for, given to a ``kv_aware`` backend's pick."""

    def header(self, name: str) -> str | None:
        return first_header(self.headers, name)

    def json(self) -> Any:
        return json.loads(self.body)


Respond = Callable[[Sent], Reply | Awaitable[Reply]]
"""Answers one call: returns a ``Reply`` (``json_reply``, ``stream_reply``), or raises an
``UpstreamError`` as the real transport does for a refused, reset or timed-out call."""


def json_reply(data: Any, status: int = 200, headers: Iterable[tuple[str, str]] = ()) -> Reply:
    """A whole JSON answer."""
    body = json.dumps(data).encode()
    return Reply(status, (("Content-Type", "application/json"), *headers), body=body)


def stream_reply(
    chunks: Iterable[bytes] | AsyncIterator[bytes],
    status: int = 200,
    content_type: str = "text/event-stream",
    headers: Iterable[tuple[str, str]] = (),
) -> Reply:
    """A streamed answer of ``chunks`` (an async iterator may pause, or raise mid-way)."""

    async def relay() -> AsyncIterator[bytes]:
        if isinstance(chunks, AsyncIterator):
            async for chunk in chunks:
                yield chunk
        else:
            for chunk in chunks:
                yield chunk

    return Reply(status, (("Content-Type", content_type), *headers), stream=relay())


class FakeTransport:
    """The upstream transport without sockets (httpx's ``MockTransport`` is the model):
    ``respond`` answers every call, or ``respond[backend name]`` each backend's.

    ``sent`` lists the calls in order; ``open_streams`` counts streamed replies not yet
    closed, so a test can show that nothing upstream is left held.  ``identities`` says
    what each ``model_version: auto`` backend's servers serve (a version by backend name;
    one not in it has said nothing), as ``Upstreams.model_identity`` learns it."""

    def __init__(self, respond: Respond | Mapping[str, Respond]) -> None:
        self._respond = respond
        self.sent: list[Sent] = []
        self.open_streams = 0
        self.identities: dict[str, str] = {}

    def model_identity(self, name: str, model: str | None = None) -> str | None:
        return self.identities.get(name)

    def to(self, backend: str) -> list[Sent]:
        """The calls sent to ``backend``."""
        return [s for s in self.sent if s.backend == backend]

    async def send(
        self,
        backend: Backend,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        *,
        streaming: bool,
        affinity: str | None = None,
        pin: Callable[[str], bool] | None = None,
        model: str | None = None,
        spare: Spare | None = None,
    ) -> Reply:
        sent = Sent(
            backend.name, method, path_qs, tuple(headers), body, streaming, affinity, pin, model
        )
        self.sent.append(sent)
        respond = (
            self._respond[backend.name] if isinstance(self._respond, Mapping) else self._respond
        )
        answer = respond(sent)
        reply = await answer if inspect.isawaitable(answer) else answer
        assert isinstance(reply, Reply), f"the fake backend answered {reply!r}, not a Reply"
        reply = reply.replace(backend=reply.backend or backend.name)
        if reply.stream is None:
            return reply
        self.open_streams += 1
        inner, closed = reply.close, False

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                self.open_streams -= 1
                if inner is not None:
                    await inner()

        return reply.replace(close=close)

    def __repr__(self) -> str:
        return f"<FakeTransport sent={len(self.sent)} open_streams={self.open_streams}>"


class FakeResolver:
    """DNS as a test says it: ``answers[name]`` is the address list (``set`` replaces it;
    a name with an ``OSError`` in its place fails); ``asked`` counts resolutions."""

    def __init__(self, answers: dict[str, list[str] | OSError] | None = None) -> None:
        self.answers = dict(answers or {})
        self.asked = 0

    def set(self, name: str, answer: list[str] | OSError) -> None:
        self.answers[name] = answer

    async def resolve(self, host: str, port: int) -> list[str]:
        self.asked += 1
        answer = self.answers.get(host, OSError(f"{host}: no such name"))
        if isinstance(answer, OSError):
            raise answer
        return list(answer)
