"""The cache stage: the pipeline's first stage on routes with ``cache:``.

A hit is answered here, before single flight, batching, admission, throttling and breakers:
it costs the backend nothing.  For each call on a caching route:

* not cacheable (``keys.cacheability``: sampled, ``n`` > 1, remote media; or not an OpenAI
  JSON body): passed on, ``X-Gateway-Cache: bypass``;
* a request's ``Cache-Control: no-cache`` skips the lookup (``bypass``), ``no-store`` the
  write; the backend's answer is stored only as its own ``Cache-Control`` and ``Vary``
  allow (``control``: not ``no-store``, ``private``, ``no-cache`` or ``Vary: *``; its
  ``max-age`` caps the lifetime; the values of the headers it varies on join the key),
  unless the route sets ``ignore_backend_cache_control``;
* every key holds the query string, its parameters in name order;
* lookup: the exact tier, then SimHash (``semantic.method`` ``simhash`` or ``embedding``),
  then the embedding tier (``embedding_seam``); a hit answers with the stored answer in the
  shape asked for (SSE or JSON), ``X-Gateway-Cache: hit``, ``-Match``, ``-Similarity``,
  ``-Key`` (for ``feedback``), ``Age`` and the backend that produced it;
* a miss is passed on and, when it answers 200 uncompressed, stored under the key of the
  backend that answered: a whole body before the reply leaves this stage, a stream by
  ``replies.Tee`` once it has ended normally (so an entry is visible by the time its
  response has reached the client, and a cut stream is never stored);
* ``/v1/embeddings`` is cached per input item: only the missing items go upstream, in one
  call, and the answer is assembled in input order;
* the servers' own deterministic calls (KServe V2 ``infer``, TEI's ``/embed``, greedy
  generations, streamed or not) are cached as they came where ``cache.own_apis`` holds.

A store that is down, slow or flushed makes a miss, counted in
``gateway_cache_store_errors_total``; it never fails a request.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from gateway.cache import embedding, own_apis
from gateway.cache.control import asked_not_to
from gateway.cache.embedding_seam import (
    EMBEDDING,
    OPERATING_POINTS,
    EmbeddingContext,
    EmbeddingLookup,
    OperatingPoints,
    TierFactory,
    build_tier,
    figures_of,
)
from gateway.cache.entry import CachedResponse, select_headers
from gateway.cache.item_stage import ItemCache, RouteRules
from gateway.cache.items import ItemPlan, plan_items
from gateway.cache.keys import RequestKey, api_headers, cacheability, request_key, with_context
from gateway.cache.replies import (
    BYPASS,
    CACHE_HEADER,
    HIT,
    KEY_HEADER,
    MATCH_HEADER,
    MISS,
    NONE,
    SIMILARITY_HEADER,
    hit_body,
    hit_reply,
    keep,
    verbatim,
)
from gateway.cache.simhash import MAX_DISTANCE
from gateway.cache.state import CACHE_STATE, CacheState, feedback_limits, store_settings
from gateway.cache.tiers import Hit, ResponseCache
from gateway.cache.versions import UNKNOWN, Versions
from gateway.errors import StoreError
from gateway.metrics import EmbeddingFigures
from gateway.openai.sse import carries_usage
from gateway.openai.usage import asks_usage
from gateway.pipeline import Call, Handler, Reply, Stage
from gateway.policy.model import Policy, Route, RouteCache
from gateway.redis import shared_link
from gateway.state import Kind
from gateway.transport.headers import content_encoded

if TYPE_CHECKING:
    from gateway.runtime import Runtime

log = logging.getLogger("gateway.cache")
EMBEDDING_TIERS: Kind[EmbeddingLookup | None] = Kind("cache-embedding")
STORE_ERROR_LOG_EVERY_S = 10.0


def build(
    policy: Policy, runtime: Runtime, embedding_tiers: TierFactory | None = None
) -> list[Stage]:
    """The cache stage for ``policy``, or none when no route caches; ``embedding_tiers``
    builds the embedding routes' tiers (default: the shipped tier)."""
    metrics = runtime.metrics
    if not any(route.cache is not None for route in policy.routes):
        metrics.cache_entries.set_function(lambda: 0.0)
        metrics.cache_bytes.set_function(lambda: 0.0)
        metrics.embedding.tiers = tuple
        return []

    def moved(up: bool) -> None:
        metrics.cache_store_up.set(1 if up else 0)
        metrics.cache_store_transitions.labels("up" if up else "down").inc()
        if up:
            log.warning("cache store: up again")
        else:
            log.warning("cache store: down (requests are answered as misses until it is back)")

    link = None
    if policy.cache.store == "redis":
        link = shared_link(runtime.registry, policy.redis, runtime.clock, metrics)
    state = runtime.registry.get(
        CACHE_STATE,
        "",
        (store_settings(policy.cache), policy.redis if link is not None else None),
        lambda: CacheState(policy.cache, runtime.clock, on_health=moved, link=link),
    )
    feedback_limits(runtime.registry, policy.cache.feedback_per_min, runtime.clock)
    metrics.cache_store_up.set(1 if getattr(state.store, "available", True) else 0)
    metrics.cache_entries.set_function(lambda: float(state.stats().entries or 0))
    metrics.cache_bytes.set_function(lambda: float(state.stats().bytes or 0))
    stage = CacheStage(policy, runtime, state, embedding_tiers)
    metrics.embedding.tiers = stage.embedding_figures
    runtime.registry.get(OPERATING_POINTS, "", None, OperatingPoints)  # for GET /policy
    return [stage]


