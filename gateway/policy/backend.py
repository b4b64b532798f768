"""The policy of a backend (``backends.<name>``): the model server, with its timeouts, pool,
warm-up, telemetry, concurrency queue and circuit breaker."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.policy.hedge import Hedge
from gateway.policy.metadata import doc
from gateway.policy.price import Price

DEFAULT_DISCOVERY_INTERVAL_S = 5.0
DEFAULT_TIMEOUT_S = 120.0
DEFAULT_STREAM_TIMEOUT_S = 600.0
DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_IDLE_TIMEOUT_S = 60.0
DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_KEEPALIVE_S = 4.0
DEFAULT_WARMUP_TIMEOUT_S = 300.0
DEFAULT_TELEMETRY_INTERVAL_MS = 1000
DEFAULT_QUEUE_CAPACITY = 50
DEFAULT_MAX_QUEUE_WAITING = 5.0
DEFAULT_MAX_KV_CACHE_USAGE = 0.8
DEFAULT_QUEUE_TIMEOUT_MS = 5000
DEFAULT_ENDPOINT_RETRIES = 2
DEFAULT_ENDPOINT_RETRY_BUDGET = 0.2  # Envoy's default retry budget: 20%


@dataclass(frozen=True, slots=True)
class WarmupRequest:
    """A request sent to a backend before the gateway reports ready."""

    path: str = field(metadata=doc("Path of the warm-up request, e.g. `/v1/chat/completions`."))
    method: Literal["GET", "POST"] = field(default="POST", metadata=doc("HTTP method."))
    body: Any = field(default=None, metadata=doc("JSON body sent as is (none for GET)."))


@dataclass(frozen=True, slots=True)
class TelemetrySource:
    """Where a backend's GPU and server signals come from."""

    source: Literal["none", "prometheus", "nvml"] = field(
        default="none",
        metadata=doc(
            "`prometheus` scrapes DCGM-exporter / vLLM / TGI metrics (the usual "
            "source in Kubernetes, where a sidecar without its own GPU request "
            "cannot open the GPU); `nvml` reads the GPU directly; `none`."
        ),
    )
    url: str = field(
        default="",
        metadata=doc(
            "Metrics URL for `prometheus`. With `{host}` or `{port}` in it, each endpoint's "
            "own (its host and port put in): telemetry and throttle rules per endpoint, "
            "e.g. `http://{host}:8000/metrics`, or a node's DCGM exporter at `{host}:9400`. "
            "Expands `${ENV}`, as every telemetry selector does.",
            env=True,
        ),
    )
    extra_urls: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "More metrics URLs merged with `url` (e.g. DCGM exporter "
            "and the model server's own `/metrics`).",
            env=True,
        ),
    )
    index: int = field(default=0, metadata=doc("GPU index for `nvml`."))
    gpu: str | None = field(
        default=None,
        metadata=doc(
            "Only the GPU with this `gpu` index label or `UUID` (default: every GPU the "
            "exporter reports; each signal takes the largest, the hottest GPU wins), e.g. "
            '`"${NVIDIA_VISIBLE_DEVICES}"` (expanded).',
            env=True,
        ),
    )
    gpu_instance: str | None = field(
        default=None,
        metadata=doc(
            "Only the MIG instance with this `GPU_I_ID` (MIG instances are apart); expands "
            "`${ENV}`.",
            env=True,
        ),
    )
    select: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=doc(
            'Label matchers a GPU series must all equal, e.g. `{pod: "${POD_NAME}", '
            'namespace: "${POD_NAMESPACE}"}` on a node-wide DCGM exporter that maps '
            "devices to pods, so one ConfigMap serves every replica (values expand "
            "`${ENV}`, e.g. from the Downward API). Applies to the DCGM series, not to the "
            "model server's own.",
            mapping=True,
            env=True,
        ),
    )
    interval_ms: int = field(
        default=DEFAULT_TELEMETRY_INTERVAL_MS,
        metadata=doc(
            "Polling interval; a signal is stale (unknown) "
            "after 3 intervals without a fresh sample."
        ),
    )
    fail_closed: bool = field(
        default=False,
        metadata=doc(
            "Treat unknown signals as firing every rule. Default "
            "fail open: a broken exporter never takes the service "
            "down."
        ),
    )


