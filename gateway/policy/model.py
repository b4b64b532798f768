"""The policy model: frozen dataclasses that a YAML policy is parsed into.

``Policy`` is the whole policy.  Its gateway-wide sections are here; a backend, a route and
a throttle rule are in ``backend``, ``route`` and ``throttle``, re-exported here so that the
whole model is imported from this one module.  How a field documents itself is
``metadata``; defaults are the named constants next to the types they belong to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.policy.backend import (
    Backend,
    CircuitBreaker,
    Discovery,
    ModelPool,
    Queue,
    Saturation,
    TelemetrySource,
    WarmupRequest,
)
from gateway.policy.match import Match, glob_regex
from gateway.policy.metadata import doc
from gateway.policy.price import Price
from gateway.policy.rate_limit import RateLimit
from gateway.policy.redis import DEFAULT_REDIS_URL, Redis
from gateway.policy.route import (
    Adaptive,
    Batch,
    Judge,
    Prewarm,
    Quality,
    Route,
    RouteCache,
    Semantic,
    TargetModel,
)
from gateway.policy.tenants import TenantKey, Tenants
from gateway.policy.throttle import ThrottleLimit, ThrottleRule, When
from gateway.tenant import CREDENTIAL_HEADERS

__all__ = [
    "Adaptive",
    "Admin",
    "Backend",
    "Batch",
    "CacheStore",
    "CircuitBreaker",
    "Discovery",
    "Judge",
    "Match",
    "Metrics",
    "ModelPool",
    "Policy",
    "Prewarm",
    "Quality",
    "Queue",
    "RateLimit",
    "Redis",
    "RetryBudget",
    "Route",
    "RouteCache",
    "Saturation",
    "Semantic",
    "Server",
    "TargetModel",
    "TelemetrySource",
    "TenantKey",
    "Tenants",
    "ThrottleLimit",
    "ThrottleRule",
    "Tracing",
    "WarmupRequest",
    "When",
    "glob_regex",
]

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_BODY_DEADLINE_S = 300.0
DEFAULT_MIN_BODY_RATE_BYTES_S = 1024
DEFAULT_MAX_JSON_VALUES = 500_000
DEFAULT_ALLOWED_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
DEFAULT_KEEPALIVE_TIMEOUT_S = 75.0
DEFAULT_CLIENT_SEND_TIMEOUT_S = 60.0
DEFAULT_MAX_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_HEADER_COUNT = 100
DEFAULT_MAX_CONNECTIONS = 1024
DEFAULT_MAX_BUFFERED_BODY_BYTES = 64 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 25.0
DEFAULT_IPV6_CLIENT_PREFIX = 64
DEFAULT_RELOAD_INTERVAL_S = 1.0
DEFAULT_RELOAD_SETTLE_S = 10.0
DEFAULT_CACHE_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_SAMPLE_RATIO = 0.0
DEFAULT_FEEDBACK_PER_MIN = 60.0


@dataclass(frozen=True, slots=True)
class CacheStore:
    """Where cached answers live (shared by every route that caches)."""

    store: Literal["memory", "redis"] = field(
        default="memory", metadata=doc("`memory` (LRU) or `redis`.")
    )
    redis_url: str = field(
        default=DEFAULT_REDIS_URL,
        metadata=doc(
            "Redis (or Valkey) URL for `redis`: the alias of `redis.url` (a standalone Redis).",
            secret=True,
            env=True,
        ),
    )
    max_bytes: int = field(
        default=DEFAULT_CACHE_MAX_BYTES, metadata=doc("Memory store bound (LRU by bytes).")
    )
    scope_headers: tuple[str, ...] = field(
        default=CREDENTIAL_HEADERS,
        metadata=doc(
            "Request headers hashed into every key: the tenant scope. No entry is ever "
            "served, no flight shared and no batch merged across scopes. The default is "
            "every header that carries a credential."
        ),
    )
    feedback_per_min: float = field(
        default=DEFAULT_FEEDBACK_PER_MIN,
        metadata=doc(
            "Verdicts (`POST /cache/feedback`) one caller may give a minute, a minute's "
            "worth at once: per credential scope (`scope_headers`; callers sending none "
            "share one), in each replica. Past it 429 with `Retry-After`, counted in "
            "`gateway_cache_feedback_limited_total`. Changing it keeps the cache."
        ),
    )


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """Caps fallback retries so they cannot double the load in an outage."""

    ratio: float = field(default=0.2, metadata=doc("Retries allowed per request."))
    min_retries_per_s: float = field(
        default=3.0, metadata=doc("Floor, so a quiet service can still fail over.")
    )
    window_s: float = field(default=10.0, metadata=doc("Window the ratio is measured on."))


@dataclass(frozen=True, slots=True)
class Admin:
    """The admin listener's settings."""

    token: str | None = field(
        default=None,
        metadata=doc(
            "Bearer token for mutating admin endpoints (`POST /reload`, ...). "
            "`GATEWAY_ADMIN_TOKEN` overrides it. With none, those endpoints answer "
            "only on a loopback-bound admin port.",
            secret=True,
            env=True,
        ),
    )


