"""The policy of a route (``routes[]``): what it matches, and what happens on the way to its
backend: caching, coalescing, batching, a rate limit, a quality fallback, shadow traffic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.policy.generation import Generation
from gateway.policy.match import Match
from gateway.policy.metadata import doc
from gateway.policy.mirror import Mirror
from gateway.policy.rate_limit import RateLimit

DEFAULT_CACHE_TTL_S = 600.0
DEFAULT_SIMHASH_MAX_DISTANCE = 3
DEFAULT_BATCH_MAX_SIZE = 16
DEFAULT_BATCH_MAX_WAIT_MS = 5.0
DEFAULT_MAX_FALSE_HIT_RATE = 0.01
DEFAULT_PREWARM_HORIZON_S = 600.0
DEFAULT_PREWARM_HEADROOM = 1.2
DEFAULT_JUDGE_MIN_SCORE = 0.5
DEFAULT_JUDGE_RATE_PER_S = 1.0
DEFAULT_JUDGE_BURST = 5
DEFAULT_JUDGE_MAX_PENDING = 64
DEFAULT_JUDGE_TIMEOUT_MS = 5000.0
DEFAULT_JUDGE_MAX_ALIASES = 10_000
MODEL_LIST_PATH = "/v1/models"
"""OpenAI's model list; ``/v1/models/<id>`` retrieves one model."""


@dataclass(frozen=True, slots=True)
class Judge:
    """The backend as judge (opt-in): after a grey-zone embedding miss, the route's own
    backend is asked whether the two questions ask the same thing; a yes makes the new
    question an alias of the cached answer, and ``inline`` serves it (docs/caching.md)."""

    enabled: bool = field(default=False, metadata=doc("Ask the backend (off by default)."))
    mode: Literal["background", "inline"] = field(
        default="background",
        metadata=doc(
            "`background`: judged after the miss, off the request path; a yes serves the "
            "paraphrase's later repeats. `inline`: the miss waits for the verdict (at most "
            "`timeout_ms`, within the same budget) and a yes is answered from the cache at "
            "once: one short judge call instead of a whole generation."
        ),
    )
    min_score: float = field(
        default=DEFAULT_JUDGE_MIN_SCORE,
        metadata=doc(
            "The grey zone's floor: a candidate the learned verifier refused with a score "
            "at least this (and no hard difference) is judged; below it, never."
        ),
    )
    rate_per_s: float = field(
        default=DEFAULT_JUDGE_RATE_PER_S,
        metadata=doc("Judge calls per second at most, per route and process (token bucket)."),
    )
    burst: int = field(
        default=DEFAULT_JUDGE_BURST, metadata=doc("Calls the bucket holds (its size).")
    )
    max_pending: int = field(
        default=DEFAULT_JUDGE_MAX_PENDING,
        metadata=doc("Pairs waiting to be judged at most; a pair past it is dropped, counted."),
    )
    timeout_ms: float = field(
        default=DEFAULT_JUDGE_TIMEOUT_MS,
        metadata=doc("Longest a judge call may take; past it the pair counts as an error."),
    )
    model: str | None = field(
        default=None,
        metadata=doc("The `model` the judge call names (default: the one the request named)."),
    )
    max_aliases: int = field(
        default=DEFAULT_JUDGE_MAX_ALIASES,
        metadata=doc("Aliases kept per route and process, least recently used first out."),
    )


@dataclass(frozen=True, slots=True)
class Semantic:
    """Near-duplicate matching of the final user message, after the exact tier."""

    method: Literal["off", "simhash", "embedding"] = field(
        default="off",
        metadata=doc(
            "`simhash` (near-duplicates, guarded), `embedding` "
            "(opt-in; needs the embedding extra or `embedder`), or "
            "`off` (exact matches only)."
        ),
    )
    max_distance: int = field(
        default=DEFAULT_SIMHASH_MAX_DISTANCE,
        metadata=doc("SimHash: largest Hamming distance (of 64 bits)."),
    )
    threshold: float | None = field(
        default=None,
        metadata=doc(
            "Embedding: cosine similarity a candidate needs before it is verified "
            "(default: 0.80 with the learned verifier, 0.90 with the rules; "
            "docs/caching.md)."
        ),
    )
    verifier: Literal["learned", "rules"] = field(
        default="learned",
        metadata=doc(
            "Embedding: how a candidate is verified: `learned` (a model over features of "
            "the pair and a cross-encoder's reading of it, at the operating point of "
            "`max_false_hit_rate`; a pair is verified only when the cross-encoder reads it "
            "whole, 125 tokens together, about 45 words a message) or `rules` (the guard "
            "over reworded question frames, over whole texts)."
        ),
    )
    max_false_hit_rate: float = field(
        default=DEFAULT_MAX_FALSE_HIT_RATE,
        metadata=doc(
            "Embedding, learned verifier: the error budget, as the share of different "
            "questions that may get a cached answer; the verifier runs at the most "
            "permissive calibrated operating point whose 95% upper bound stays within it."
        ),
    )
    min_score: float | None = field(
        default=None,
        metadata=doc(
            "Embedding, learned verifier: the score a candidate needs, instead of the one "
            "`max_false_hit_rate` picks (`gateway cache-eval --calibrate` prints it for "
            "your own labelled pairs)."
        ),
    )
    embedder: str | None = field(
        default=None,
        metadata=doc(
            "Embedding: a backend whose `/v1/embeddings` embeds "
            "prompts, instead of the local model."
        ),
    )
    embedder_model: str | None = field(
        default=None,
        metadata=doc(
            "Embedding: the `model` sent to the `embedder` backend (servers hosting several "
            "models need it; TEI and single-model vLLM do not)."
        ),
    )
    judge: Judge = field(
        default_factory=Judge,
        metadata=doc("Embedding, learned verifier: the backend as judge of grey-zone misses."),
    )