class CacheStage:
    """Answers cacheable calls from the cache and stores the answers to the others."""

    def __init__(
        self,
        policy: Policy,
        runtime: Runtime,
        state: CacheState,
        embedding_tiers: TierFactory | None = None,
    ) -> None:
        self._state = state
        self._embedding_tiers = embedding_tiers
        self._clock = runtime.clock
        self._metrics = runtime.metrics
        self._versions = Versions(policy.backends, runtime.transport)
        self._last_error_log = 0.0
        self._items = ItemCache(runtime.clock, self._versions)
        self._routes: dict[str, RouteRules] = {}
        for route in policy.routes:
            if route.cache is not None:
                self._routes[route.name] = self._rules(policy, runtime, route, route.cache)

    def embedding_figures(self) -> list[EmbeddingFigures]:
        """The figures of every route's shipped embedding tier, for the metrics."""
        return figures_of((name, rules.embedding) for name, rules in self._routes.items())

    def _rules(
        self, policy: Policy, runtime: Runtime, route: Route, rule: RouteCache
    ) -> RouteRules:
        semantic = rule.semantic
        max_distance = min(semantic.max_distance, MAX_DISTANCE)
        if semantic.max_distance > MAX_DISTANCE:
            log.warning(
                "route %s: cache.semantic.max_distance %d is beyond what the SimHash index "
                "finds; using %d",
                route.name,
                semantic.max_distance,
                MAX_DISTANCE,
            )
        cache = ResponseCache(
            self._state.store,
            max_distance=max_distance,
            on_store_error=self._store_failed,
            clock=runtime.clock,
        )
        tier = None
        if semantic.method == EMBEDDING:
            context = EmbeddingContext(
                route.name, self._state.store, policy, runtime.transport, runtime.clock
            )
            embedder = policy.backend(semantic.embedder) if semantic.embedder else None
            judge = policy.backend(route.backend) if semantic.judge.enabled else None
            tier = runtime.registry.get(
                EMBEDDING_TIERS,
                route.name,
                (semantic, policy.cache, embedder, judge),
                lambda: build_tier(semantic, context, self._embedding_tiers),
            )
        return RouteRules(route, rule, cache, tier, runtime, self._state.vary(route.name))

    async def __call__(self, call: Call, call_next: Handler) -> Reply:
        rules = self._routes.get(call.route.name)
        if rules is None:
            return await call_next(call)
        body = call.json
        if body is None and rules.own_apis and (keyed := await own_apis.keyed(call)):
            # a server's own call: keyed by its body's digest, sent on as it came
            call_next = own_apis.sending(call_next, call)
            call, body = keyed, keyed.json
        if (
            body is None
            or not cacheability(body, call.path, allow_sampled=rules.allow_sampled).ok
            or self._versions.get(call.backend, "", body) == UNKNOWN  # auto, none said
        ):
            return await self._pass(rules, call, call_next)
        no_cache, no_store = asked_not_to(call.header("cache-control"))
        scope = call.scope
        vary = rules.vary.key(call.received) + api_headers(call.path, call.headers)
        if call.path.endswith("/embeddings"):

            def plan_for(vary: str) -> ItemPlan | None:
                return plan_items(
                    body,
                    scope=scope,
                    route=call.route.name,
                    backend=call.backend,
                    model_version=self._versions.get(call.backend, "", body),
                    path=call.path,
                    query=call.query,
                    vary=vary,
                )

            plan = plan_for(vary)
            if plan is not None:
                return await self._items(
                    rules, call, call_next, plan, plan_for, scope, no_cache, no_store
                )
        key = self._key(call, scope, call.backend, vary, near=False)
        result = BYPASS
        if no_cache:
            rules.count(call, BYPASS, NONE)
            key = self._with_context(rules, call, key, vary)
        else:
            hit, key = await self._lookup(rules, call, key, vary)
            if hit is not None:
                reply = self._answer(rules, call, hit)
                if reply is not None:
                    return own_apis.answered(call.json, reply)
            rules.count(call, MISS, NONE)
            result = MISS
        reply = (await call_next(call)).with_headers(((CACHE_HEADER, result),))
        if no_store or reply.status != 200 or content_encoded(reply.headers):
            return reply
        rule = rules.storable(reply)
        if rule is None:
            return reply
        return await self._store(rules, call, scope, key, vary, reply, rules.ttl_for(rule))

    # -- whole answers ------------------------------------------------------------------------
    async def _pass(self, rules: RouteRules, call: Call, call_next: Handler) -> Reply:
        rules.count(call, BYPASS, NONE)
        reply = await call_next(call)
        return reply.with_headers(((CACHE_HEADER, BYPASS),))

    def _key(self, call: Call, scope: str, backend: str, vary: str, *, near: bool) -> RequestKey:
        assert call.json is not None
        return request_key(
            call.json,
            scope=scope,
            route=call.route.name,
            backend=backend,
            model_version=self._versions.get(backend, "", call.json),
            path=call.path,
            query=call.query,
            vary=vary,
            near=near,
        )

    def _with_context(
        self, rules: RouteRules, call: Call, key: RequestKey, vary: str
    ) -> RequestKey:
        """``key`` with its context, where the near tiers need one to look up or file under."""
        if not rules.near:
            return key
        assert call.json is not None
        return with_context(
            key,
            call.json,
            route=call.route.name,
            backend=call.backend,
            model_version=self._versions.get(call.backend, "", call.json),
            path=call.path,
            query=call.query,
            vary=vary,
        )

    async def _lookup(
        self, rules: RouteRules, call: Call, key: RequestKey, vary: str
    ) -> tuple[Hit | None, RequestKey]:
        """The hit for ``key`` and the key completed with its context.  The exact tier is
        tried first with the cheaper exact-only key; the context (the normalised prompt's
        signature and a second canonical form) is computed only when that misses."""
        started = time.perf_counter()
        hit = await rules.cache.lookup(key, near=False)
        if hit is None:
            key = self._with_context(rules, call, key, vary)
            if key.context is not None:
                hit = await rules.cache.lookup(key, exact=False)
                if hit is None and rules.embedding is not None and key.prompt is not None:
                    hit = await self._embedding_lookup(rules, rules.embedding, key, call)
        ended = time.perf_counter()
        rules.lookup_seconds.observe(ended - started)
        if call.record is not None:
            call.record.cache_lookup = (started, ended)
        return hit, key

    async def _embedding_lookup(
        self, rules: RouteRules, tier: EmbeddingLookup, key: RequestKey, call: Call
    ) -> Hit | None:
        assert key.prompt is not None and call.json is not None
        try:
            if isinstance(tier, embedding.EmbeddingTier):  # the judge names the asked model
                model = call.json.get("model")
                asked = model if isinstance(model, str) else None
                hit = await tier.lookup(key, key.prompt, model=asked)
            else:
                hit = await tier.lookup(key, key.prompt)
        except Exception:
            log.exception("route %s: embedding tier lookup failed (a miss)", rules.name)
            return None
        if hit is None:
            return None
        if hit.entry.scope != key.scope or hit.entry.context != key.context:
            log.error(
                "route %s: the embedding tier offered an entry of another tenant or context; "
                "refused",
                rules.name,
            )
            return None
        return hit

    def _answer(self, rules: RouteRules, call: Call, hit: Hit) -> Reply | None:
        """The reply for a hit, or None when the stored answer cannot take the shape asked
        for (then the call is a miss)."""
        assert call.json is not None
        include_usage = asks_usage(call.json)
        events = hit.entry.events
        if events is not None and (include_usage or not call.streaming):
            if not carries_usage(events):
                return None  # a stream stored without usage cannot give it: a miss
        try:
            as_sent = verbatim(call.path) or own_apis.is_keyed(call)
            body, content_type = hit_body(
                hit.entry, streaming=call.streaming, include_usage=include_usage, as_sent=as_sent
            )
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.warning("route %s: cached answer %s not replayable: %s", rules.name, hit.key, exc)
            return None
        rules.count(call, HIT, hit.match)
        headers = (
            (CACHE_HEADER, HIT),
            (MATCH_HEADER, hit.match),
            (SIMILARITY_HEADER, f"{hit.similarity:.3f}"),
            (KEY_HEADER, hit.key),
            ("Age", str(self._age(hit.entry.created_at))),
        )
        return hit_reply(hit.entry, body, content_type, headers)

    async def _store(
        self,
        rules: RouteRules,
        call: Call,
        scope: str,
        key: RequestKey,
        vary: str,
        reply: Reply,
        ttl_s: float,
    ) -> Reply:
        backend = reply.backend or call.backend
        learned = rules.vary.key(call.received) + api_headers(call.path, call.headers)
        if backend != call.backend or learned != vary:
            # A fallback answered (filed under its own key), or the answer named headers
            # it varies on that the lookup's key did not have yet.
            key = self._key(call, scope, backend, learned, near=key.context is not None)
        stored_headers = select_headers(reply.headers)

        version = self._versions.get(backend, "", call.json)
        if version == UNKNOWN:  # a fallback of model_version auto whose servers said nothing
            rules.not_stored("identity_unknown")
            return reply

        async def put(events: tuple[str, ...] | None, body: bytes | None) -> None:
            try:
                body = own_apis.stored(call, body, reply.headers) if body is not None else None
            except own_apis.NotStored as refused:  # a server's own: its stream cut, its id
                return rules.not_stored(refused.reason)
            entry = CachedResponse(
                200, stored_headers, body, events, self._clock.wall(), backend, version,
                call.route.name, scope,
            )  # fmt: skip
            await self._put(rules, key, entry, ttl_s)

        return await keep(reply, put, call.path, own_apis.is_keyed(call), rules.not_stored)

    async def _put(
        self, rules: RouteRules, key: RequestKey, entry: CachedResponse, ttl_s: float
    ) -> None:
        stored = await rules.cache.put(key, entry, ttl_s)
        if stored and rules.embedding is not None and key.prompt is not None:
            try:
                await rules.embedding.add(key, key.prompt, key.exact)
            except Exception:
                log.exception("route %s: embedding tier add failed", rules.name)

    # -- helpers -------------------------------------------------------------------------------
    def _age(self, created_at: float) -> int:
        return max(0, int(self._clock.wall() - created_at))

    def _store_failed(self, exc: StoreError) -> None:
        self._metrics.cache_store_errors.inc()
        now = time.monotonic()
        if now - self._last_error_log >= STORE_ERROR_LOG_EVERY_S:
            self._last_error_log = now
            log.warning("cache store failed, answering as a miss: %s", exc)

    def __repr__(self) -> str:
        return f"<CacheStage routes={sorted(self._routes)} {self._state!r}>"