@dataclass(frozen=True, slots=True)
class Server:
    """Gateway-wide settings of the data plane."""

    max_body_bytes: int = field(
        default=DEFAULT_MAX_BODY_BYTES,
        metadata=doc("Largest request body accepted (413 past it)."),
    )
    header_timeout_s: float = field(
        default=DEFAULT_HEADER_TIMEOUT_S,
        metadata=doc(
            "Longest a client may take to send a whole request head, from its first byte "
            "(from the connection's start for its first request); then 408 and close."
        ),
    )
    body_timeout_s: float = field(
        default=DEFAULT_BODY_TIMEOUT_S,
        metadata=doc(
            "Longest a request body may fall behind `min_body_rate_bytes_s` (with the rate "
            "at 0: the longest silence inside a body); then 408 and close."
        ),
    )
    min_body_rate_bytes_s: int = field(
        default=DEFAULT_MIN_BODY_RATE_BYTES_S,
        metadata=doc(
            "Slowest a request body may arrive once it has used up `body_timeout_s` of "
            "slack; a body that trickles in slower is a 408 (Kestrel's minimum data rate). "
            "0: only silence counts."
        ),
    )
    body_deadline_s: float = field(
        default=DEFAULT_BODY_DEADLINE_S,
        metadata=doc(
            "Longest a whole request body may take, from the end of its head; then 408 "
            "(Envoy's `request_timeout` for the body)."
        ),
    )
    max_json_values: int = field(
        default=DEFAULT_MAX_JSON_VALUES,
        metadata=doc(
            "Most JSON values (elements, members, containers) in an OpenAI request body; "
            "past it a 400 before it is parsed. The default holds any real request "
            "(an embeddings call of 300,000 tokens as token arrays is about 300,000)."
        ),
    )
    allowed_methods: tuple[str, ...] = field(
        default=DEFAULT_ALLOWED_METHODS,
        metadata=doc(
            "Request methods the gateway forwards; any other is a 405 with `Allow` "
            "(CONNECT and TRACE are never served)."
        ),
    )
    control_paths: Literal["refuse", "pass"] = field(
        default="refuse",
        metadata=doc(
            "`refuse`: the model servers' own control endpoints, which act on the server for "
            "every client (llama.cpp's `/slots` and a POST to `/props` or `/lora-adapters`; "
            "vLLM's `/sleep`, `/reset_prefix_cache`, `/v1/load_lora_adapter`...; SGLang's "
            "`/flush_cache`, `/update_weights_from_*`...; Ollama's `/api/pull`, `/api/delete`"
            "...; KServe V2's `/v2/repository/*` and shared memory), are a 403 "
            "`control_path_refused` before any route, whatever the route would match. "
            "`pass`: forwarded as any path, for an operator who drives them through the "
            "gateway."
        ),
    )
    keepalive_timeout_s: float = field(
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        metadata=doc(
            "How long an idle keep-alive connection is kept open; announced on every answer "
            "that keeps it (`Keep-Alive: timeout=N`), so that clients that read it close first."
        ),
    )
    client_send_timeout_s: float = field(
        default=DEFAULT_CLIENT_SEND_TIMEOUT_S,
        metadata=doc(
            "Longest a client may leave an answer unread (the gateway's send buffer full); "
            "then the answer is cut and its upstream connection released."
        ),
    )
    max_header_bytes: int = field(
        default=DEFAULT_MAX_HEADER_BYTES,
        metadata=doc(
            "Largest request head: request line and headers (431 past it, 414 when the "
            "request target alone is too long)."
        ),
    )
    max_header_count: int = field(
        default=DEFAULT_MAX_HEADER_COUNT,
        metadata=doc("Most header lines in a request head (431 past it)."),
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata=doc(
            "Most client connections open at once. At the limit the longest-idle "
            "keep-alive connection is closed to make room; with none idle, a new "
            "connection is accepted and closed at once (counted as refused)."
        ),
    )
    max_buffered_body_bytes: int = field(
        default=DEFAULT_MAX_BUFFERED_BODY_BYTES,
        metadata=doc(
            "All request bodies the gateway holds at once, from their first byte until "
            "their answer; a request that would pass it gets 503 with Retry-After."
        ),
    )
    trusted_proxies: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "CIDRs of proxies in front of the gateway whose `X-Forwarded-*`, `X-Real-IP` "
            "and `Forwarded` headers are believed; from any other peer they are replaced."
        ),
    )
    ipv6_client_prefix: int = field(
        default=DEFAULT_IPV6_CLIENT_PREFIX,
        metadata=doc(
            "The IPv6 prefix length that counts as one client wherever callers are told "
            "apart by address (a caller offering no credential under a `rate_limit`, the "
            "budgets of new credentials, `tenants.max_concurrency`, the fair queue): a host "
            "is given a whole /64 and may send from any address in it. 128: each address. "
            "An IPv4 address is one client."
        ),
    )
    shutdown_grace_s: float = field(
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metadata=doc("On SIGTERM, how long in-flight requests and streams may take to finish."),
    )
    reload_interval_s: float = field(
        default=DEFAULT_RELOAD_INTERVAL_S,
        metadata=doc(
            "How often the policy path is polled for changes (SIGHUP and "
            "`POST /reload` reload at once)."
        ),
    )
    reload_settle_s: float = field(
        default=DEFAULT_RELOAD_SETTLE_S,
        metadata=doc(
            "How long a file edited in place (the same inode) must hold still before it is "
            "applied, so a writer pausing mid-file never has its first half go live. A file "
            "renamed into place (`sed -i`, `mv`, most editors) or a ConfigMap swap applies "
            "at the next poll."
        ),
    )
    access_log: bool = field(
        default=False,
        metadata=doc("One JSON line per request on stderr (no bodies, no credentials)."),
    )


