"""What the gateway itself writes on the wire: error bodies in the shape the client's API
uses, and HTTP/1.1 response heads.

An error is ``{"error": {"message", "type", "code", "param"}}`` as the openai SDK and Spring
AI parse it; on Anthropic's Messages API (``/v1/messages`` and below) it is Anthropic's
``{"type": "error", "error": {"type", "message"}}``, its type named by the status as
Anthropic names it (``rate_limit_error``, ``overloaded_error``...), with the gateway's
``code`` beside.  ``Retry-After`` (whole seconds) comes with it when the error says when to
come back.
A response head is written once per answer; a header whose name or value would break the
framing (CR, LF or NUL) is dropped, so nothing a backend or a stage put in a header can
split a response.
"""

from __future__ import annotations

import functools
import http
import json
import time
from collections.abc import Sequence

from gateway.errors import GatewayError

_REASONS = {s.value: s.phrase for s in http.HTTPStatus}
_STATUS_LINES: dict[int, str] = {}
_FORBIDDEN = ("\r", "\n", "\0")
FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date"})
"""Response headers only the server writes: any a reply carries are dropped."""
_date_second = 0
_date_text = ""


def connection_options(value: str) -> set[str]:
    """The options one Connection header line lists, lower-cased (RFC 9110 7.6.1)."""
    return {option.strip().lower() for option in value.split(",")}


MESSAGES_PATH = "/v1/messages"
"""Anthropic's Messages API (its errors are in its shape; the cache stores its streams as
they came, ``cache.replies.verbatim``)."""
RESPONSES_PATH = "/v1/responses"
"""OpenAI's Responses API (its ids bound to tenants, ``openai.response_ids``; its streams
stored as they came, as Anthropic's)."""
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
"""Anthropic's error types by status; any other is ``invalid_request_error`` below 500 and
``api_error`` from it."""


def anthropic_path(path: str) -> bool:
    """Whether ``path`` is Anthropic's Messages API, whose clients read its error shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def error_body(exc: GatewayError, path: str = "") -> bytes:
    """``{"error": {"message", "type", "code", "param"}}``; Anthropic's shape for a
    ``path`` of its API."""
    if anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(exc.status) or (
            "invalid_request_error" if exc.status < 500 else "api_error"
        )
        error = {"type": kind, "message": str(exc), "code": exc.code}
        return json.dumps({"type": "error", "error": error}).encode()
    return json.dumps(
        {"error": {"message": str(exc), "type": exc.type, "code": exc.code, "param": exc.param}}
    ).encode()


def error_event(exc: GatewayError, path: str = "") -> bytes:
    """``exc`` as the last event of an SSE stream: Anthropic's ``error`` event on its API's
    path, else a ``data:`` line with the OpenAI error."""
    opening = b"event: error\ndata: " if anthropic_path(path) else b"data: "
    return opening + error_body(exc, path) + b"\n\n"


def error_headers(exc: GatewayError, request_id: str = "") -> list[tuple[str, str]]:
    """The headers of an error answer (without its length)."""
    headers = [("Content-Type", "application/json")]
    if request_id:
        headers.append(("X-Request-ID", request_id))
    if exc.retry_after_s is not None:
        headers.append(("Retry-After", str(max(1, round(exc.retry_after_s)))))
    backend = getattr(exc, "backend", "")
    if backend:
        headers.append(("X-Gateway-Backend", backend))
    return headers


def status_line(status: int) -> str:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = f"HTTP/1.1 {status} {_REASONS.get(status, '')}".rstrip() + "\r\n"
        if len(_STATUS_LINES) < 512:
            _STATUS_LINES[status] = line
    return line


def http_date() -> str:
    """The ``Date`` header's value, computed once a second."""
    global _date_second, _date_text
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_text = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(now))
    return _date_text


@functools.lru_cache(maxsize=8)
def keep_alive_line(timeout_s: float) -> str:
    """``Keep-Alive: timeout=N`` (whole seconds, rounded down, as clients read it) and CRLF;
    nothing under a second, which a client would read as "do not reuse"."""
    whole = int(timeout_s)
    return f"Keep-Alive: timeout={whole}\r\n" if whole >= 1 else ""


def response_head(status: int, headers: Sequence[tuple[str, str]], framing: str) -> bytes:
    """Status line, ``headers``, then ``framing`` (the gateway's own lines, each ending in
    CRLF: length or chunking, Date, Connection), and the blank line."""
    lines = [status_line(status)]
    count = 1
    for key, value in headers:
        if key.lower() in FRAMING:
            continue
        lines.append(f"{key}: {value}\r\n")
        count += 1
    text = "".join(lines)
    if text.count("\n") != count or text.count("\r") != count or "\0" in text:
        text = status_line(status) + "".join(
            f"{k}: {v}\r\n"
            for k, v in headers
            if k.lower() not in FRAMING
            and ":" not in k
            and not any(c in k or c in v for c in _FORBIDDEN)
        )
    return (text + framing + "\r\n").encode("latin-1", "replace")
