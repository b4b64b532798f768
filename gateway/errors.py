"""Every exception the gateway raises, and the HTTP shape of those a client can see.

    Exception
    ├── GatewayError                what a client may see: each has its status, type and code
    │   ├── RequestError            the client's request is wrong; 4xx, never retried
    │   │   ├── MalformedRequest    400/405/414/417/431/505 not HTTP the gateway serves
    │   │   ├── RequestTimeout      408 a head or body sent too slowly
    │   │   ├── BadRequest          400 malformed JSON / invalid OpenAI body
    │   │   ├── UnsupportedEncoding 415 a request body in a Content-Encoding not decoded
    │   │   ├── NoRoute             404 no route matches
    │   │   ├── BodyTooLarge        413 body over the limit
    │   │   ├── Unauthorized        401 admin token missing or wrong
    │   │   │   └── UnknownTenant   401 ``tenants.required`` and the key is not listed
    │   │   └── RateLimited         429 a tenant is over its rate
    │   ├── Overloaded              503 the gateway sheds load (queue full, queue timeout,
    │   │   │                           throttle, shutdown, request bodies over their buffer)
    │   │   └── CircuitOpen         503 the backend's circuit breaker is open
    │   ├── UpstreamError           the backend could not be used; 5xx
    │   │   ├── UpstreamUnavailable 502 refused, reset or closed mid-response
    │   │   │   ├── ConnectFailed   502 no connection could be opened (nothing was sent)
    │   │   │   └── BadUpstreamResponse 502 the answer is not valid HTTP/1.1 framing
    │   │   ├── UpstreamTimeout     504 connect, total or idle-between-chunks timeout
    │   │   └── BatchSplitError     502 a merged answer could not be split back per caller
    │   └── SlowReader              503 a joiner of a shared stream fell too far behind
    └── InternalError               handled inside the gateway, never rendered to a client
        ├── PolicyError             a policy is invalid (carries every problem found)
        ├── StoreError              a shared store failed (the request goes on: a cache
        │   │                           miss, a rate limit decided locally)
        │   └── StoreTimeout        ... past its budget or timed out: the command may have run
        ├── TelemetryError          a telemetry source failed (its signals become unknown)
        └── WorkerError             a worker process did not start, or did not answer its
                                        supervisor (``gateway serve --workers N``)

Foreign exceptions (httptools, redis, pynvml, yaml, aiohttp's for the telemetry scrapes
and the supervisor's calls to its workers)
are translated into these once, at the boundary that meets them, with ``raise ... from
exc``.  Only the edge (and the admin port) maps them to HTTP; an ``InternalError`` that
escaped to the edge would be a bug, answered as a 500 and logged with its traceback.
"""

from __future__ import annotations

from dataclasses import dataclass


class GatewayError(Exception):
    """Base of the errors a client may see: each says its HTTP status, type and code."""

    status: int = 500
    type: str = "gateway_error"
    code: str = "internal_error"
    retry_after_s: float | None = None
    extra_headers: tuple[tuple[str, str], ...] = ()
    param: str | None = None
    """The request field at fault, where one is (OpenAI's error ``param``)."""


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a policy: where it is and what is wrong."""

    file: str
    path: str
    line: int | None
    message: str

    def __str__(self) -> str:
        where = self.file + (f":{self.line}" if self.line else "")
        return f"{where}: {self.path or '<root>'}: {self.message}"


class InternalError(Exception):
    """Base of the failures the gateway handles itself; none is shown to a client."""


class PolicyError(InternalError):
    """A policy could not be loaded; ``problems`` lists every error with its location."""

    def __init__(self, problems: list[Problem] | tuple[Problem, ...]) -> None:
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


class RequestError(GatewayError):
    """The client's request is wrong and retrying it unchanged cannot help."""

    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class MalformedRequest(RequestError):
    """The request is not HTTP the gateway serves (its request line, a header, its framing,
    its target, a head too large, a refused method or version); refused before the edge."""

    code = "malformed_request"

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestTimeout(RequestError):
    """The client took too long to send a request head or went silent inside its body."""

    status = 408
    code = "request_timeout"


