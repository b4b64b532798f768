"""The request pipeline: the gateway's own request and response types and how stages compose.

A request becomes a ``Call`` at the edge and flows through a chain of stages, each an object
with options in ``__init__`` and the work in ``async __call__(call, call_next)``.  A stage ends
the chain by returning a ``Reply`` or raising a ``GatewayError``; it never sets flags for later
stages.  The last handler (``transport.forward``) sends the call upstream.  No HTTP library
appears here: the server (``server/``) and the transport (``transport/``) are the edges.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from gateway.tenant import scope_hash

if TYPE_CHECKING:
    from gateway.openai.usage import StreamUsage
    from gateway.policy.model import Policy, Route

Headers = tuple[tuple[str, str], ...]
Spare = Callable[[], Callable[[], None] | None]
"""Leave for a hedge's second call under the backend's limits: its release, or None when
the backend has no room for it now (``resilience.guard.BackendGuard.spare``)."""


def unbounded() -> None:
    """The release of a leave that nothing bounds (a backend with no limits of its own)."""


def first_header(headers: Headers, name: str, default: str | None = None) -> str | None:
    """The first value of header ``name`` in ``headers``, case-insensitively."""
    name = name.lower()
    for key, value in headers:
        if key.lower() == name:
            return value
    return default


@dataclass(slots=True)
class Record:
    """What the access log and the request's trace tell of one request besides its status
    and timing; one per request, shared by the copies of its ``Call`` a stage passes on.
    Each fact is written by the stage that decides it; times are ``time.perf_counter()``."""

    cache: str | None = None
    """The cache stage's result (``hit:exact``, ``miss``, ``bypass``...): ``log_cache``."""
    cache_lookup: tuple[float, float] | None = None
    """When the cache lookup began and ended."""
    queue_wait: tuple[float, float] | None = None
    """When the call joined a backend's admission queue and when it got its slot."""
    priority: str | None = None
    """The queue priority the call got (``high``, ``normal``, ``low``), after its cap."""
    batch: tuple[int, float, float] | None = None
    """The size of the batch the call went in, when it waited for company and when it went."""
    throttle: str | None = None
    """The throttle rule in force on the backend when the call was admitted."""
    fallback: str | None = None
    """Why the route's primary backend did not serve (``X-Gateway-Fallback``)."""
    generation: tuple[str, int] | None = None
    """What the generation bounds did (``clamped``, ``defaulted``, ``refused``) and the bound
    the call was sent with (0 when refused)."""
    endpoint: str = ""
    """The URL of the endpoint that answered (``Reply.endpoint``)."""
    trace: object | None = None
    """The request's trace while one is recorded (``tracing.otel.Trace``); opaque here."""
    logged: bool = False
    """Whether the access log writes the request (and its mirror's copy, ``mirror.stage``)."""


class Verdict:
    """Whether a call's failures count against its backend's health, decided after the call:
    a merged batch call's 5xx may be one caller's bad input, which the bisection that follows
    proves (its siblings answered).  Failures are ``hold``-en until ``rule``; one ruled on
    already is settled at once."""

    __slots__ = ("_held", "fault")

    def __init__(self) -> None:
        self._held: list[Callable[[bool], None]] = []
        self.fault: bool | None = None

    def hold(self, settle: Callable[[bool], None]) -> None:
        """Settle a failure when ruled on: ``settle(True)`` if it was the backend's."""
        if self.fault is None:
            self._held.append(settle)
        else:
            settle(self.fault)

    def rule(self, fault: bool) -> None:
        """The held failures were the backend's (``fault``) or the callers' inputs'."""
        self.fault = fault
        held, self._held = self._held, []
        for settle in held:
            settle(fault)

    def __repr__(self) -> str:
        return f"<Verdict held={len(self._held)} fault={self.fault}>"


