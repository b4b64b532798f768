"""The policy model: frozen dataclasses that a YAML policy is parsed into.

Every field's ``metadata["doc"]`` is the reference text for ``docs/policy.md`` and the
JSON Schema; defaults are the named constants below.  A field marked ``keyed`` is written
in YAML as a mapping from name to object (``backends: {main: {...}}``) and held here as a
tuple of objects whose ``name`` is that key.  ``secret`` fields are redacted wherever a
policy is shown; ``env`` fields expand ``${NAME}`` from the environment at load time.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from ..telemetry.signals import Signal

DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STREAM_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_GRACE_S = 25.0
DEFAULT_RELOAD_INTERVAL_S = 1.0
DEFAULT_WARMUP_TIMEOUT_S = 300.0
DEFAULT_TELEMETRY_INTERVAL_MS = 1000
DEFAULT_QUEUE_CAPACITY = 50
DEFAULT_QUEUE_TIMEOUT_MS = 5000
DEFAULT_CACHE_TTL_S = 600.0
DEFAULT_CACHE_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_SIMHASH_MAX_DISTANCE = 3
DEFAULT_BATCH_MAX_SIZE = 16
DEFAULT_BATCH_MAX_WAIT_MS = 5.0


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


@dataclass(frozen=True, slots=True)
class WarmupRequest:
    """A request sent to a backend before the gateway reports ready."""

    path: str = field(metadata=_doc("Path of the warm-up request, e.g. `/v1/chat/completions`."))
    method: Literal["GET", "POST"] = field(default="POST", metadata=_doc("HTTP method."))
    body: Any = field(default=None, metadata=_doc("JSON body sent as is (none for GET)."))


@dataclass(frozen=True, slots=True)
class Telemetry:
    """Where a backend's GPU and server signals come from."""

    source: Literal["none", "prometheus", "nvml"] = field(
        default="none",
        metadata=_doc(
            "`prometheus` scrapes DCGM-exporter / vLLM / TGI metrics (the usual "
            "source in Kubernetes, where a sidecar without its own GPU request "
            "cannot open the GPU); `nvml` reads the GPU directly; `none`."
        ),
    )
    url: str = field(default="", metadata=_doc("Metrics URL for `prometheus`."))
    extra_urls: tuple[str, ...] = field(
        default=(),
        metadata=_doc(
            "More metrics URLs merged with `url` (e.g. DCGM exporter "
            "and the model server's own `/metrics`)."
        ),
    )
    index: int = field(default=0, metadata=_doc("GPU index for `nvml`."))
    gpu: str | None = field(
        default=None,
        metadata=_doc(
            "Only series with this `gpu` label (default: the hottest / fullest of all GPUs)."
        ),
    )
    interval_ms: int = field(
        default=DEFAULT_TELEMETRY_INTERVAL_MS,
        metadata=_doc(
            "Polling interval; a signal is stale (unknown) "
            "after 3 intervals without a fresh sample."
        ),
    )
    fail_closed: bool = field(
        default=False,
        metadata=_doc(
            "Treat unknown signals as firing every rule. Default "
            "fail open: a broken exporter never takes the service "
            "down."
        ),
    )


@dataclass(frozen=True, slots=True)
class Queue:
    """The bounded FIFO queue in front of a backend's concurrency limit."""

    capacity: int = field(
        default=DEFAULT_QUEUE_CAPACITY,
        metadata=_doc(
            "Requests that may wait; past it, 503 + Retry-After at once (or the route's fallback)."
        ),
    )
    timeout_ms: int = field(
        default=DEFAULT_QUEUE_TIMEOUT_MS, metadata=_doc("Longest wait in the queue before a 503.")
    )


@dataclass(frozen=True, slots=True)
class CircuitBreaker:
    """Opens on a failure rate over a sliding window; half-open probes close it again."""

    failure_rate: float = field(default=0.5, metadata=_doc("Failure share that opens it."))
    min_calls: int = field(default=20, metadata=_doc("Calls in the window before it may open."))
    window_s: float = field(default=30.0, metadata=_doc("Sliding window of calls counted."))
    open_s: float = field(default=30.0, metadata=_doc("How long it stays open."))
    half_open_calls: int = field(default=3, metadata=_doc("Probe calls let through half-open."))


