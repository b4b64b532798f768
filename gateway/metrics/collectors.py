"""The gateway's collectors that read their figures at scrape time: client connections by
state, the embedding tiers' indexes, the shared rate limits, the shared Redis, the process itself
(prometheus_client's own), and the view that adds the policy's constant labels."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample


class ConnectionCollector:
    """``gateway_connections{state}``, counted at scrape time over the open client
    connections (``states`` is set by the data plane's server)."""

    STATES = ("reading", "active", "idle")

    def __init__(self) -> None:
        self.states: Callable[[], dict[str, int]] = dict

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "gateway_connections",
            "Open client connections by state: reading (a request head or body arriving), "
            "active (a request being answered), idle (keep-alive, waiting).",
            labels=["state"],
        )
        counts = self.states()
        for state in self.STATES:
            family.add_metric([state], counts.get(state, 0))
        yield family


@dataclass(frozen=True, slots=True)
class EmbeddingFigures:
    """One route's embedding tier at scrape time: vectors held, shared-index events, with a
    judge its verdicts and the aliases it holds, and what it refused, by reason."""

    route: str
    entries: int
    shared: Mapping[str, int] | None = None
    judged: Mapping[str, int] | None = None
    aliases: int = 0
    refused: Mapping[str, int] | None = None


class EmbeddingCollector:
    """The embedding tiers' figures, read at scrape time from the tiers of the live policy
    (``tiers`` is set by the cache stage; each tier counts for itself)."""

    def __init__(self) -> None:
        self.tiers: Callable[[], Iterable[EmbeddingFigures]] = tuple

    def collect(self) -> Iterator[Metric]:
        entries = GaugeMetricFamily(
            "gateway_cache_embedding_entries",
            "Vectors in a route's embedding index in this process (every replica's, with Redis).",
            labels=["route"],
        )
        shared = CounterMetricFamily(
            "gateway_cache_embedding_shared",
            "A route's embedding index shared through Redis, by event: published, indexed "
            "(another replica's), own, other_embedder, refused, malformed, restarts, "
            "publish_timeout (past its budget: the command runs on and may land), "
            "publish_error, read_error.",
            labels=["route", "event"],
        )
        judged = CounterMetricFamily(
            "gateway_cache_judge",
            "Grey-zone embedding misses handed to a route's judge (the backend asked whether "
            "two questions are the same), by verdict: yes (an alias was filed), no, error "
            "(failed or timed out), dropped (the queue was full), rate_limited (over the "
            "rate budget), paused (within 10 s of an error).",
            labels=["route", "verdict"],
        )
        aliases = GaugeMetricFamily(
            "gateway_cache_judge_aliases",
            "Paraphrases a route's judge confirmed, held as aliases of cached entries in "
            "this process.",
            labels=["route"],
        )
        refused = CounterMetricFamily(
            "gateway_cache_embedding_refused",
            "What a route's embedding tier refused to serve, by reason: a candidate's hard "
            "difference (numbers, negation, quoted, code, order, pronoun), its score under "
            "the operating point (score), a pair too long to read whole (too_long), one past "
            "the cross-encoder's reads (unread) or unreadable by it (cross_error), another "
            "scope or context (scope), a rule of verifier: rules; and a message too long to "
            "be verified with any other (message_too_long, counted once a lookup).",
            labels=["route", "reason"],
        )
        for tier in self.tiers():
            entries.add_metric([tier.route], tier.entries)
            for reason, count in sorted((tier.refused or {}).items()):
                refused.add_metric([tier.route, reason], count)
            for event, count in sorted((tier.shared or {}).items()):
                shared.add_metric([tier.route, event], count)
            if tier.judged is not None:
                for verdict, count in tier.judged.items():
                    judged.add_metric([tier.route, verdict], count)
                aliases.add_metric([tier.route], tier.aliases)
        yield entries
        yield refused
        yield shared
        yield judged
        yield aliases


@dataclass(frozen=True, slots=True)
class RateLimitFigures:
    """One ``store: redis`` rate limit at scrape time: whether Redis decides, and how many
    decisions were made where (``redis``, ``local``)."""

    route: str
    store_up: bool
    decisions: Mapping[str, int]