@dataclass(frozen=True, slots=True)
class Saturation:
    """When a model server is too loaded for `balance: kv_aware` to send it a request."""

    queue_waiting: float = field(
        default=DEFAULT_MAX_QUEUE_WAITING, metadata=doc("More requests waiting than this.")
    )
    kv_cache_usage: float = field(
        default=DEFAULT_MAX_KV_CACHE_USAGE, metadata=doc("Its KV cache fuller than this (0..1).")
    )


@dataclass(frozen=True, slots=True)
class Queue:
    """The bounded queue in front of a backend's concurrency limit: by priority, then fair
    between tenants (or first come, first served)."""

    capacity: int = field(
        default=DEFAULT_QUEUE_CAPACITY,
        metadata=doc(
            "Requests that may wait; past it, 503 + Retry-After at once (or the route's fallback)."
        ),
    )
    timeout_ms: int = field(
        default=DEFAULT_QUEUE_TIMEOUT_MS, metadata=doc("Longest wait in the queue before a 503.")
    )
    fairness: Literal["tenant", "fifo"] = field(
        default="tenant",
        metadata=doc(
            "`tenant`: within a priority, a freed slot goes to each waiting tenant in turn "
            "(a named tenant of `tenants:`; a request offering no listed key counts as its "
            "client address), and a full queue makes room for a newcomer by shedding the "
            "newest waiter of the tenant holding the most places, when that tenant holds more "
            'than the newcomer\'s would (`gateway_shed_total{reason="queue_share"}`): a '
            "tenant flooding the queue cannot keep the others out. `fifo`: first come, first "
            "served within a priority, and a full queue refuses the newcomer."
        ),
    )


@dataclass(frozen=True, slots=True)
class CircuitBreaker:
    """Opens on failures in a row or on a failure rate over a sliding window; half-open
    probes close it again."""

    failure_rate: float = field(default=0.5, metadata=doc("Failure share that opens it."))
    min_calls: int = field(default=20, metadata=doc("Calls in the window before it may open."))
    window_s: float = field(default=30.0, metadata=doc("Sliding window of calls counted."))
    open_s: float = field(default=30.0, metadata=doc("How long it stays open."))
    half_open_calls: int = field(default=3, metadata=doc("Probe calls let through half-open."))
    consecutive_failures: int = field(
        default=5,
        metadata=doc(
            "Failures in a row that open it at once, whatever the rate (a busy backend that "
            "suddenly fails; Envoy's `consecutive_5xx`); 0 turns this trip off."
        ),
    )


@dataclass(frozen=True, slots=True)
class ModelPool:
    """Which of a backend's endpoints take traffic: ``core`` always, the rest on demand."""

    core: int = field(default=1, metadata=doc("Endpoints always in rotation (the first ones)."))
    max: int | None = field(
        default=None, metadata=doc("Endpoints in rotation at most (default: all).")
    )
    idle_timeout_s: float = field(
        default=1800.0,
        metadata=doc("A standby endpoint brought in returns to standby after this idle."),
    )
    scale_up_inflight: float = field(
        default=4.0,
        metadata=doc(
            "Requests in flight per endpoint in rotation past which the next standby one "
            "is warmed (its `warmup` requests answered) and brought in."
        ),
    )


@dataclass(frozen=True, slots=True)
class Discovery:
    """A backend's endpoints from DNS: every A/AAAA record of a name (a Kubernetes headless
    Service), re-resolved every ``interval_s``; changes apply without a reload."""

    dns: str = field(metadata=doc("The name to resolve (e.g. `llm.default.svc.cluster.local`)."))
    port: int = field(metadata=doc("The model servers' port."))
    interval_s: float = field(
        default=DEFAULT_DISCOVERY_INTERVAL_S, metadata=doc("How often the name is resolved.")
    )
    scheme: Literal["http", "https"] = field(default="http", metadata=doc("URL scheme."))
    path: str = field(default="", metadata=doc("Base path appended to each address."))


