"""The edge of the data plane: aiohttp requests become ``Call``s, ``Reply``s become
responses, and the gateway's errors become OpenAI-shaped JSON.  Metrics and the access log
of each request are written here, once."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import sys
import time
from typing import TYPE_CHECKING, Any

from aiohttp import http_parser, web
from aiohttp.http_exceptions import LineTooLong
from aiohttp.web_protocol import RequestHandler

from . import openai_body
from .errors import BodyTooLarge, GatewayError, MalformedRequest, SlowReader, UpstreamError
from .headers import REQUEST_OWNED, strip
from .pipeline import Call, Reply
from .routing import OPENAI_JSON_PATHS
from .usage import StreamUsage, from_body

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("gateway.edge")


_REQUEST_LINE = re.compile(rb"[!#$%&'*+.^_`|~0-9A-Za-z-]+ +\S")
"""A method token, then the target: never a header line, whose name ends at a colon."""
_PYTHON_PARSER = http_parser.HttpRequestParser is getattr(http_parser, "HttpRequestParserPy", None)
_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """Unique per process start and request: a random prefix and a counter (no syscall)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


def error_body(exc: GatewayError) -> bytes:
    """``{"error": {"message", "type", "code"}}`` as the openai SDK and Spring AI expect."""
    return json.dumps(
        {"error": {"message": str(exc), "type": exc.type, "code": exc.code, "param": None}}
    ).encode()


def error_response(exc: GatewayError, request_id: str = "") -> web.Response:
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-ID"] = request_id
    if exc.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    backend = getattr(exc, "backend", "")
    if backend:
        headers["X-Gateway-Backend"] = backend
    return web.Response(status=exc.status, body=error_body(exc), headers=headers)


class DataServer(web.Server):
    """aiohttp's low-level server, whose connections answer the errors aiohttp raises
    itself (before the edge sees a request) in the gateway's OpenAI shape too."""

    def __call__(self) -> RequestHandler:
        try:
            return _Connection(self, loop=self._loop, **self._kwargs)
        except (AttributeError, TypeError):  # another aiohttp's internals: its own errors
            return super().__call__()


class _Connection(RequestHandler):
    """One client connection of the data plane."""

    __slots__ = ()  # as its base: an instance __dict__ slows every attribute on the hot path

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """An unreadable request line or header, a head too large (4xx: the client's
        mistake, a warning), or a failure of the edge itself (5xx, logged with its
        traceback) as ``{"error": ...}`` JSON; the connection is closed after it."""
        if status >= 500:
            log.error("request from %s failed", request.remote, exc_info=exc)
            error = GatewayError("the gateway failed to handle the request")
            error.status = status
        else:
            # aiohttp's parser messages add the offending bytes on later lines
            detail = message or (str(exc) if exc is not None else "")
            reason = detail.strip().split("\n", 1)[0].rstrip(": ") or "malformed request"
            log.warning("refused a malformed request from %s: %s", request.remote, reason)
            error = MalformedRequest(reason, _head_status(status, exc, reason))
        if request.writer.output_size > 0:  # part of an answer went out: nothing to add
            raise ConnectionError("cannot answer with an error: the response has begun")
        response = error_response(error)
        response.force_close()
        return response


def _head_status(status: int, exc: BaseException | None, reason: str) -> int:
    """414 for a request target too long, 431 for a header line too long or too many header
    lines (RFC 6585, as Envoy answers), else aiohttp's status.  aiohttp reports all of them
    as 400.  Its C parser hands a too-long target over as a ``bytearray`` and header parts
    as ``bytes``; its Python parser hands over whole lines, ``name: value`` or the request
    line (``METHOD target``)."""
    if isinstance(exc, LineTooLong):
        line = exc.args[0] if exc.args else b""
        if isinstance(line, bytearray):
            return 414
        raw = line.encode("latin-1", "replace") if isinstance(line, str) else bytes(line)
        return 414 if _PYTHON_PARSER and _REQUEST_LINE.match(raw) else 431
    if reason.startswith("Too many headers"):
        return 431
    return status


