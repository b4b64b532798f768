"""The edge of the data plane: a ``Request`` from the server becomes a ``Call``, a ``Reply``
becomes the answer, and the gateway's errors become OpenAI-shaped JSON.  Metrics and the
access log of each request are written here, once.

What the edge decides about a request, before any stage sees it:

- the body of an OpenAI JSON endpoint is decoded (``Content-Encoding: gzip``/``deflate``,
  under the body cap) and validated strictly (``openai.body``); every other path's body
  goes upstream byte for byte, ``Content-Encoding`` and all;
- the route, on exactly the path that is forwarded (``target.normalise`` made it so);
- the tenant: a named tenant (``tenants:``) from its key's hash, or a 401 when keys are
  required and this one is not listed; its scope and rate-limit key come from the headers
  as received (``Call.received``, read by ``tenant``), before hop-by-hop stripping, so no
  header can move a request into another tenant's scope; a named tenant held to some
  models (``openai.allowed_models``) is refused any other, and its ``GET /v1/models`` is cut to
  them;
- what the backend is told of the client (``forwarding``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any

from gateway.cache import feedback
from gateway.cache.replies import CACHE_HEADER, HIT
from gateway.errors import GatewayError, MalformedRequest, Overloaded, SlowReader, UpstreamError
from gateway.openai import body as openai_body
from gateway.openai.allowed_models import native_body, native_names
from gateway.openai.native_usage import NativeStreamUsage, from_native_body, native
from gateway.openai.usage import StreamUsage, from_body
from gateway.pipeline import Call, Record, Reply
from gateway.policy.routing import OPENAI_JSON_PATHS
from gateway.policy.show import redact_url
from gateway.server.control_paths import control_server, refusal
from gateway.server.path_case import case_variant
from gateway.server.path_case import refusal as case_refusal
from gateway.server.request import Request
from gateway.snapshot import Live
from gateway.tenant import scope_hash
from gateway.transport.forwarding import client_key, forwarding_headers
from gateway.transport.headers import REQUEST_OWNED, is_event_stream, strip
from gateway.wire import error_body, error_event, error_headers

if TYPE_CHECKING:
    from gateway.tracing.otel import Trace

log = logging.getLogger("gateway.edge")

_ID_PREFIX = os.urandom(6).hex()
_ID_COUNTER = itertools.count(1)
MAX_REQUEST_ID_CHARS = 128
CLIENT_CLOSED = 499
"""nginx's status for a client that closed before its answer was complete."""
_DECODED_OWNED = REQUEST_OWNED | {"content-encoding"}


BACKEND, CACHED, COALESCED = "backend", "cache", "coalesced"


def token_source(reply: Reply | None) -> str:
    """Who computed an answer's tokens for this request: the backend, the cache (a hit), or
    another request's flight it joined."""
    if reply is None:
        return BACKEND
    if reply.coalesced:
        return COALESCED
    return CACHED if reply.header(CACHE_HEADER) == HIT else BACKEND


def _counts_of(call: Call, body: bytes) -> tuple[int, int] | None:
    """The (prompt, completion) tokens a whole answer names: OpenAI's ``usage``, or a
    server's own counts (a prompt it does not count: none)."""
    if call.json is not None:
        return from_body(body)
    return from_native_body(body) if native(call.method, call.path) else None


def _watcher(call: Call) -> StreamUsage | None:
    """What reads a streamed answer's token counts, for its kind of call."""
    if call.json is not None:
        return StreamUsage()
    return NativeStreamUsage() if native(call.method, call.path) else None