@dataclass(slots=True)
class Call:
    """One client request, as the stages see it.

    ``json`` is the parsed body for OpenAI endpoints (the edge always parses those) and None
    for pass-through paths.  ``policy`` is the snapshot captured once at the edge: the whole
    request runs on it even if a reload swaps the live policy meanwhile.  ``backend`` starts as
    the route's backend; a stage that redirects the call passes on a copy with another one.
    ``path`` and ``query`` are the normalised request target (``target.normalise``): routing
    and stages match on the path that goes upstream, ``raw_target`` (path and query).

    Who asked comes from ``received``, the headers as the client sent them (``headers`` are
    those that go upstream): ``scope`` is the tenant scope hash (``tenant.scope_hash`` over
    the policy's ``cache.scope_headers``, computed once, when first asked), ``client`` the
    client's address as the per-address limits count it (``forwarding.client_key``: an
    IPv6 client by its /64), ``tenant`` the named tenant whose key the request
    offers (``tenants:`` in the policy; "" for none).  ``record`` is what the access log
    tells of the request besides status and timing, written by the stage that decides it;
    None when nothing records it (the access log is off).  ``verdict`` is set on a merged
    batch call: its backend failures count only once the batcher has ruled on them.
    ``pin`` names the one endpoint that holds what the call refers to (a stored response,
    ``response_ids``), as a test of endpoint URLs; None for any endpoint.  ``spare`` asks
    the backend's guard for room for a hedge (set where its ``max_concurrency``, breaker or
    throttle rules hold the call); None: nothing bounds a hedge but its ``max_ratio``.
    ``own_key`` is a server's own call's cache key, with the body and headers it was
    computed from (``cache.own_apis.keyed``, once, when first asked).
    """

    id: str
    method: str
    path: str
    query: str
    headers: Headers
    body: bytes
    json: dict[str, Any] | None
    policy: Policy
    route: Route
    backend: str
    started: float
    tenant: str = ""
    raw_target: str = ""
    received: Headers = field(default=(), repr=False)
    client: str = ""
    _scope: str | None = field(default=None, repr=False)
    record: Record | None = None
    verdict: Verdict | None = None
    pin: Callable[[str], bool] | None = None
    spare: Spare | None = None
    own_key: tuple[bytes, Headers, dict[str, Any] | None] | None = field(default=None, repr=False)

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first value of a request header, case-insensitively."""
        return first_header(self.headers, name, default)

    @property
    def scope(self) -> str:
        """The tenant scope hash (``tenant.scope_hash``)."""
        if self._scope is None:
            self._scope = scope_hash(self.received, self.policy.cache.scope_headers)
        return self._scope

    @property
    def streaming(self) -> bool:
        """True when the client asked an OpenAI endpoint for an SSE stream."""
        return bool(self.json is not None and self.json.get("stream"))


class Reply(NamedTuple):
    """A response on its way to the client: a whole ``body`` or a ``stream`` of chunks.

    Exactly one of ``body`` and ``stream`` is set.  ``close`` releases whatever the stream
    holds upstream (a pooled connection); the edge calls it in every case, also when the
    client went away mid-stream.  ``content_length`` is a stream's declared length, when the
    backend gave one (the edge then sends it as is, not chunked); ``coalesced`` says that
    the call joined another's flight; ``endpoint`` is the URL of the endpoint that answered
    (set by the transport); ``usage`` watches the answer's token counts when a stage changed
    its events (the edge then reads them there, not from what it sends); ``attempts`` counts
    the calls the transport made for it (a hedge, another endpoint: more than one), and
    ``hedged`` says how its hedge went (``won``: the second endpoint's answer; ``lost``: the
    first's; "": none was sent).  A reply is
    immutable: a stage that changes one returns a new one (``with_headers``, ``replace``).
    It is a named tuple, not a frozen dataclass: one is made per request, and a frozen
    dataclass costs four times as much to make on CPython 3.11.
    """

    status: int
    headers: Headers
    body: bytes | None = None
    stream: AsyncIterator[bytes] | None = None
    backend: str = ""
    close: Callable[[], Awaitable[None]] | None = None
    content_length: int | None = None
    coalesced: bool = False
    endpoint: str = ""
    usage: StreamUsage | None = None
    attempts: int = 1
    hedged: str = ""

    def header(self, name: str, default: str | None = None) -> str | None:
        """The first value of a response header, case-insensitively."""
        return first_header(self.headers, name, default)

    def with_headers(self, extra: Sequence[tuple[str, str]]) -> Reply:
        """This reply with ``extra`` headers replacing any of the same names."""
        names = {k.lower() for k, _ in extra}
        kept = tuple((k, v) for k, v in self.headers if k.lower() not in names)
        return self._replace(headers=kept + tuple(extra))

    def replace(self, **changes: Any) -> Reply:
        """This reply with ``changes``."""
        return self._replace(**changes)

    def when_done(self, done: Callable[[], None]) -> Reply:
        """This reply, ``done`` called once it is finished: now for a whole body; after its
        ``close`` (the stream ended, was cut or was left by its client) for a stream."""
        if self.stream is None:
            done()
            return self
        inner = self.close

        async def close() -> None:
            try:
                if inner is not None:
                    await inner()
            finally:
                done()

        return self._replace(close=close)


Handler = Callable[[Call], Awaitable[Reply]]


class Stage(Protocol):
    """One step of the pipeline."""

    async def __call__(self, call: Call, call_next: Handler) -> Reply: ...


def compose(stages: Sequence[Stage], endpoint: Handler) -> Handler:
    """Chain ``stages`` in order in front of ``endpoint`` into one handler."""
    handler = endpoint
    for stage in reversed(stages):
        handler = _bind(stage, handler)
    return handler


def _bind(stage: Stage, call_next: Handler) -> Handler:
    async def run(call: Call) -> Reply:
        return await stage(call, call_next)

    run.__qualname__ = f"{type(stage).__name__}.bound"
    return run