class UnsupportedEncoding(RequestError):
    """A request body in a ``Content-Encoding`` the gateway does not decode."""

    status = 415
    code = "unsupported_content_encoding"


class BadRequest(RequestError):
    """The body is not valid JSON, or not a valid body for its OpenAI endpoint."""

    code = "invalid_json"


class FieldRefused(RequestError):
    """A request field the gateway bounds asks for too much, or cannot be read as the
    number it must be (a route's ``generation``); ``param`` names it."""

    def __init__(self, message: str, param: str, code: str) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def integer_field(value: object, name: str) -> int:
    """``value``, the request field ``name`` that a bound reads, as the integer it must be;
    ``FieldRefused`` for anything else (a string, a float, a bool), which a server may read
    loosely."""
    if not isinstance(value, int) or isinstance(value, bool):
        kind = "a string" if isinstance(value, str) else type(value).__name__
        raise FieldRefused(
            f"Invalid type for '{name}': expected an integer, but got {kind} instead",
            name,
            "invalid_type",
        )
    return value


class NoRoute(RequestError):
    """No route in the policy matches the request."""

    status = 404
    code = "no_route"


class BodyTooLarge(RequestError):
    """The request body is larger than the configured limit."""

    status = 413
    code = "request_too_large"


class Unauthorized(RequestError):
    """An admin call came without the right bearer token."""

    status = 401
    type = "authentication_error"
    code = "invalid_admin_token"


class UnknownTenant(Unauthorized):
    """A request's API key is not a listed tenant's (``tenants.required``)."""

    code = "invalid_api_key"


class RateLimited(RequestError):
    """A tenant is over its configured request or token rate."""

    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(GatewayError):
    """The gateway sheds this request to protect the backend."""

    status = 503
    type = "server_error"
    code = "overloaded"

    def __init__(self, message: str, retry_after_s: float = 1.0, reason: str = "overloaded"):
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.reason = reason


class CircuitOpen(Overloaded):
    """The backend's circuit breaker is open; ``retry_after_s`` is when it next lets a probe by."""

    code = "circuit_open"

    def __init__(self, message: str, retry_after_s: float = 1.0, backend: str = "") -> None:
        super().__init__(message, retry_after_s=retry_after_s, reason="circuit_open")
        self.backend = backend


class UpstreamError(GatewayError):
    """The backend could not be used for this request."""

    status = 502
    type = "server_error"
    code = "upstream_error"

    def __init__(self, message: str, backend: str = "") -> None:
        super().__init__(message)
        self.backend = backend


class UpstreamUnavailable(UpstreamError):
    """The backend refused, reset or closed the connection."""

    code = "upstream_unavailable"


class ConnectFailed(UpstreamUnavailable):
    """No connection to the backend could be opened (refused, unreachable, a failed
    handshake): nothing of the request was sent, so another endpoint may take it."""


class BadUpstreamResponse(UpstreamUnavailable):
    """The backend's answer is not valid HTTP/1.1 (its status line, a header, its framing);
    its connection is closed, never reused."""

    code = "bad_upstream_response"


class UpstreamTimeout(UpstreamError):
    """The backend did not answer within a configured timeout."""

    status = 504
    code = "upstream_timeout"


class StoreError(InternalError):
    """A shared store failed: the cache's (callers treat it as a miss and count it) or the
    rate limits' Redis (the process decides over its local share)."""


class StoreTimeout(StoreError):
    """A shared store's command ran past its budget or timed out: it may still have run."""


class TelemetryError(InternalError):
    """A telemetry source could not be read; its signals become unknown and it is counted."""


class WorkerError(InternalError):
    """A worker process did not start listening, or did not answer its supervisor."""


class BatchSplitError(UpstreamError):
    """The backend's answer to a merged call does not match its inputs, so no caller gets it."""

    code = "batch_split_failed"


class SlowReader(GatewayError):
    """A client sharing a coalesced stream read so slowly that it was dropped from it."""

    status = 503
    type = "server_error"
    code = "slow_reader"


def shown(value: str) -> str:
    """``value`` cut to 200 characters, for an error message that quotes what a client sent."""
    return value if len(value) <= 200 else value[:200] + "..."