@dataclass(frozen=True, slots=True)
class Backend:
    """A model server the gateway forwards to."""

    name: str = field(metadata=_doc("The backend's name (its key under `backends`)."))
    url: str = field(metadata=_doc("Base URL, `http://` or `https://`; paths are appended."))
    model_version: str = field(
        default="",
        metadata=_doc(
            "Version of the model served; part of every cache key, so bumping it "
            "invalidates that backend's cached answers at once."
        ),
    )
    timeout_s: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata=_doc("Total time for a non-streaming exchange, headers and body (504 past it)."),
    )
    stream_timeout_s: float = field(
        default=DEFAULT_STREAM_TIMEOUT_S,
        metadata=_doc(
            "Total time for a streaming (SSE) exchange; long generations need more "
            "than `timeout_s`."
        ),
    )
    connect_timeout_s: float = field(
        default=DEFAULT_CONNECT_TIMEOUT_S, metadata=_doc("Time to open a TCP/TLS connection.")
    )
    idle_timeout_s: float = field(
        default=DEFAULT_IDLE_TIMEOUT_S,
        metadata=_doc(
            "Longest silence between two chunks of a response (504 before the first "
            "byte, stream cut after it)."
        ),
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata=_doc(
            "Keep-alive pool size. Requests past it queue inside the pool, so never "
            "set it below the backend's own concurrency."
        ),
    )
    headers: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=_doc(
            "Extra headers sent upstream (e.g. an API key). Values may use "
            "`${ENV_NAME}`; they are redacted wherever the policy is shown.",
            mapping=True,
            secret=True,
            env=True,
        ),
    )
    ca_bundle: str | None = field(
        default=None, metadata=_doc("PEM file of CAs for an `https` backend (system CAs if unset).")
    )
    verify_tls: bool = field(
        default=True, metadata=_doc("Verify the `https` backend's certificate. Leave on.")
    )
    warmup: tuple[WarmupRequest, ...] = field(
        default=(),
        metadata=_doc(
            "Requests sent at start; `/readyz` stays unready until each has answered, "
            "so the first user request never pays the cold start."
        ),
    )
    warmup_timeout_s: float = field(
        default=DEFAULT_WARMUP_TIMEOUT_S,
        metadata=_doc("How long warm-up keeps retrying a backend that is still starting."),
    )
    telemetry: Telemetry = field(
        default_factory=Telemetry, metadata=_doc("GPU / server telemetry for throttle rules.")
    )
    max_concurrency: int | None = field(
        default=None,
        metadata=_doc(
            "Upstream calls in flight at most (a batched or "
            "coalesced call counts once); off when unset."
        ),
    )
    queue: Queue = field(default_factory=Queue, metadata=_doc("The queue past `max_concurrency`."))
    circuit_breaker: CircuitBreaker | None = field(
        default=None,
        metadata=_doc(
            "Circuit breaker over connect errors, timeouts and 5xx other than 503; none unless set."
        ),
    )


@dataclass(frozen=True, slots=True)
class Match:
    """What a route matches: a path glob and, optionally, the JSON body's `model`."""

    path: str = field(
        default="*",
        metadata=_doc(
            "Shell-style glob on the path (`*` crosses `/`: `/v1/*` matches "
            "`/v1/chat/completions`)."
        ),
    )
    model: str | None = field(
        default=None, metadata=_doc("Glob on the body's `model` (OpenAI endpoints only).")
    )


@dataclass(frozen=True, slots=True)
class Semantic:
    """Near-duplicate matching of the final user message, after the exact tier."""

    method: Literal["off", "simhash", "embedding"] = field(
        default="off",
        metadata=_doc(
            "`simhash` (near-duplicates, guarded), `embedding` "
            "(opt-in; needs the embedding extra or `embedder`), or "
            "`off` (exact matches only)."
        ),
    )
    max_distance: int = field(
        default=DEFAULT_SIMHASH_MAX_DISTANCE,
        metadata=_doc("SimHash: largest Hamming distance (of 64 bits)."),
    )
    threshold: float | None = field(
        default=None,
        metadata=_doc(
            "Embedding: cosine similarity needed (default: the "
            "calibrated value in docs/caching.md)."
        ),
    )
    embedder: str | None = field(
        default=None,
        metadata=_doc(
            "Embedding: a backend whose `/v1/embeddings` embeds "
            "prompts, instead of the local model."
        ),
    )
    embedder_model: str | None = field(
        default=None,
        metadata=_doc(
            "Embedding: the `model` sent to the `embedder` backend (servers hosting several "
            "models need it; TEI and single-model vLLM do not)."
        ),
    )


