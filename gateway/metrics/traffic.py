"""The data plane's series: requests and their timing, upstream calls and endpoints, tokens,
the policy, the client side's timeouts and connections, and the process itself."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway import __version__
from gateway.metrics.buckets import LAG_BUCKETS, LATENCY_BUCKETS
from gateway.metrics.collectors import ConnectionCollector


class TrafficFamilies:
    """The series of requests, endpoints, clients and the process."""

    def _register_traffic(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "gateway_requests",
            "Requests answered, by route, backend and HTTP status.",
            ["route", "backend", "status"],
            registry=r,
        )
        self.request_duration = Histogram(
            "gateway_request_duration_seconds",
            "Time from request received to response complete.",
            ["route", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_duration = Histogram(
            "gateway_upstream_duration_seconds",
            "Time from sending upstream to the upstream's response headers.",
            ["backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stream_first_byte = Histogram(
            "gateway_stream_first_byte_seconds",
            "Time from request received to the first "
            "byte of a streamed response written to the client.",
            ["route", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.target_model_requests = Counter(
            "gateway_target_model_requests",
            "Requests a route's target_models sent to each target model (the model the "
            "backend was asked for instead of the client's).",
            ["route", "model"],
            registry=r,
        )
        self.generation_bounds = Counter(
            "gateway_generation_bounds",
            "Calls a route's generation bounds changed or refused, by action: clamped (asked "
            "more output tokens than max_tokens, sent with it), defaulted (named no bound, "
            "given default_max_tokens), refused (a 400: past max_tokens with over: refuse, "
            "past max_choices, or a bound that is not a positive integer).",
            ["route", "action"],
            registry=r,
        )
        self.mirror_requests = Counter(
            "gateway_mirror_requests",
            "Copies of a route's upstream calls sent to its mirror backend (shadow traffic), "
            "by outcome: the answer's status class (2xx, 4xx, 5xx...), error (no whole "
            "answer: refused, timed out, cut), shed (not sent: max_in_flight were out), or "
            "no_room (not sent: the mirror backend had no free slot under its "
            "max_concurrency, calls queued, a rule shedding or rerouting it, or its breaker "
            "not closed).",
            ["route", "backend", "outcome"],
            registry=r,
        )
        self.mirror_duration = Histogram(
            "gateway_mirror_duration_seconds",
            "Time a mirror backend took to answer a copy whole (a stream to its end).",
            ["route", "backend"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.mirror_comparisons = Counter(
            "gateway_mirror_comparisons",
            "Deterministic calls (temperature 0, embeddings, the servers' own such as KServe "
            "V2 infer) whose mirror answered 200 as the route's backend did, by result: same "
            "(the same answer, ids, times, model names and versions and token counts aside; "
            "numbers within a thousandth; embeddings at cosine 0.999 or more) or different.",
            ["route", "backend", "result"],
            registry=r,
        )
        self.mirror_in_flight = Gauge(
            "gateway_mirror_in_flight",
            "Copies sent to a route's mirror backend and not yet answered whole.",
            ["route"],
            registry=r,
        )
        self.response_ids_refused = Counter(
            "gateway_response_ids_refused",
            "Requests refused for naming a stored response, conversation, item, chat "
            "completion, file, batch, upload, vector store or container that is not theirs "
            "(tenants.response_id_secret): an id without its tenant's tag, in the path "
            "(where=path), previous_response_id, a response's conversation, an item given by "
            "id or a list's cursor (where=item), or a file, vector store or container named "
            "in a body (where=file, where=vector_store, where=container). "
            "tenant: the named tenant, or empty.",
            ["tenant", "where"],
            registry=r,
        )
        self.control_paths_refused = Counter(
            "gateway_control_paths_refused",
            "Requests refused for asking a model server's own control endpoint "
            "(server.control_paths: refuse): server is the kind whose endpoint it was "
            "(llama.cpp, vllm, sglang, ollama, kserve, sim). tenant: the named tenant, or empty.",
            ["tenant", "server"],
            registry=r,
        )
        self.endpoint_pins = Counter(
            "gateway_endpoint_pins",
            "Requests naming what only one endpoint of a backend holds (a stored response, "
            "with tenants.response_id_secret), by outcome: kept (sent to that endpoint), "
            "gone (the backend has it no more; balanced, and the backend answered).",
            ["backend", "outcome"],
            registry=r,
        )
        self.backend_model_identity = Gauge(
            "gateway_backend_model_identity",
            "1 for the version a backend with model_version: auto is keyed by now (auto: and "
            "12 hex digits of what its endpoints say they serve), the value to purge its "
            "cached answers by; auto:unknown while no endpoint says, when its calls are not "
            "cached ([caching](caching.md#keys)).",
            ["backend", "identity"],
            registry=r,
        )
        self.endpoint_adapter_picks = Counter(
            "gateway_endpoint_adapter_picks",
            "Requests for a vLLM LoRA adapter picked an endpoint for (balance: kv_aware), by "
            "why: serving (a server was running it), room (none was; one had room for "
            "another adapter), full (none had room: the pick loads it where it can).",
            ["backend", "outcome"],
            registry=r,
        )
        self.endpoint_retries = Counter(
            "gateway_endpoint_retries",
            "Calls sent to another endpoint of their backend because the one picked did not "
            "serve them (backends.<name>.endpoint_retries), by reason: connect (no "
            "connection: nothing was sent), unavailable (a reset or misframed answer), "
            "upstream_503, upstream_429; and outcome: sent, or budget (none: the backend's "
            "retry budget was spent).",
            ["backend", "reason", "outcome"],
            registry=r,
        )
        self.hedges = Counter(
            "gateway_hedges",
            "Hedged requests (backends.<name>.hedge), by kind (answer: a whole answer; "
            "stream: a stream's first chunk) and outcome: won (the second endpoint "
            "answered first), lost (the first did, once the second was asked too), budget "
            "(one was due but the backend's max_ratio was spent), no_endpoint (one was due "
            "but no other endpoint was healthy, free of a throttle rule and not refusing), "
            "no_room (one was due but the backend had no room for another call: its "
            "max_concurrency full or calls queued, a rule shedding or rerouting its calls, "
            "or its breaker not closed).",
            ["backend", "kind", "outcome"],
            registry=r,
        )
        self.hedge_delay = Gauge(
            "gateway_hedge_delay_seconds",
            "How long an endpoint of the backend has to answer (kind=answer) or to send a "
            "stream's first chunk (kind=stream) before a call is hedged: hedge.after_ms, or "
            "the percentile of its recent times.",
            ["backend", "kind"],
            registry=r,
        )
        self.model_list_missing = Counter(
            "gateway_model_list_missing",
            "Merged model lists (a route's merge_models) served without a backend's models, "
            "because asking it failed.",
            ["route", "backend"],
            registry=r,
        )
        self.inflight = Gauge(
            "gateway_inflight_requests", "Upstream requests in flight.", ["backend"], registry=r
        )
        self.endpoint_inflight = Gauge(
            "gateway_endpoint_inflight",
            "Upstream requests in flight per endpoint (instance) of a backend.",
            ["backend", "endpoint"],
            registry=r,
        )
        self.endpoint_requests = Counter(
            "gateway_endpoint_requests",
            "Upstream requests per endpoint, by outcome (the status class, or error).",
            ["backend", "endpoint", "status"],
            registry=r,
        )
        self.endpoint_state = Gauge(
            "gateway_endpoint_state",
            "1 for an endpoint's current state (active, standby, warming, ejected, "
            "throttled, refusing: its last answer a 503, picked after the others), 0 for "
            "the others.",
            ["backend", "endpoint", "state"],
            registry=r,
        )
        self.endpoint_warmups = Counter(
            "gateway_endpoint_warmups",
            "Warm-ups of the endpoints discovery added to a backend with warmup requests, "
            "before they take calls, by outcome: warmed, or gave_up (past warmup_timeout_s: "
            "it takes calls all the same).",
            ["backend", "outcome"],
            registry=r,
        )
        self.endpoint_signal = Gauge(
            "gateway_endpoint_signal",
            "An endpoint's own telemetry (kv_aware or a {host}/{port} telemetry.url).",
            ["backend", "endpoint", "signal"],
            registry=r,
        )
        self.pool_active_endpoints = Gauge(
            "gateway_pool_active_endpoints",
            "Endpoints of a backend taking traffic (not ejected).",
            ["backend"],
            registry=r,
        )
        self.forecast_rps = Gauge(
            "gateway_forecast_requests_per_second",
            "A route's forecast mean request rate over its prewarm horizon.",
            ["route"],
            registry=r,
        )
        self.desired_endpoints = Gauge(
            "gateway_desired_endpoints",
            "Endpoints a backend will need over the horizon: the forecast times the "
            "headroom over one endpoint's best rate (for autoscalers).",
            ["backend"],
            registry=r,
        )
        self.tokens = Counter(
            "gateway_tokens",
            "Tokens reported by upstream `usage`, by kind (prompt, completion; the Responses "
            "API's and Anthropic's input and output, every cached prompt token included; the "
            "servers' own APIs' counts, llama.cpp's `tokens_predicted`, Ollama's `eval_count`, "
            "TGI's `generated_tokens`, SGLang's `meta_info`, Triton's `num_output_tokens`): "
            "the answers the backend computed for a client, not cache hits nor answers "
            "shared by single flight.",
            ["backend", "kind"],
            registry=r,
        )
        self.tenant_requests = Counter(
            "gateway_tenant_requests",
            "Requests of a named tenant (`tenants:` in the policy), by HTTP status.",
            ["tenant", "status"],
            registry=r,
        )
        self.tenant_tokens = Counter(
            "gateway_tenant_tokens",
            "Tokens of the answers a named tenant got, by kind (prompt, completion) and "
            "source: backend (computed for it), cache (a cache hit) or coalesced (an answer "
            "computed for another request of the same tenant scope, shared by single flight).",
            ["tenant", "kind", "source"],
            registry=r,
        )
        self.tenant_cost = Counter(
            "gateway_tenant_cost",
            "What the answers a named tenant got cost, by the backends' `price` (per million "
            "prompt and generated tokens, in its currency), by source as in "
            "gateway_tenant_tokens: backend (charged), cache or coalesced (what was saved).",
            ["tenant", "source"],
            registry=r,
        )
        self.policy_generation = Gauge(
            "gateway_policy_generation",
            "Generation of the loaded policy (1 for the first, +1 per reload).",
            registry=r,
        )
        self.policy_info = Gauge(
            "gateway_policy_info",
            "Always 1; `hash` labels the loaded policy's content hash.",
            ["hash"],
            registry=r,
        )
        self.reload_failures = Counter(
            "gateway_policy_reload_failures",
            "Policy reloads rejected as invalid (the last good policy stays).",
            registry=r,
        )
        self.upstream_retries = Counter(
            "gateway_upstream_stale_retries",
            "Requests retried once on a fresh connection after a stale pooled one closed.",
            ["backend"],
            registry=r,
        )
        self.upstream_connections = Counter(
            "gateway_upstream_connections",
            "Connections to backends, by event: opened, or retired (an idle one the gateway "
            "closed before the backend's keep-alive timeout would: keepalive_s, or the "
            "backend's Keep-Alive hint). Opened at nearly the rate of requests: connections "
            "are not reused.",
            ["backend", "event"],
            registry=r,
        )

    def _register_clients(self, r: CollectorRegistry) -> None:
        # -- the client side of the data plane (issue 11) --
        self.client_timeouts = Counter(
            "gateway_client_timeouts",
            "Client connections closed at a timeout, by phase: head (the request head took "
            "too long), body (silence inside a body), idle (keep-alive), send (the client "
            "stopped reading its answer).",
            ["phase"],
            registry=r,
        )
        self.refused_connections = Counter(
            "gateway_refused_connections",
            "Client connections closed at once on arrival, by reason (max_connections).",
            ["reason"],
            registry=r,
        )
        self.connections = ConnectionCollector()
        r.register(self.connections)

    def _register_process(self, r: CollectorRegistry) -> None:
        # -- the process itself (issue 16) --
        self.build_info = Gauge(
            "gateway_build_info",
            "Always 1; `version` labels the gateway's version.",
            ["version"],
            registry=r,
        )
        self.build_info.labels(__version__).set(1)
        self.event_loop_lag = Histogram(
            "gateway_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 0.25 s: time other work held the "
            "loop, which every request on it waited too.",
            buckets=LAG_BUCKETS,
            registry=r,
        )
        self.gc_pause = Histogram(
            "gateway_gc_pause_seconds",
            "Pauses of Python's cyclic garbage collector, by generation (0, 1, 2: 2 is a full "
            "collection); the event loop, and every request on it, waits them out.",
            ["generation"],
            buckets=LAG_BUCKETS,
            registry=r,
        )