@dataclass(frozen=True, slots=True)
class Backend:
    """A model server the gateway forwards to."""

    name: str = field(metadata=doc("The backend's name (its key under `backends`)."))
    url: str = field(
        default="",
        metadata=doc(
            "Base URL, `http://` or `https://`; paths are appended. One instance; for "
            "several, `endpoints`.",
            required_unless=("endpoints", "discovery"),
        ),
    )
    endpoints: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Several instances of the same model server (replicas), instead of `url`: base "
            "URLs, each with its own keep-alive pool, picked per request by `balance`; an "
            "endpoint that fails repeatedly is ejected for `circuit_breaker.open_s`. At most 64."
        ),
    )
    discovery: Discovery | None = field(
        default=None,
        metadata=doc(
            "Endpoints from DNS instead of `url`/`endpoints`: one per address the name "
            "resolves to; one that disappears drains its requests in flight."
        ),
    )
    balance: Literal["least_request", "round_robin", "kv_aware"] = field(
        default="least_request",
        metadata=doc(
            "How an endpoint is picked: `least_request` (of two drawn at random, the one "
            "with fewer requests in flight), `round_robin`, or `kv_aware` (each server's "
            "`/metrics`, every `telemetry.interval_ms`: one with more than 5 requests "
            "waiting or its KV cache over 80% gets none while another has room; a request "
            "for a vLLM LoRA adapter goes to a server already serving it, else to one with "
            "room for another adapter)."
        ),
    )
    saturation: Saturation = field(
        default_factory=Saturation,
        metadata=doc("For `kv_aware`: the limits past which an endpoint gets no request."),
    )
    pool: ModelPool | None = field(
        default=None,
        metadata=doc(
            "With several endpoints: keep the first `core` in rotation and the rest on "
            "standby, warmed and brought in under load, returned after `idle_timeout_s`."
        ),
    )
    prefix_affinity: bool = field(
        default=False,
        metadata=doc(
            "With several endpoints: send a request whose leading context (model, system "
            "prompt, first turn) an endpoint served recently to that endpoint, while it is "
            "not busier than the least busy by more than a few requests (its prefix cache "
            "is reused)."
        ),
    )
    model_version: str = field(
        default="",
        metadata=doc(
            "Version of the model served; part of every cache key, so bumping it "
            "invalidates that backend's cached answers at once.  `auto`: ask the servers "
            "which weights they serve (`/info`, `/api/tags`, `/v1/models`) and key by that "
            "(the backend is not cached while none says)."
        ),
    )
    model_version_interval_s: float = field(
        default=30.0, metadata=doc("With `model_version: auto`: how often each server is asked.")
    )
    timeout_s: float = field(
        default=DEFAULT_TIMEOUT_S,
        metadata=doc("Total time for a non-streaming exchange, headers and body (504 past it)."),
    )
    stream_timeout_s: float = field(
        default=DEFAULT_STREAM_TIMEOUT_S,
        metadata=doc(
            "Total time for a streaming (SSE) exchange; long generations need more "
            "than `timeout_s`."
        ),
    )
    connect_timeout_s: float = field(
        default=DEFAULT_CONNECT_TIMEOUT_S, metadata=doc("Time to open a TCP/TLS connection.")
    )
    idle_timeout_s: float = field(
        default=DEFAULT_IDLE_TIMEOUT_S,
        metadata=doc(
            "Longest silence between two chunks of a response (504 before the first "
            "byte, stream cut after it)."
        ),
    )
    keepalive_s: float = field(
        default=DEFAULT_KEEPALIVE_S,
        metadata=doc(
            "Longest an idle pooled connection is reused: keep it under the backend's own "
            "keep-alive timeout (uvicorn's, under vLLM, is 5 s), so that no request is "
            "written on a connection the backend is closing. A backend's `Keep-Alive: "
            "timeout=N` shortens it to N - 1 s. Raise it for a remote `https` backend that "
            "keeps connections longer (nginx 75 s, Envoy 1 h): past it, a TLS handshake."
        ),
    )
    max_connections: int = field(
        default=DEFAULT_MAX_CONNECTIONS,
        metadata=doc(
            "Keep-alive pool size. Requests past it queue inside the pool, so never "
            "set it below the backend's own concurrency."
        ),
    )
    headers: tuple[tuple[str, str], ...] = field(
        default=(),
        metadata=doc(
            "Extra headers sent upstream (e.g. an API key). Values may use "
            "`${ENV_NAME}`; they are redacted wherever the policy is shown.",
            mapping=True,
            secret=True,
            env=True,
        ),
    )
    ca_bundle: str | None = field(
        default=None, metadata=doc("PEM file of CAs for an `https` backend (system CAs if unset).")
    )
    verify_tls: bool = field(
        default=True, metadata=doc("Verify the `https` backend's certificate. Leave on.")
    )
    warmup: tuple[WarmupRequest, ...] = field(
        default=(),
        metadata=doc(
            "Requests sent at start; `/readyz` stays unready until each has answered, "
            "so the first user request never pays the cold start. An endpoint `discovery` "
            "or a reload adds later gets them too, and no call until they have answered."
        ),
    )
    warmup_timeout_s: float = field(
        default=DEFAULT_WARMUP_TIMEOUT_S,
        metadata=doc("How long warm-up keeps retrying a backend that is still starting."),
    )
    telemetry: TelemetrySource = field(
        default_factory=TelemetrySource, metadata=doc("GPU / server telemetry for throttle rules.")
    )
    max_concurrency: int | None = field(
        default=None,
        metadata=doc(
            "Upstream calls in flight at most (a batched or "
            "coalesced call counts once); off when unset."
        ),
    )
    queue: Queue = field(default_factory=Queue, metadata=doc("The queue past `max_concurrency`."))
    upstream_priority: Literal["none", "vllm"] = field(
        default="none",
        metadata=doc(
            "`vllm`: a chat, completion, embedding or Responses API body sent to this "
            "backend carries the gateway's priority for the call (the route's or "
            "`X-Priority`, under the caller's `max_priority`) as vLLM's `priority` (high "
            "-1, normal 0, low 1; lower runs first), replacing any the client sent, so a "
            "vLLM started with `--scheduling-policy priority` orders and preempts its own "
            "queue as the gateway orders its, and no client sets its own place there. "
            "vLLM without that policy refuses a priority other than 0. `none`: the body "
            "goes as the client wrote it."
        ),
    )
    circuit_breaker: CircuitBreaker | None = field(
        default=None,
        metadata=doc(
            "Circuit breaker over connect errors, timeouts and 5xx other than 503; none unless set."
        ),
    )
    price: Price | None = field(
        default=None,
        metadata=doc(
            "What its tokens cost (a provider's list price, or a GPU's hour over the tokens "
            "it serves): each named tenant's answers are counted in "
            "`gateway_tenant_cost_total{tenant, source}`, a cached or shared answer at what "
            "it would have cost."
        ),
    )
    endpoint_retries: int = field(
        default=DEFAULT_ENDPOINT_RETRIES,
        metadata=doc(
            "With several endpoints: how many other endpoints a call goes to, one after "
            "another, when the one picked did not serve it (a 503: overloaded, or still "
            "loading its model; a 429: its own queue full; a reset or misframed answer), "
            "before any byte of the answer left. Only calls that change nothing "
            "(inference calls, safe methods, an `Idempotency-Key`); within "
            "`endpoint_retry_budget`. 0 turns it off. Either way an endpoint that answered "
            "503 gets calls only when every other refuses too, for its "
            "`Retry-After` (at most 30 s) or 1 s."
        ),
    )
    endpoint_retry_budget: float = field(
        default=DEFAULT_ENDPOINT_RETRY_BUDGET,
        metadata=doc(
            "The retries `endpoint_retries` may add, as a share of the backend's calls over "
            "time (Envoy's retry budget): each call earns this much of a retry, each retry "
            "spends one, and at most 10 are saved up (as many to start with), so a fleet "
            "failing as a whole is not sent its load again on top. 0..1; 0 allows no retry "
            "at all."
        ),
    )
    hedge: Hedge | None = field(
        default=None,
        metadata=doc(
            "Hedged requests over several endpoints: a call that changes nothing, which one "
            "endpoint has not answered in time (a stream: sent its first chunk), is sent to "
            "another as well; the first good answer is used and the other call cancelled. "
            "`answers` for short, uniform calls (embeddings, reranking), `streams` for chat. "
            "None unless set."
        ),
    )
