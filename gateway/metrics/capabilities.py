"""The capabilities' series: the cache (and its embedding tier), single flight and batching."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.metrics.buckets import LATENCY_BUCKETS
from gateway.metrics.collectors import EmbeddingCollector


class CapabilityFamilies:
    """The series of the cache, single flight and batching."""

    def _register_cache(self, r: CollectorRegistry) -> None:
        # -- caching (issue 4) --
        self.cache_lookups = Counter(
            "gateway_cache_lookups",
            "Cache lookups by route, result (hit, miss, bypass) and "
            "match (exact, simhash, embedding, judged, none).",
            ["route", "result", "match"],
            registry=r,
        )
        self.cache_lookup_seconds = Histogram(
            "gateway_cache_lookup_seconds",
            "Time to look a request up in the cache.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.cache_entries = Gauge(
            "gateway_cache_entries",
            "Entries in the cache store (with Redis: every replica's, refreshed every 10 s).",
            registry=r,
        )
        self.cache_bytes = Gauge("gateway_cache_bytes", "Bytes in the cache store.", registry=r)
        self.cache_feedback = Counter(
            "gateway_cache_feedback",
            "Clients' verdicts on the cached answers they got (POST /cache/feedback), by "
            "route and verdict (right, wrong): a wrong one drops the entry; each entry "
            "counts once (a right repeated is not counted again). The share of wrong is the "
            "false-hit rate the route's users report.",
            ["route", "verdict"],
            registry=r,
        )
        self.cache_feedback_limited = Counter(
            "gateway_cache_feedback_limited",
            "Verdicts refused (429) past their caller's cache.feedback_per_min.",
            registry=r,
        )
        self.cache_not_stored = Counter(
            "gateway_cache_not_stored",
            "Answers not stored, by reason: the backend's Cache-Control or Vary said so "
            "(no-store, private, no-cache, max-age=0, vary_all, vary_too_wide), or the "
            "answer could not be kept: unfinished (a stream cut off or ended without its "
            "end, or after an error), too_large (a stream over the 4 MiB an entry records), "
            "id_framed (a KServe answer echoing an id it frames by length), identity_unknown "
            "(a fallback's, with model_version: auto, before its servers said what they "
            "serve).",
            ["route", "reason"],
            registry=r,
        )
        self.cache_store_errors = Counter(
            "gateway_cache_store_errors",
            "Cache store operations that failed (answered as misses).",
            registry=r,
        )
        self.cache_store_up = Gauge(
            "gateway_cache_store_up",
            "1 while the cache store is up (always, for memory); 0 while Redis is taken for "
            "down (requests are answered as misses), by evidence: several failures in a row "
            "or most commands of the last second failing to reach it.",
            registry=r,
        )
        self.cache_store_transitions = Counter(
            "gateway_cache_store_transitions",
            "The cache store going down or up again, by `to`.",
            ["to"],
            registry=r,
        )
        self.embedding = EmbeddingCollector()
        r.register(self.embedding)

    def _register_batching(self, r: CollectorRegistry) -> None:
        # -- single flight and batching (issue 5) --
        self.coalesced = Counter(
            "gateway_coalesced_requests",
            "Requests that joined an identical call already in flight.",
            ["route"],
            registry=r,
        )
        self.coalesced_own_calls = Counter(
            "gateway_coalesced_own_calls",
            "Requests that joined a call in flight and then made their own after all (a "
            "KServe answer echoing the first caller's id framed by length or compressed, so "
            "it cannot be given another id): calls saved are the joins less these.",
            ["route"],
            registry=r,
        )
        self.batch_size = Histogram(
            "gateway_batch_size",
            "Items per batched upstream call.",
            ["route"],
            buckets=(1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 128, 256),
            registry=r,
        )
        self.batch_wait = Histogram(
            "gateway_batch_wait_seconds",
            "Time a request waited for its batch to go.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_limit = Gauge(
            "gateway_batch_limit",
            "Current batch size limit (moves with adaptive sizing and OOM back-off).",
            ["route"],
            registry=r,
        )
        self.batch_splits = Counter(
            "gateway_batch_splits",
            "Batches split in halves to isolate a bad input, by what the merged call got: "
            "4xx, 5xx (not 503, not out of memory), or an answer that could not be split.",
            ["route", "reason"],
            registry=r,
        )
        self.batch_oom_backoffs = Counter(
            "gateway_batch_oom_backoffs",
            "Batch size halvings after the backend ran out of memory.",
            ["route"],
            registry=r,
        )