class Edge:
    """The data plane's one aiohttp handler."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._loop_time = asyncio.get_running_loop().time

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        gw = self._gateway
        snap = gw.snapshot
        started = self._loop_time()
        request_id = request.headers.get("X-Request-ID") or new_request_id()
        status = 0
        call: Call | None = None
        reply: Reply | None = None
        tokens: tuple[int, int] | None = None
        first_byte: float | None = None
        gw.inflight_requests += 1
        try:
            try:
                call = await self._to_call(request, snap, request_id, started)
                reply = await snap.handler(call)
            except GatewayError as exc:
                error = error_response(exc, request_id)
                status = exc.status
                if call is not None and isinstance(exc, UpstreamError):
                    call.backend = exc.backend or call.backend
                return error
            status = reply.status
            response, tokens, first_byte = await self._respond(request, call, reply)
            return response
        finally:
            gw.inflight_requests -= 1
            if reply is not None and reply.close is not None:
                await reply.close()
            self._record(
                snap, call, request, request_id, status, started, tokens, first_byte, reply
            )

    async def _to_call(
        self, request: web.BaseRequest, snap: Any, request_id: str, started: float
    ) -> Call:
        policy = snap.policy
        body = await _read_body(request, policy.server.max_body_bytes)
        path = request.path
        data = None
        if path in OPENAI_JSON_PATHS and request.method == "POST":
            data = openai_body.parse(path, body)
        model = data.get("model") if data is not None else None
        route = snap.router.route(path, model)
        headers = strip(
            ((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers),
            REQUEST_OWNED,
        )
        forwarded_for = request.headers.get("X-Forwarded-For")
        remote = request.remote or ""
        headers.append(
            ("X-Forwarded-For", f"{forwarded_for}, {remote}" if forwarded_for else remote)
        )
        headers.append(("X-Forwarded-Proto", request.scheme))
        if request.host:
            headers.append(("X-Forwarded-Host", request.host))
        headers.append(("X-Request-ID", request_id))
        return Call(
            id=request_id,
            method=request.method,
            path=path,
            query=request.query_string,
            raw_target=request.raw_path,
            headers=tuple(headers),
            body=body,
            json=data,
            policy=policy,
            route=route,
            backend=route.backend,
            started=started,
        )

    async def _respond(
        self, request: web.BaseRequest, call: Call, reply: Reply
    ) -> tuple[web.StreamResponse, tuple[int, int] | None, float | None]:
        headers = [
            *reply.headers,
            ("X-Request-ID", call.id),
            ("X-Gateway-Backend", reply.backend or call.backend),
        ]
        if reply.body is not None:
            tokens = from_body(reply.body) if call.json is not None else None
            return web.Response(status=reply.status, body=reply.body, headers=headers), tokens, None
        assert reply.stream is not None
        response = web.StreamResponse(status=reply.status, headers=headers)
        length = reply.notes.get("content_length")
        if length is not None:
            response.content_length = length
        usage = StreamUsage() if call.json is not None else None
        await response.prepare(request)
        first_byte: float | None = None
        try:
            async for chunk in reply.stream:
                if first_byte is None:
                    first_byte = self._loop_time()
                if usage is not None:
                    usage.feed(chunk)
                await response.write(chunk)
        except (UpstreamError, SlowReader) as exc:
            # Headers are gone already: the client must not mistake a cut stream for a
            # whole one, so the connection closes without the final chunk.
            log.warning("stream from %s broke off: %s", reply.backend, exc)
            if request.transport is not None:
                request.transport.close()
            return response, usage.counts if usage else None, first_byte
        await response.write_eof()
        return response, usage.counts if usage else None, first_byte

    def _record(
        self,
        snap: Any,
        call: Call | None,
        request: web.BaseRequest,
        request_id: str,
        status: int,
        started: float,
        tokens: tuple[int, int] | None,
        first_byte: float | None,
        reply: Reply | None,
    ) -> None:
        metrics = self._gateway.metrics
        now = self._loop_time()
        route = call.route.name if call is not None else ""
        backend = (
            reply.backend
            if reply is not None and reply.backend
            else call.backend
            if call is not None
            else ""
        )
        if status == 0:
            status = 499  # the client went away before an answer (nginx's convention)
        metrics.count_request(route, backend, status)
        duration_h, first_byte_h = metrics.route_series(route, backend)
        duration_h.observe(now - started)
        if first_byte is not None:
            first_byte_h.observe(first_byte - started)
        if tokens is not None and backend:
            metrics.count_tokens(backend, *tokens)
        if snap.policy.server.access_log or self._gateway.access_log:
            entry = {
                "ts": round(time.time(), 3),
                "id": request_id,
                "method": request.method,
                "path": request.path,
                "route": route,
                "backend": backend,
                "status": status,
                "duration_ms": round((now - started) * 1000, 3),
            }
            if first_byte is not None:
                entry["first_byte_ms"] = round((first_byte - started) * 1000, 3)
            if tokens is not None:
                entry["prompt_tokens"], entry["completion_tokens"] = tokens
            if call is not None and call.notes:
                entry.update({k: v for k, v in call.notes.items() if k.startswith("log_")})
            sys.stderr.write(json.dumps(entry) + "\n")


async def _read_body(request: web.BaseRequest, limit: int) -> bytes:
    if not request.body_exists:
        return b""
    length = request.content_length
    if length is not None and length > limit:
        raise BodyTooLarge(f"request body of {length} bytes exceeds the limit of {limit}")
    if request.headers.get("Expect", "").lower() == "100-continue":
        # The low-level server leaves Expect to the handler; the body is wanted.
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    chunks: list[bytes] = []
    size = 0
    while True:
        chunk = await request.content.readany()
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)