@dataclass(frozen=True, slots=True)
class Metrics:
    """Prometheus exposition settings."""

    const_labels: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=doc(
            "Labels added to every gateway series, e.g. `{model_version: ..., gpu_type: h200}`.",
            mapping=True,
        ),
    )


@dataclass(frozen=True, slots=True)
class Tracing:
    """Traces of requests (the `otel` extra); the `OTEL_*` variables say where spans go."""

    sample_ratio: float = field(
        default=DEFAULT_SAMPLE_RATIO,
        metadata=doc(
            "Share of requests traced, 0 to 1; 0 turns tracing off (no span is made). "
            "A request whose `traceparent` says its caller traced it is traced too, one "
            "whose caller did not is not. A reload changes it at once."
        ),
    )


@dataclass(frozen=True, slots=True)
class Policy:
    """A whole policy: what the gateway forwards where, and how."""

    backends: tuple[Backend, ...] = field(
        default=(), metadata=doc("Model servers, by name.", keyed="name")
    )
    routes: tuple[Route, ...] = field(
        default=(), metadata=doc("Routing rules, tried in order; the first match wins.")
    )
    server: Server = field(default_factory=Server, metadata=doc("Data-plane settings."))
    admin: Admin = field(default_factory=Admin, metadata=doc("Admin listener settings."))
    metrics: Metrics = field(default_factory=Metrics, metadata=doc("Metrics settings."))
    throttle: tuple[ThrottleRule, ...] = field(
        default=(), metadata=doc("GPU protection rules over backend telemetry.")
    )
    cache: CacheStore = field(default_factory=CacheStore, metadata=doc("The cache store."))
    retry_budget: RetryBudget = field(
        default_factory=RetryBudget, metadata=doc("Budget for fallback retries.")
    )
    tracing: Tracing = field(
        default_factory=Tracing, metadata=doc("Request traces (OpenTelemetry).")
    )
    tenants: Tenants = field(
        default_factory=Tenants, metadata=doc("Named tenants: API keys with names and limits.")
    )
    redis: Redis = field(
        default_factory=Redis,
        metadata=doc(
            "The Redis the replicas share state through: the `redis` cache store, "
            "`store: redis` rate limits, the rate history of `prewarm` routes."
        ),
    )

    def backend(self, name: str) -> Backend:
        """The backend called ``name`` (cross-references are checked at load)."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)

    def price_of(self, backend: str) -> Price | None:
        """The ``price`` of the backend called ``backend`` (None: unpriced, or none such)."""
        return next((b.price for b in self.backends if b.name == backend), None)