@dataclass(frozen=True, slots=True)
class RouteCache:
    """Response caching on a route (deterministic requests only)."""

    ttl_s: float = field(default=DEFAULT_CACHE_TTL_S, metadata=_doc("Entry lifetime."))
    semantic: Semantic = field(
        default_factory=Semantic, metadata=_doc("Near-duplicate tiers after the exact one.")
    )
    allow_sampled: bool = field(
        default=False,
        metadata=_doc(
            "Also cache requests with temperature > 0 (or none, "
            "which means 1). Off: a sampled answer is not "
            "reproducible."
        ),
    )


@dataclass(frozen=True, slots=True)
class Adaptive:
    """AIMD on the batch size against a latency target (Clipper, NSDI'17)."""

    target_latency_ms: float = field(metadata=_doc("p90 batch latency to stay under."))


@dataclass(frozen=True, slots=True)
class Batch:
    """Micro-batching of separate requests into one array call."""

    max_size: int = field(
        default=DEFAULT_BATCH_MAX_SIZE,
        metadata=_doc(
            "Items per upstream call (keep <= the server's cap, "
            "e.g. TEI's 32); the upper bound with `adaptive`."
        ),
    )
    max_wait_ms: float = field(
        default=DEFAULT_BATCH_MAX_WAIT_MS,
        metadata=_doc("Longest a request waits for company (only while the backend is busy)."),
    )
    adaptive: Adaptive | None = field(default=None, metadata=_doc("Move the size by AIMD."))


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A per-tenant rate limit (429 past it)."""

    requests_per_s: float | None = field(default=None, metadata=_doc("Requests per second."))
    tokens_per_min: float | None = field(default=None, metadata=_doc("Tokens per minute."))
    burst: float | None = field(default=None, metadata=_doc("Bucket size (default: 1 s of rate)."))


@dataclass(frozen=True, slots=True)
class Quality:
    """Send low-confidence answers to the fallback instead (non-streaming only)."""

    min_mean_logprob: float = field(
        metadata=_doc("Mean token logprob below which the answer is replaced by the fallback's.")
    )
    request_logprobs: bool = field(
        default=True,
        metadata=_doc(
            "Ask the backend for logprobs (stripped from the answer if the client did not ask)."
        ),
    )


@dataclass(frozen=True, slots=True)
class Route:
    """A rule sending matching requests to a backend; the first matching route wins."""

    backend: str = field(metadata=_doc("Name of the backend serving this route."))
    match: Match = field(default_factory=Match, metadata=_doc("What the route matches."))
    name: str = field(
        default="",
        metadata=_doc(
            "Name used in metrics and logs; defaults to the path glob (plus the model glob)."
        ),
    )
    fallback: tuple[str, ...] = field(
        default=(),
        metadata=_doc(
            "Backends tried in order when the primary refuses, times out, answers 5xx before "
            "any byte reached the client, has an open breaker, is rerouted by a throttle rule "
            "or its queue is full. Never after a stream has started."
        ),
    )
    priority: Literal["high", "normal", "low"] = field(
        default="normal",
        metadata=_doc("Queue priority (the `X-Priority` header overrides); lowest is shed first."),
    )
    cache: RouteCache | None = field(default=None, metadata=_doc("Response caching."))
    coalesce: bool | None = field(
        default=None,
        metadata=_doc(
            "Identical in-flight requests share one upstream call (default: on where the "
            "route caches)."
        ),
    )
    batch: Batch | None = field(default=None, metadata=_doc("Micro-batching into array calls."))
    rate_limit: RateLimit | None = field(default=None, metadata=_doc("Per-tenant rate limit."))
    quality: Quality | None = field(default=None, metadata=_doc("Low-confidence fallback."))

    @property
    def coalescing(self) -> bool:
        """Whether identical in-flight requests share one call on this route."""
        return self.coalesce if self.coalesce is not None else self.cache is not None


@dataclass(frozen=True, slots=True)
class When:
    """A threshold with hysteresis: fires above `above`, clears only below `clear_below`."""

    signal: Signal = field(metadata=_doc("The normalised telemetry signal."))
    above: float = field(metadata=_doc("Fires when the signal rises above this."))
    clear_below: float = field(metadata=_doc("Clears only when it falls below this."))


@dataclass(frozen=True, slots=True)
class ThrottleLimit:
    """What a `limit` rule caps."""

    max_concurrency: int | None = field(default=None, metadata=_doc("Calls in flight."))
    rps: float | None = field(default=None, metadata=_doc("Requests per second."))
    batch_max_size: int | None = field(default=None, metadata=_doc("Batch size."))


@dataclass(frozen=True, slots=True)
class ThrottleRule:
    """A rule protecting a backend's GPU."""

    name: str = field(metadata=_doc("Rule name (metrics label)."))
    backend: str = field(metadata=_doc("Backend whose telemetry it watches and protects."))
    when: When = field(metadata=_doc("The signal and its thresholds."))
    action: Literal["reroute", "shed", "limit"] = field(
        default="reroute",
        metadata=_doc(
            "`reroute` to the route's fallback, `shed` (503 + "
            "Retry-After, lowest priority first) or `limit`."
        ),
    )
    limit: ThrottleLimit | None = field(default=None, metadata=_doc("For `limit`."))


