"""The rules of a policy that its types cannot say: ranges, cross-references, exclusive
settings.  Each check returns ``(key, message)`` pairs, the key relative to the object
checked; the loader adds file, full key path and line."""

from __future__ import annotations

import ipaddress
import math

from gateway.policy.generation import check_generation, takes_generations
from gateway.policy.hedge import check_hedge
from gateway.policy.match import glob_regex
from gateway.policy.mirror import check_mirror
from gateway.policy.model import (
    Admin,
    Backend,
    RateLimit,
    RetryBudget,
    Route,
    Semantic,
    Server,
    ThrottleRule,
    Tracing,
)
from gateway.policy.rate_limit import RATES
from gateway.policy.route import MODEL_LIST_PATH
from gateway.policy.routing import OPENAI_JSON_PATHS

Found = list[tuple[str, str]]
MAX_ENDPOINTS = 64
"""Endpoints per backend at most: each is a label value of the endpoint metrics."""


def check_server(server: Server) -> Found:
    """``server``: limits are positive, trusted proxies are CIDRs."""
    found: Found = []
    for key in (
        "max_body_bytes",
        "header_timeout_s",
        "body_timeout_s",
        "keepalive_timeout_s",
        "client_send_timeout_s",
        "max_header_bytes",
        "max_header_count",
        "max_connections",
        "max_buffered_body_bytes",
        "body_deadline_s",
        "max_json_values",
    ):
        if getattr(server, key) <= 0:
            found.append((key, "must be greater than 0"))
    if server.min_body_rate_bytes_s < 0:
        found.append(("min_body_rate_bytes_s", "must not be negative"))
    for i, method in enumerate(server.allowed_methods):
        if not method or not method.isascii() or not method.isalpha() or not method.isupper():
            found.append((f"allowed_methods[{i}]", f"{method!r} is not an upper-case method"))
        elif method in ("CONNECT", "TRACE"):
            found.append((f"allowed_methods[{i}]", f"{method} is never served"))
    if server.shutdown_grace_s < 0:
        found.append(("shutdown_grace_s", "must not be negative"))
    if server.reload_settle_s < 0:
        found.append(("reload_settle_s", "must not be negative"))
    if not 1 <= server.ipv6_client_prefix <= 128:
        found.append(("ipv6_client_prefix", "must be 1 to 128"))
    for i, cidr in enumerate(server.trusted_proxies):
        try:
            ipaddress.ip_network(cidr, strict=False)
        except ValueError:
            found.append((f"trusted_proxies[{i}]", f"{cidr!r} is not an IP address or CIDR"))
    return found


def check_admin(admin: Admin) -> Found:
    """``admin``: a token, if given, is not empty (an empty one would match an empty
    ``Authorization: Bearer``); leave it out for loopback-only mutating endpoints."""
    if admin.token is not None and not admin.token.strip():
        return [("token", "is empty; give a long random token, or none (loopback only)")]
    return []


def check_rate_limit(limit: RateLimit) -> Found:
    """A ``rate_limit``: a rate given, every figure positive."""
    found: Found = []
    if all(getattr(limit, key) is None for key in RATES):
        found.append(("rate_limit", f"set at least one of {', '.join(RATES)}"))
    for key in (*RATES, "burst"):
        value = getattr(limit, key)
        if value is not None and value <= 0:
            found.append((f"rate_limit.{key}", "must be greater than 0"))
    if limit.replicas < 1:
        found.append(("rate_limit.replicas", "must be at least 1"))
    return found


def check_retry_budget(budget: RetryBudget) -> Found:
    """``retry_budget``: shares and rates not negative, a window that has a length."""
    found: Found = []
    if budget.ratio < 0:
        found.append(("ratio", "must not be negative"))
    if budget.min_retries_per_s < 0:
        found.append(("min_retries_per_s", "must not be negative"))
    if budget.window_s <= 0:
        found.append(("window_s", "must be greater than 0"))
    return found


def check_tracing(tracing: Tracing) -> Found:
    """``tracing``: a ratio is a share."""
    if not 0 <= tracing.sample_ratio <= 1:
        return [("sample_ratio", "must be between 0 and 1")]
    return []


EXPORTER_FIELDS = {
    "gpu_power_ratio": "DCGM_FI_DEV_POWER_MGMT_LIMIT",
    "gpu_thermal_throttling": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
}
"""Signals whose DCGM field the stock dcgm-exporter counters file does not collect."""