class RateLimitCollector:
    """The shared rate limits' figures, read at scrape time from the limiters of the live
    policy (``routes`` is set by the resilience stage; each limiter counts for itself).
    Registers itself on ``registry``, as prometheus_client's own collectors do."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.routes: Callable[[], Iterable[RateLimitFigures]] = tuple
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gateway_rate_limit_store_up",
            "1 while a `store: redis` route's rate limits are decided in Redis, shared by "
            "every replica; 0 while Redis is taken for down and each process enforces its "
            "local share (the limit over `replicas`).",
            labels=["route"],
        )
        decisions = CounterMetricFamily(
            "gateway_rate_limit_decisions",
            "Rate-limit decisions of a `store: redis` route (admitted or refused), by where "
            "they were made: redis, or local (Redis down, slow or failing).",
            labels=["route", "store"],
        )
        for figures in self.routes():
            up.add_metric([figures.route], 1 if figures.store_up else 0)
            for store, count in figures.decisions.items():
                decisions.add_metric([figures.route, store], count)
        yield up
        yield decisions


@dataclass(frozen=True, slots=True)
class RedisFigures:
    """The gateway's Redis at scrape time: its mode, whether it is taken for up, how often
    it went down or up, and the commands that failed their callers, by reason."""

    mode: str
    up: bool
    transitions: int
    failures: Mapping[str, int]
    forgiven: int = 0


class RedisCollector:
    """The shared Redis's figures, read at scrape time (``links`` is set by whoever opens
    the gateway's Redis; none while nothing uses it).  Registers itself on ``registry``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.links: Callable[[], Iterable[RedisFigures]] = tuple
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "gateway_redis_up",
            "1 while the Redis the gateway shares state through (`redis:`) is taken for up; "
            "0 while it is taken for down, by evidence (several commands in a row, or most "
            "of the last second's, could not reach it): the cache answers misses and "
            "`store: redis` limits are decided by each process's local share.",
            labels=["mode"],
        )
        transitions = CounterMetricFamily(
            "gateway_redis_transitions",
            "The shared Redis going down or up again, by `to`.",
            labels=["mode", "to"],
        )
        failures = CounterMetricFamily(
            "gateway_redis_command_failures",
            "Redis commands that failed their caller (each a cache miss, a local rate-limit "
            "decision or a skipped history sync), by reason: budget (answered too late for "
            "it), unreached (connection refused or lost, timed out, cluster down), answered "
            "(an error Redis answered with), down (not sent: Redis is taken for down).",
            labels=["mode", "reason"],
        )
        forgiven = CounterMetricFamily(
            "gateway_redis_timeouts_forgiven",
            "Times timed-out commands would have taken the shared Redis for down but a PING "
            "sent then was answered: the event loop had stalled past the socket timeout (a "
            "long callback, a CPU-throttled container), not Redis; it stayed up.",
            labels=["mode"],
        )
        for figures in self.links():
            up.add_metric([figures.mode], 1 if figures.up else 0)
            # transitions alternate down, up, down, ... from up
            downs = (figures.transitions + 1) // 2
            transitions.add_metric([figures.mode, "down"], downs)
            transitions.add_metric([figures.mode, "up"], figures.transitions - downs)
            for reason, count in figures.failures.items():
                failures.add_metric([figures.mode, reason], count)
            forgiven.add_metric([figures.mode], figures.forgiven)
        yield up
        yield transitions
        yield failures
        yield forgiven


def register_process_collectors(registry: CollectorRegistry) -> None:
    """``process_*`` (memory, CPU, file descriptors; Linux only), ``python_info`` and
    ``python_gc_*``: what the default registry has, on the app's own."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


class Labelled:
    """A collector view of a registry that adds constant labels to every sample."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self._registry = registry
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            out = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            out.samples = [_with(s, self._labels) for s in metric.samples]
            yield out


def _with(sample: Sample, labels: dict[str, str]) -> Sample:
    merged = {**labels, **sample.labels}
    return Sample(sample.name, merged, sample.value, sample.timestamp, sample.exemplar)