@dataclass(frozen=True, slots=True)
class RouteCache:
    """Response caching on a route (deterministic requests only)."""

    ttl_s: float = field(default=DEFAULT_CACHE_TTL_S, metadata=doc("Entry lifetime."))
    semantic: Semantic = field(
        default_factory=Semantic, metadata=doc("Near-duplicate tiers after the exact one.")
    )
    allow_sampled: bool = field(
        default=False,
        metadata=doc(
            "Also cache requests with temperature > 0 (or none, "
            "which means 1). Off: a sampled answer is not "
            "reproducible."
        ),
    )
    own_apis: bool = field(
        default=True,
        metadata=doc(
            "Also cache, and share by single flight, the model servers' own calls whose "
            "answer their body alone decides, keyed by its bytes: KServe V2 / "
            "Triton `infer`, TF Serving `:predict`, TEI's `/embed`, `/rerank` and "
            "`/predict`, llama.cpp's `/embedding`, Ollama's `/api/embed`, vLLM's `/pooling`, "
            "`/score` and `/classify`; and llama.cpp's `/completion` and Ollama's `/api/chat` "
            "and `/api/generate` asked a greedy answer (temperature 0), and TGI's "
            "`/generate`, `/generate_stream` and `/` asked one (no parameter that samples), "
            "whole or streamed (a "
            "stream stored once it ended well, replayed as it came); Ollama's `/api/chat` "
            "by its JSON, so `semantic` serves its paraphrases too. "
            "Off: for a model that samples behind one of them (an LLM behind `infer`)."
        ),
    )
    ignore_backend_cache_control: bool = field(
        default=False,
        metadata=doc(
            "Store answers whatever the backend's `Cache-Control` and `Vary` say. Off (the "
            "default): `no-store`, `private`, `no-cache`, `max-age=0` and `Vary: *` answers "
            "are not stored, `s-maxage`/`max-age` cap `ttl_s`, and the values of the "
            "request headers an answer varies on join its key. Only for a backend known "
            "to send wrong cache headers."
        ),
    )


@dataclass(frozen=True, slots=True)
class Prewarm:
    """Predictive pre-warming: the rate forecast and the endpoints it calls for."""

    horizon_s: float = field(
        default=DEFAULT_PREWARM_HORIZON_S,
        metadata=doc("How far ahead the forecast looks (a cold start and then some)."),
    )
    headroom: float = field(
        default=DEFAULT_PREWARM_HEADROOM,
        metadata=doc("Capacity asked for over the forecast (1.2 = 20% more)."),
    )
    endpoint_rps: float | None = field(
        default=None,
        metadata=doc(
            "Requests/s one endpoint serves at its best; default: the best minute seen, "
            "divided by the backend's listed endpoints."
        ),
    )


@dataclass(frozen=True, slots=True)
class Adaptive:
    """AIMD on the batch size against a latency target (Clipper, NSDI'17)."""

    target_latency_ms: float = field(metadata=doc("p90 batch latency to stay under."))


@dataclass(frozen=True, slots=True)
class Batch:
    """Micro-batching of separate requests into one array call."""

    max_size: int = field(
        default=DEFAULT_BATCH_MAX_SIZE,
        metadata=doc(
            "Items per upstream call (keep <= the server's cap, "
            "e.g. TEI's 32); the upper bound with `adaptive`."
        ),
    )
    max_wait_ms: float = field(
        default=DEFAULT_BATCH_MAX_WAIT_MS,
        metadata=doc("Longest a request waits for company (only while the backend is busy)."),
    )
    adaptive: Adaptive | None = field(default=None, metadata=doc("Move the size by AIMD."))


@dataclass(frozen=True, slots=True)
class TargetModel:
    """A model the backend is asked for instead of the one the client named."""

    model: str = field(metadata=doc("The model name the backend serves."))
    weight: float = field(
        default=1.0,
        metadata=doc("Share of the route's requests, relative to the others' (0: none)."),
    )


