"""Who may call the admin port's endpoints, for the gateway's admin app and the supervisor's
(``gateway serve --workers N``) alike.

With a token configured (``admin.token`` or ``GATEWAY_ADMIN_TOKEN``), every endpoint but
``/healthz``, ``/readyz`` and ``/metrics`` needs ``Authorization: Bearer <token>``; a missing,
wrong or malformed one is a 401.  With none, the mutating endpoints answer only on a
loopback-bound admin port.  An empty token (``admin.token: ""``, or a variable set to
nothing) and one still equal to the shipped example Secret's placeholder are refused at
start, and an empty one never authenticates."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.errors import GatewayError, PolicyError, Problem, Unauthorized
from gateway.wire import error_body, error_headers

AdminHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]
TokenOf = Callable[[], str | None]
PLACEHOLDER_TOKEN = "REPLACE-with-a-long-random-token"
"""``admin-token`` in ``deploy/k8s/secret.yaml``: a token nobody replaced is no secret."""


def is_loopback(host: str) -> bool:
    """Whether an admin port bound to ``host`` is reachable from this machine only."""
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def check_admin_token(token: str | None) -> None:
    """Refuse to start with an empty admin token (it would match an empty ``Bearer``), or
    with the example Secret's placeholder."""
    if token is None:
        return
    if not token.strip():
        reason = (
            "the admin token is empty (admin.token, or the variable it names, set to "
            "nothing); set a long random one (openssl rand -hex 32), or none for a "
            "loopback-only admin port"
        )
    elif token.strip() == PLACEHOLDER_TOKEN:
        reason = (
            "the admin token is still the placeholder of deploy/k8s/secret.yaml; "
            "set a long random one (openssl rand -hex 32)"
        )
    else:
        return
    raise PolicyError([Problem("GATEWAY_ADMIN_TOKEN", "admin.token", None, reason)])


def error_response(exc: GatewayError) -> web.Response:
    """A gateway error as an aiohttp response, in the data plane's OpenAI shape."""
    return web.Response(
        status=exc.status,
        body=error_body(exc),
        headers=dict([*error_headers(exc), *exc.extra_headers]),
    )


def guarded(handler: AdminHandler, token: TokenOf, loopback: bool) -> AdminHandler:
    """A mutating endpoint: it needs the token, or with none configured a loopback port."""

    async def run(request: web.Request) -> web.StreamResponse:
        try:
            _authorize(request, token(), loopback)
        except GatewayError as exc:
            return error_response(exc)
        return await handler(request)

    return run


def shown(handler: AdminHandler, token: TokenOf, loopback: bool) -> AdminHandler:
    """Open without a token configured; with one, it is needed."""

    async def run(request: web.Request) -> web.StreamResponse:
        configured = token()
        if configured is not None:
            try:
                _authorize(request, configured, loopback)
            except GatewayError as exc:
                return error_response(exc)
        return await handler(request)

    return run


def _authorize(request: web.Request, token: str | None, loopback: bool) -> None:
    if token is None:
        if not loopback:
            raise Unauthorized(
                "no admin token is configured, so mutating admin endpoints "
                "answer only on a loopback-bound admin port"
            )
        return
    given = request.headers.get("Authorization", "")
    scheme, _, credential = given.strip().partition(" ")
    expected = token.strip().encode("utf-8", "surrogateescape")
    offered = credential.strip().encode("utf-8", "surrogateescape")
    # An empty token never authenticates, whatever reached here (a reload, a supervisor).
    if scheme.lower() != "bearer" or not expected or not hmac.compare_digest(offered, expected):
        raise Unauthorized("missing or wrong admin bearer token")