def warn_route(route: Route) -> Found:
    """A tokens limit that streams can pass unseen (a warning: a backend may refuse
    ``stream_options``, or no client may stream)."""
    limit = route.rate_limit
    if limit is None or route.stream_usage != "pass":
        return []
    if all(getattr(limit, key) is None for key in RATES if "tokens" in key or "cost" in key):
        return []
    return [
        (
            "stream_usage",
            "is `pass`: a stream whose client does not ask for its usage "
            "(`stream_options.include_usage`) is settled at a token per event it streamed, "
            "near its count but not exact (a server may send several in one event); "
            "`stream_usage: ask` settles every stream on its own count",
        )
    ]


def warn_throttle(rule: ThrottleRule, backends: dict[str, Backend]) -> Found:
    """What may keep a valid rule from ever firing (warnings, not errors)."""
    backend = backends.get(rule.backend)
    field = EXPORTER_FIELDS.get(rule.when.signal)
    if backend is None or field is None or backend.telemetry.source != "prometheus":
        return []
    return [
        (
            "when.signal",
            f"{rule.when.signal} needs {field}, which the stock dcgm-exporter counters do not "
            "collect: run the exporter with deploy/k8s/dcgm-counters.csv, or the rule never "
            "fires (the gateway warns again if the signal is never seen)",
        )
    ]


def check_throttle(rule: ThrottleRule, backends: dict[str, Backend]) -> Found:
    """One throttle rule (duplicates are the loader's, which sees them all)."""
    found: Found = []
    if rule.backend not in backends:
        found.append(("backend", f"unknown backend {rule.backend!r}"))
    if rule.when.clear_below > rule.when.above:
        found.append(("when.clear_below", "must not be above `above` (it is the hysteresis floor)"))
    if rule.action == "limit" and rule.limit is None:
        found.append(
            ("limit", "a `limit` rule needs `limit: {max_concurrency|rps|batch_max_size}`")
        )
    if rule.limit is not None:
        set_fields = [
            v
            for v in (rule.limit.max_concurrency, rule.limit.rps, rule.limit.batch_max_size)
            if v is not None
        ]
        if not set_fields:
            found.append(("limit", "set at least one of max_concurrency, rps, batch_max_size"))
        elif any(v <= 0 for v in set_fields):
            found.append(("limit", "limits must be positive"))
    return found


