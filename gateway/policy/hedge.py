"""A backend's hedged requests (``backends.<name>.hedge``): a call its endpoint has not
answered within the backend's usual time is sent to a second endpoint as well, and the
first answer wins, the other call cancelled (Dean and Barroso's "The Tail at Scale";
Envoy's ``hedge_policy``).  A few extra calls, bounded by ``max_ratio``, cut the tail a
straggling instance puts on every caller (a GC pause, a noisy neighbour, a GPU throttling
its clocks)."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

from gateway.policy.metadata import doc

DEFAULT_HEDGE_PERCENTILE = 95.0
DEFAULT_HEDGE_MAX_RATIO = 0.05

Found = list[tuple[str, str]]

GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/generate")
"""Where a whole answer's time follows the length of what the model generates."""


@dataclass(frozen=True, slots=True)
class Hedge:
    """Which calls a second endpoint is asked too, when, and how often at most."""

    after_ms: float | None = field(
        default=None,
        metadata=doc(
            "How long an endpoint has to answer (a stream: to send its first chunk) before "
            "the call is also sent to another. None: the `percentile` of the backend's "
            "recent times (its last 256 hedgeable calls of the kind, answers or streams; no "
            "hedging until 32 have been timed)."
        ),
    )
    percentile: float = field(
        default=DEFAULT_HEDGE_PERCENTILE,
        metadata=doc(
            "With no `after_ms`: the percentile of recent answer times past which a call "
            "is hedged, 50 to 99.9 (95: about one call in twenty, before `max_ratio`)."
        ),
    )
    answers: bool = field(
        default=True,
        metadata=doc(
            "Hedge calls answered whole (not streamed) on their answer. For short, uniform "
            "calls: embeddings, reranking, classification; a generation's time follows its "
            "length, so its slow calls are mostly long ones."
        ),
    )
    streams: bool = field(
        default=False,
        metadata=doc(
            "Hedge streamed calls on their first chunk (the time to the first token): the "
            "other call is cancelled at the winner's first chunk, so a hedge costs one more "
            "prefill, not a second generation."
        ),
    )
    max_ratio: float = field(
        default=DEFAULT_HEDGE_MAX_RATIO,
        metadata=doc(
            "Hedges per hedgeable call at most, over 0 to 1 (0.05: at most 5% more calls "
            "upstream): each call earns this share of a hedge, each hedge spends one, and "
            "at most 10 are saved up (as many at start), so a backend slow for everyone is "
            'not sent twice its load (`gateway_hedges_total{outcome="budget"}`).'
        ),
    )


def check_hedge(hedge: Hedge, endpoints: int, discovery: bool) -> Found:
    """A backend's ``hedge``: bounds that hold, and another endpoint to hedge to."""
    found: Found = []
    if hedge.after_ms is not None and not hedge.after_ms > 0:
        found.append(("hedge.after_ms", "must be greater than 0, or left out"))
    if not 50 <= hedge.percentile <= 99.9:
        found.append(("hedge.percentile", "must be between 50 and 99.9"))
    if not 0 < hedge.max_ratio <= 1:
        found.append(("hedge.max_ratio", "must be greater than 0 and at most 1"))
    if not (hedge.answers or hedge.streams):
        found.append(("hedge", "hedges nothing: set `answers` or `streams`"))
    if endpoints < 2 and not discovery:
        found.append(("hedge", "needs several instances (`endpoints` or `discovery`) to hedge to"))
    return found


def warn_hedge(hedge: Hedge | None, path_glob: str) -> Found:
    """A route sending generations to a backend that hedges whole answers (a warning: a
    hedge of a long generation runs it twice; its stream's first chunk is what to hedge)."""
    if hedge is None or not hedge.answers:
        return []
    hit = next((p for p in GENERATION_PATHS if fnmatch.fnmatchcase(p, path_glob)), None)
    if hit is None:
        return []
    return [
        (
            "backend",
            f"hedges whole answers (`hedge.answers`), and this route sends it {hit}: a "
            "generation's time follows its length, so a hedge mostly runs a long generation "
            "twice; `hedge: {answers: false, streams: true}` hedges a stream's first token "
            "instead",
        )
    ]