def new_request_id() -> str:
    """Unique per process start and request: a random prefix and a counter (no syscall)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):012x}"


def request_id_of(given: str | None) -> str:
    """The client's ``X-Request-ID`` when it is a plain token of printable ASCII (no spaces,
    at most 128 characters), else a new one."""
    if (
        given
        and len(given) <= MAX_REQUEST_ID_CHARS
        and given.isascii()
        and given.isprintable()
        and " " not in given
    ):
        return given
    return new_request_id()


class Edge:
    """The data plane's one handler."""

    def __init__(self, gateway: Live) -> None:
        self._gateway = gateway
        self._loop_time = asyncio.get_running_loop().time

    async def handle(self, request: Request) -> None:
        gw = self._gateway
        snap = gw.snapshot
        started = self._loop_time()
        request_id = request_id_of(request.header("X-Request-ID"))
        tracer = snap.tracer
        trace = (
            tracer.begin(request.method, request.path, request.headers, request_id)
            if tracer is not None
            else None
        )
        status = 0
        tenant = ""  # named before the call is made, so its refusals are counted too
        call: Call | None = None
        reply: Reply | None = None
        tokens: tuple[int, int] | None = None
        first_byte: float | None = None
        gw.inflight_requests += 1
        try:
            try:
                if snap.tenants is not None:
                    tenant = snap.tenants.identify(request.headers)
                if (known := case_variant(request.path)) is not None:
                    raise case_refusal(request.method, request.path, known)
                if snap.policy.server.control_paths == "refuse":
                    self._check_control(request, tenant)
                if request.path == feedback.FEEDBACK_PATH:
                    status = 200
                    await self._feedback(request, snap, request_id)
                    return
                call = await self._to_call(request, snap, request_id, started, trace, tenant)
                reply = await snap.handler(call)
                access = snap.models.get(call.tenant) if snap.models is not None else None
                if access is not None:
                    reply = access.cut_listing(call.method, call.path, reply)
            except GatewayError as exc:
                status = exc.status
                if trace is not None:
                    trace.error = exc.code
                if call is not None and isinstance(exc, UpstreamError):
                    call.backend = exc.backend or call.backend
                headers = [*error_headers(exc, request_id), *exc.extra_headers]
                request.respond(status, headers, error_body(exc, request.path))
                return
            status = reply.status
            if trace is not None:
                reply = trace.watch(reply)
            tokens, first_byte = await self._respond(request, call, reply)
        except asyncio.CancelledError:
            if request.interrupted:
                status = self._cut_short(request, reply, request_id, status)
            elif not request.finished:
                status = CLIENT_CLOSED  # it left mid-answer: nginx's 499, with the bytes sent
            raise
        finally:
            gw.inflight_requests -= 1
            if reply is not None and reply.close is not None:
                await reply.close()
            self._record(
                snap, call, tenant, reply, request, request_id, status, started, tokens, first_byte
            )
            if trace is not None:
                trace.end(call, reply, status or CLIENT_CLOSED, tokens)

    async def _feedback(self, request: Request, snap: Any, request_id: str) -> None:
        """``POST /cache/feedback`` (``cache.feedback``): answered by the gateway itself."""
        if request.method != "POST":
            refused = MalformedRequest(f"{feedback.FEEDBACK_PATH} takes POST", 405)
            refused.extra_headers = (("Allow", "POST"),)
            raise refused
        scope = scope_hash(request.headers, snap.policy.cache.scope_headers)
        counted = self._gateway.metrics.cache_feedback
        given = await feedback.give(
            self._gateway.registry,
            scope,
            request.body,
            lambda route, verdict: counted.labels(route, verdict).inc(),
            self._gateway.metrics.cache_feedback_limited.inc,
        )
        headers = [("Content-Type", "application/json"), ("X-Request-ID", request_id)]
        request.respond(200, headers, json.dumps(given).encode())

    def _check_control(self, request: Request, tenant: str) -> None:
        """Refuse a model server's control endpoint (``control_paths``)."""
        server = control_server(request.method, request.path)
        if server is not None:
            self._gateway.metrics.control_paths_refused.labels(tenant, server).inc()
            raise refusal(request.method, request.path, server)

    async def _to_call(
        self,
        request: Request,
        snap: Any,
        request_id: str,
        started: float,
        trace: Trace | None,
        tenant: str,
    ) -> Call:
        policy = snap.policy
        logged = policy.server.access_log or self._gateway.access_log
        path = request.path
        body = request.body
        raw = request.headers
        data = None
        owned = REQUEST_OWNED
        if path in OPENAI_JSON_PATHS and request.method == "POST":
            encoding = request.header("Content-Encoding")
            if encoding is not None:
                body = openai_body.decode(body, encoding, policy.server.max_body_bytes)
                owned = _DECODED_OWNED
            limit = policy.server.max_json_values
            if len(body) < openai_body.YIELD_FROM_BYTES:
                data = openai_body.parse(path, body, limit)
            else:  # passes of tens of milliseconds each: the loop runs between them
                await asyncio.sleep(0)
                data = await openai_body.parse_yielding(path, body, limit)
        access = snap.models.get(tenant) if tenant and snap.models is not None else None
        if access is not None:  # before routing: a refused request learns nothing of routes
            own = None
            if native_names(request.method, path):  # Ollama's: its model is in its body
                encoding = request.header("Content-Encoding")
                own = await native_body(body, encoding, policy.server.max_json_values)
            access.check(request.method, path, data, own)
        model = data.get("model") if data is not None else None
        route = snap.router.route(path, model, tenant, raw)
        headers = strip(raw, owned)
        if access is not None:
            headers = list(access.upstream_headers(request.method, path, tuple(headers)))
        forwarded, client = forwarding_headers(
            raw, request.peer, request.host, "http", snap.trusted
        )
        headers.extend(forwarded)
        headers.append(("X-Request-ID", request_id))
        return Call(
            id=request_id,
            method=request.method,
            path=path,
            query=request.query,
            raw_target=f"{path}?{request.query}" if request.query else path,
            headers=tuple(headers),
            body=body,
            json=data,
            policy=policy,
            route=route,
            backend=route.backend,
            started=started,
            tenant=tenant,
            received=tuple(raw),
            client=client_key(client, policy.server.ipv6_client_prefix),
            record=Record(trace=trace, logged=logged) if trace is not None or logged else None,
        )

    async def _respond(
        self, request: Request, call: Call, reply: Reply
    ) -> tuple[tuple[int, int] | None, float | None]:
        headers = [
            *reply.headers,
            ("X-Request-ID", call.id),
            ("X-Gateway-Backend", reply.backend or call.backend),
        ]
        watched = reply.usage  # counted by a stage that changed the events
        if reply.body is not None:
            if watched is not None:
                tokens = watched.counts
            else:
                tokens = _counts_of(call, reply.body)
            request.respond(reply.status, headers, reply.body)
            return tokens, None
        assert reply.stream is not None
        usage = watched or _watcher(call)
        await request.start(reply.status, headers, reply.content_length)
        first_byte: float | None = None
        try:
            async for chunk in reply.stream:
                if first_byte is None:
                    first_byte = self._loop_time()
                if usage is not None and watched is None:
                    usage.feed(chunk)
                await request.write(chunk)
        except (UpstreamError, SlowReader) as exc:
            # Headers are gone already: the client must not mistake a cut stream for a
            # whole one, so the connection closes without the final chunk.
            log.warning("stream from %s broke off: %s", reply.backend, exc)
            request.cut()
            return usage.counts if usage else None, first_byte
        await request.end()
        return usage.counts if usage else None, first_byte

    def _cut_short(
        self, request: Request, reply: Reply | None, request_id: str, status: int
    ) -> int:
        """The drain's grace ran out on this request: a 503 if nothing was sent yet, an
        OpenAI error event ending an SSE stream, else a cut; the status it is logged with."""
        error = Overloaded(
            "the gateway shut down before this answer was complete; retry",
            retry_after_s=1.0,
            reason="shutdown",
        )
        if not request.started:
            request.respond(
                error.status, error_headers(error, request_id), error_body(error, request.path)
            )
            return error.status
        if reply is not None and is_event_stream(reply.headers):
            request.end_with(error_event(error, request.path))
        else:
            request.cut()
        return status

    def _record(
        self,
        snap: Any,
        call: Call | None,
        tenant: str,
        reply: Reply | None,
        request: Request,
        request_id: str,
        status: int,
        started: float,
        tokens: tuple[int, int] | None,
        first_byte: float | None,
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
            status = CLIENT_CLOSED  # the client went away before an answer
        metrics.count_request(route, backend, status)
        duration_h, first_byte_h = metrics.route_series(route, backend)
        duration_h.observe(now - started)
        if first_byte is not None:
            first_byte_h.observe(first_byte - started)
        source = token_source(reply)
        if tokens is not None and backend and source == BACKEND:
            metrics.count_tokens(backend, *tokens)
        price = snap.policy.price_of(backend) if tokens is not None else None
        cost = price.of(*tokens) if price is not None and tokens is not None else 0.0
        if tenant:
            metrics.count_tenant(tenant, status, source, tokens, cost)
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
            if tenant:
                entry["tenant"] = tenant
            entry["bytes_sent"] = request.sent
            if first_byte is not None:
                entry["first_byte_ms"] = round((first_byte - started) * 1000, 3)
            if tokens is not None:
                entry["prompt_tokens"], entry["completion_tokens"] = tokens
            if cost:
                entry["cost"] = round(cost, 9)
            if reply is not None and reply.endpoint:
                entry["endpoint"] = redact_url(reply.endpoint)  # never a URL's credentials
            if reply is not None and reply.attempts > 1:
                entry["upstream_attempts"] = reply.attempts
                if reply.hedged:
                    entry["hedge"] = reply.hedged
            record = call.record if call is not None else None
            if record is not None and record.fallback is not None:
                entry["fallback"] = record.fallback
            if record is not None and record.generation is not None:
                entry["generation"], entry["max_tokens_sent"] = record.generation
            if record is not None and record.cache is not None:
                entry["log_cache"] = record.cache
            if record is not None and record.priority is not None:
                entry["priority"] = record.priority
            if record is not None and record.queue_wait is not None:
                entry["queue_wait_ms"] = round(
                    (record.queue_wait[1] - record.queue_wait[0]) * 1000, 3
                )
            sys.stderr.write(json.dumps(entry) + "\n")