def check_backend(b: Backend) -> Found:
    """One backend."""
    found: Found = []

    def bad(key: str, message: str) -> None:
        found.append((key, message))

    given = [k for k in ("url", "endpoints", "discovery") if getattr(b, k)]
    if not given:
        bad("url", "is required (or `endpoints` or `discovery`, for several instances)")
    elif len(given) > 1:
        bad(given[1], "give `url` (one instance) or `endpoints` or `discovery`, only one")
    elif b.url and not b.url.startswith(("http://", "https://")):
        bad("url", f"must start with http:// or https://, not {b.url!r}")
    if len(b.endpoints) > MAX_ENDPOINTS:
        bad("endpoints", f"at most {MAX_ENDPOINTS} endpoints per backend")
    for i, url in enumerate(b.endpoints):
        if not url.startswith(("http://", "https://")):
            bad(f"endpoints[{i}]", f"must start with http:// or https://, not {url!r}")
    if not 0 <= b.endpoint_retries <= MAX_ENDPOINTS:
        bad("endpoint_retries", f"must be between 0 and {MAX_ENDPOINTS}")
    if not 0 <= b.endpoint_retry_budget <= 1:
        bad("endpoint_retry_budget", "must be between 0 and 1")
    if b.hedge is not None:
        found.extend(check_hedge(b.hedge, len(b.endpoints), b.discovery is not None))
    if b.price is not None and min(b.price.input_per_million, b.price.output_per_million) < 0:
        bad("price", "must not be negative")
    if b.pool is not None:
        if b.pool.core < 1:
            bad("pool.core", "must be at least 1")
        if b.pool.max is not None and b.pool.max < b.pool.core:
            bad("pool.max", "must not be below pool.core")
        if b.pool.idle_timeout_s <= 0 or b.pool.scale_up_inflight <= 0:
            bad("pool", "idle_timeout_s and scale_up_inflight must be greater than 0")
    if b.discovery is not None:
        if not 0 < b.discovery.port < 65536:
            bad("discovery.port", "must be between 1 and 65535")
        if b.discovery.interval_s <= 0:
            bad("discovery.interval_s", "must be greater than 0")
        if not b.discovery.dns:
            bad("discovery.dns", "must name a host")
    urls = [u.rstrip("/") for u in b.endpoints]
    if len(set(urls)) != len(urls):
        bad("endpoints", "an endpoint is listed twice")
    for key in (
        "timeout_s",
        "stream_timeout_s",
        "connect_timeout_s",
        "idle_timeout_s",
        "keepalive_s",
        "warmup_timeout_s",
        "model_version_interval_s",
    ):
        if getattr(b, key) <= 0:
            bad(key, "must be greater than 0")
    if b.max_connections < 1:
        bad("max_connections", "must be at least 1")
    for i, w in enumerate(b.warmup):
        if not w.path.startswith("/"):
            bad(f"warmup[{i}].path", "must start with /")
    for key, value in b.headers:
        if any(c in key + value for c in "\r\n\0"):
            bad(f"headers.{key}", "header names and values must not contain line breaks")
    if b.max_concurrency is not None and b.max_concurrency < 1:
        bad("max_concurrency", "must be at least 1")
    if b.queue.capacity < 0 or b.queue.timeout_ms <= 0:
        bad("queue", "capacity must be >= 0 and timeout_ms > 0")
    t = b.telemetry
    if t.source == "prometheus" and not t.url:
        bad("telemetry.url", "the prometheus source needs a metrics URL")
    if t.interval_ms < 50:
        bad("telemetry.interval_ms", "must be at least 50")
    for key, url in (
        ("url", t.url),
        *((f"extra_urls[{i}]", u) for i, u in enumerate(t.extra_urls)),
    ):
        try:
            url.format(host="h", port=1)
        except (KeyError, IndexError, ValueError):
            bad(
                f"telemetry.{key}", "only {host} and {port} may be put in (braces otherwise: {{ }})"
            )
    sat = b.saturation
    if sat.queue_waiting < 0 or not 0 < sat.kv_cache_usage <= 1:
        bad("saturation", "queue_waiting must be >= 0 and kv_cache_usage in (0, 1]")
    cb = b.circuit_breaker
    if cb is not None:
        if not 0 < cb.failure_rate <= 1:
            bad("circuit_breaker.failure_rate", "must be in (0, 1]")
        if cb.min_calls < 1 or cb.half_open_calls < 1:
            bad("circuit_breaker", "min_calls and half_open_calls must be at least 1")
        if cb.consecutive_failures < 0:
            bad("circuit_breaker.consecutive_failures", "must not be negative")
        if cb.window_s <= 0 or cb.open_s <= 0:
            bad("circuit_breaker", "window_s and open_s must be greater than 0")
    return found


def check_judge(semantic: Semantic) -> Found:
    """``cache.semantic.judge``: sizes and rates that bound it, and a verifier score to
    judge by (checked only when it is on)."""
    judge = semantic.judge
    if not judge.enabled:
        return []
    found: Found = []

    def bad(key: str, message: str) -> None:
        found.append((f"cache.semantic.judge.{key}" if key else "cache.semantic.judge", message))

    if semantic.method != "embedding":
        bad("enabled", "the judge needs `method: embedding` (it judges embedding misses)")
    elif semantic.verifier == "rules":
        bad("enabled", "the judge needs `verifier: learned` (its score marks the grey zone)")
    elif semantic.embedder is not None and semantic.min_score is None:
        bad(
            "enabled",
            "the judge needs the learned verifier, which runs with an `embedder` only "
            "when `cache.semantic.min_score` is set",
        )
    if not 0 <= judge.min_score <= 1:
        bad("min_score", "must be in [0, 1]")
    elif semantic.min_score is not None and judge.min_score >= semantic.min_score:
        bad(
            "min_score",
            f"must be below cache.semantic.min_score ({semantic.min_score:g}): the grey zone "
            "lies between them, so nothing would be judged",
        )
    if judge.rate_per_s <= 0:
        bad("rate_per_s", "must be greater than 0")
    for key in ("burst", "max_pending", "max_aliases"):
        if getattr(judge, key) < 1:
            bad(key, "must be at least 1")
    if judge.timeout_ms <= 0:
        bad("timeout_ms", "must be greater than 0")
    if judge.model is not None and not judge.model.strip():
        bad("model", "must name a model (or leave it out: the request's model is used)")
    return found