@dataclass(frozen=True, slots=True)
class CacheStore:
    """Where cached answers live (shared by every route that caches)."""

    store: Literal["memory", "redis"] = field(
        default="memory", metadata=_doc("`memory` (LRU) or `redis`.")
    )
    redis_url: str = field(
        default=DEFAULT_REDIS_URL,
        metadata=_doc("Redis (or Valkey) URL for `redis`.", secret=True, env=True),
    )
    max_bytes: int = field(
        default=DEFAULT_CACHE_MAX_BYTES, metadata=_doc("Memory store bound (LRU by bytes).")
    )
    scope_headers: tuple[str, ...] = field(
        default=("authorization",),
        metadata=_doc(
            "Request headers hashed into every key: the tenant scope. No entry is "
            "ever served across scopes."
        ),
    )


@dataclass(frozen=True, slots=True)
class RetryBudget:
    """Caps fallback retries so they cannot double the load in an outage."""

    ratio: float = field(default=0.2, metadata=_doc("Retries allowed per request."))
    min_retries_per_s: float = field(
        default=3.0, metadata=_doc("Floor, so a quiet service can still fail over.")
    )
    window_s: float = field(default=10.0, metadata=_doc("Window the ratio is measured on."))


@dataclass(frozen=True, slots=True)
class Admin:
    """The admin listener's settings."""

    token: str | None = field(
        default=None,
        metadata=_doc(
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
        metadata=_doc("Largest request body accepted (413 past it)."),
    )
    shutdown_grace_s: float = field(
        default=DEFAULT_SHUTDOWN_GRACE_S,
        metadata=_doc("On SIGTERM, how long in-flight requests and streams may take to finish."),
    )
    reload_interval_s: float = field(
        default=DEFAULT_RELOAD_INTERVAL_S,
        metadata=_doc(
            "How often the policy path is polled for changes (SIGHUP and "
            "`POST /reload` reload at once)."
        ),
    )
    access_log: bool = field(
        default=False,
        metadata=_doc("One JSON line per request on stderr (no bodies, no credentials)."),
    )


@dataclass(frozen=True, slots=True)
class Metrics:
    """Prometheus exposition settings."""

    const_labels: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=_doc(
            "Labels added to every gateway series, e.g. `{model_version: ..., gpu_type: h200}`.",
            mapping=True,
        ),
    )


@dataclass(frozen=True, slots=True)
class Policy:
    """A whole policy: what the gateway forwards where, and how."""

    backends: tuple[Backend, ...] = field(
        default=(), metadata=_doc("Model servers, by name.", keyed="name")
    )
    routes: tuple[Route, ...] = field(
        default=(), metadata=_doc("Routing rules, tried in order; the first match wins.")
    )
    server: Server = field(default_factory=Server, metadata=_doc("Data-plane settings."))
    admin: Admin = field(default_factory=Admin, metadata=_doc("Admin listener settings."))
    metrics: Metrics = field(default_factory=Metrics, metadata=_doc("Metrics settings."))
    throttle: tuple[ThrottleRule, ...] = field(
        default=(), metadata=_doc("GPU protection rules over backend telemetry.")
    )
    cache: CacheStore = field(default_factory=CacheStore, metadata=_doc("The cache store."))
    retry_budget: RetryBudget = field(
        default_factory=RetryBudget, metadata=_doc("Budget for fallback retries.")
    )

    def backend(self, name: str) -> Backend:
        """The backend called ``name`` (cross-references are checked at load)."""
        for backend in self.backends:
            if backend.name == name:
                return backend
        raise KeyError(name)


def glob_regex(pattern: str) -> re.Pattern[str]:
    """A compiled shell-style glob where `*` also crosses `/` (as ``fnmatch``)."""
    return re.compile(fnmatch.translate(pattern))
