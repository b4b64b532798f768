"""What the gateway itself writes on the wire: OpenAI-shaped error bodies, and HTTP/1.1
response heads.

An error is ``{"error": {"message", "type", "code", "param"}}`` as the openai SDK and Spring
AI parse it, with ``Retry-After`` (whole seconds) when the error says when to come back.
A response head is written once per answer; a header whose name or value would break the
framing (CR, LF or NUL) is dropped, so nothing a backend or a stage put in a header can
split a response.
"""

from __future__ import annotations

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


def error_body(exc: GatewayError) -> bytes:
    """``{"error": {"message", "type", "code", "param"}}``."""
    return json.dumps(
        {"error": {"message": str(exc), "type": exc.type, "code": exc.code, "param": None}}
    ).encode()


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