def check_merge_models(route: Route, backends: dict[str, Backend]) -> Found:
    """A route's ``merge_models``: known backends, once each, on a route GET /v1/models takes."""
    found: Found = []
    seen = {route.backend}
    for i, name in enumerate(route.merge_models):
        if name not in backends:
            found.append((f"merge_models[{i}]", f"unknown backend {name!r}"))
        elif name in seen:
            found.append((f"merge_models[{i}]", f"{name!r} is already asked for this list"))
        seen.add(name)
    if route.merge_models and (
        route.match.model is not None or glob_regex(route.match.path).match(MODEL_LIST_PATH) is None
    ):
        found.append(
            (
                "merge_models",
                f"only applies to a route that `GET {MODEL_LIST_PATH}` takes: its path must match "
                f"{MODEL_LIST_PATH} and it must not match on `model` (a GET has no body)",
            )
        )
    return found


def check_target_models(route: Route) -> Found:
    """A route's ``target_models``: named, weighted, on a route an OpenAI body can take."""
    found: Found = []
    for i, target in enumerate(route.target_models):
        if not target.model.strip():
            found.append((f"target_models[{i}].model", "must name a model"))
        if not (target.weight >= 0 and math.isfinite(target.weight)):
            found.append((f"target_models[{i}].weight", "must be a finite number >= 0"))
    if route.target_models and not any(t.weight > 0 for t in route.target_models):
        found.append(("target_models", "at least one weight must be above 0"))
    path = glob_regex(route.match.path).match
    if route.target_models and not any(path(p) for p in OPENAI_JSON_PATHS):
        found.append(
            (
                "target_models",
                "only applies to a route an OpenAI JSON body can take: its path must match "
                + ", ".join(sorted(OPENAI_JSON_PATHS)),
            )
        )
    return found


def check_route(route: Route, backends: dict[str, Backend]) -> Found:
    """One route (its name and backend are the loader's, which sees them all)."""
    found: Found = []

    def bad(key: str, message: str) -> None:
        found.append((key, message))

    if route.prewarm is not None:
        if route.prewarm.horizon_s <= 0:
            bad("prewarm.horizon_s", "must be greater than 0")
        if route.prewarm.headroom < 1:
            bad("prewarm.headroom", "must be at least 1")
        if route.prewarm.endpoint_rps is not None and route.prewarm.endpoint_rps <= 0:
            bad("prewarm.endpoint_rps", "must be greater than 0")
    for key, names in (("fallback", route.fallback), ("context_fallback", route.context_fallback)):
        for i, name in enumerate(names):
            if name not in backends:
                bad(f"{key}[{i}]", f"unknown backend {name!r}")
            elif name == route.backend:
                bad(f"{key}[{i}]", "the primary backend cannot be its own fallback")
    found.extend(check_merge_models(route, backends))
    found.extend(check_target_models(route))
    if route.mirror is not None:
        found.extend(check_mirror(route.mirror, route.backend, backends))
    if route.batch is not None:
        if route.batch.max_size < 1:
            bad("batch.max_size", "must be at least 1")
        if route.batch.max_wait_ms < 0:
            bad("batch.max_wait_ms", "must not be negative")
        if route.batch.adaptive is not None and route.batch.adaptive.target_latency_ms <= 0:
            bad("batch.adaptive.target_latency_ms", "must be greater than 0")
    if route.quality is not None and not route.fallback:
        bad("quality", "needs a `fallback` backend to send low-confidence requests to")
    if route.cache is not None:
        if route.cache.ttl_s <= 0:
            bad("cache.ttl_s", "must be greater than 0")
        semantic = route.cache.semantic
        if not 0 <= semantic.max_distance <= 16:
            bad("cache.semantic.max_distance", "must be between 0 and 16")
        if semantic.threshold is not None and not 0 < semantic.threshold <= 1:
            bad("cache.semantic.threshold", "must be in (0, 1]")
        if not 0 < semantic.max_false_hit_rate < 1:
            bad("cache.semantic.max_false_hit_rate", "must be in (0, 1)")
        if semantic.min_score is not None and not 0 <= semantic.min_score <= 1:
            bad("cache.semantic.min_score", "must be in [0, 1]")
        if semantic.embedder is not None and semantic.embedder not in backends:
            bad("cache.semantic.embedder", f"unknown backend {semantic.embedder!r}")
        elif semantic.embedder is not None and backends[semantic.embedder].model_version == "auto":
            bad("cache.semantic.embedder", "needs a fixed model_version: its vectors' identity")
        if semantic.embedder_model is not None and semantic.embedder is None:
            bad("cache.semantic.embedder_model", "only applies with `embedder`")
        found.extend(check_judge(semantic))
    if route.rate_limit is not None:
        found.extend(check_rate_limit(route.rate_limit))
    if route.generation is not None:
        found.extend(check_generation(route.generation, takes_generations(route.match.path)))
    return found