@dataclass(frozen=True, slots=True)
class Quality:
    """Send low-confidence answers to the fallback instead (non-streaming only)."""

    min_mean_logprob: float = field(
        metadata=doc("Mean token logprob below which the answer is replaced by the fallback's.")
    )
    request_logprobs: bool = field(
        default=True,
        metadata=doc(
            "Ask the backend for logprobs (stripped from the answer if the client did not ask)."
        ),
    )


@dataclass(frozen=True, slots=True)
class Route:
    """A rule sending matching requests to a backend; the first matching route wins."""

    backend: str = field(metadata=doc("Name of the backend serving this route."))
    match: Match = field(default_factory=Match, metadata=doc("What the route matches."))
    name: str = field(
        default="",
        metadata=doc(
            "Name used in metrics and logs; defaults to the path glob (plus the model glob)."
        ),
    )
    fallback: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Backends tried in order when the primary refuses, times out, answers 5xx before "
            "any byte reached the client, has an open breaker, is rerouted by a throttle rule "
            "or its queue is full. Never after a stream has started."
        ),
    )
    context_fallback: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Backends tried in order when a call is refused as too long for the model's "
            "context (llama.cpp's `exceed_context_size_error`, OpenAI's "
            "`context_length_exceeded`, vLLM's, TGI's, SGLang's and Anthropic's refusals), "
            "before any byte reached the client: models with a longer context. A refusal of "
            "another kind reaches the client as it came (LiteLLM's "
            "`context_window_fallbacks`)."
        ),
    )
    target_models: tuple[TargetModel, ...] = field(
        default=(),
        metadata=doc(
            "The models the backend is asked for instead of the one the client named (an "
            "OpenAI body's `model`, set where it has none), each request one of them by "
            "weight: an alias (`gpt-4o` served by `llama-3.1-8b`) or a canary split between "
            "versions. The client's name is the one routed and checked against a tenant's "
            "`models`; the cache and single flight key on the target; `X-Gateway-Model` "
            "names it. The fallback backends are asked for the same target. Where "
            "`match.model` is one name (no glob), `GET /v1/models` lists it and "
            "`GET /v1/models/<name>` answers it (`owned_by: sidecar-gateway`)."
        ),
    )
    stream_usage: Literal["pass", "ask"] = field(
        default="pass",
        metadata=doc(
            "`ask`: a streamed chat or completion whose client did not ask for its usage "
            "chunk (`stream_options.include_usage`) is asked for one anyway, so that its "
            "tokens are counted (`gateway_tokens_total`, per tenant too) and settle a "
            "`tokens_per_min` or `tokens_per_day` limit, and the chunk is taken out of the "
            "stream that client receives. `pass`: streams go as asked (a "
            "backend that refuses `stream_options` needs it)."
        ),
    )
    merge_models: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "Other backends whose OpenAI model lists are merged into this route's backend's: "
            "`GET /v1/models` asks them all at once and lists each model once (the first "
            "backend to list an id gives its entry), leaving out any that fails and naming it "
            "in `X-Gateway-Models-Missing`; `GET /v1/models/<id>` asks them in order and the "
            "first that knows the model answers. Each is asked without the route's fallback."
        ),
    )
    priority: Literal["high", "normal", "low"] = field(
        default="normal",
        metadata=doc("Queue priority (the `X-Priority` header overrides); lowest is shed first."),
    )
    cache: RouteCache | None = field(default=None, metadata=doc("Response caching."))
    coalesce: bool | None = field(
        default=None,
        metadata=doc(
            "Identical in-flight requests share one upstream call (default: on where the "
            "route caches)."
        ),
    )
    batch: Batch | None = field(default=None, metadata=doc("Micro-batching into array calls."))
    rate_limit: RateLimit | None = field(default=None, metadata=doc("Per-tenant rate limit."))
    generation: Generation | None = field(
        default=None,
        metadata=doc(
            "How much one call may ask the model to generate: the most output tokens (a "
            "larger ask clamped or refused), the bound given a call that names none, the "
            "most choices (`n`, `best_of`)."
        ),
    )
    quality: Quality | None = field(default=None, metadata=doc("Low-confidence fallback."))
    prewarm: Prewarm | None = field(
        default=None,
        metadata=doc(
            "Forecast this route's request rate (time of day, day of week, trend) and "
            "export what its backend will need, ahead of the peak."
        ),
    )
    mirror: Mirror | None = field(
        default=None,
        metadata=doc(
            "Shadow traffic: a copy of each call the route sends its backend (not a cache "
            "hit, a coalesced joiner or a call the gateway refused) goes to another backend "
            "once the answer is on its way, and that backend's answer is dropped."
        ),
    )

    @property
    def coalescing(self) -> bool:
        """Whether identical in-flight requests share one call on this route."""
        return self.coalesce if self.coalesce is not None else self.cache is not None
