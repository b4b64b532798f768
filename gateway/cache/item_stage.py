"""A caching route's rules (``RouteRules``), and per-item caching of ``/v1/embeddings`` for the
cache stage.

Each input of an embeddings request is cached on its own (``cache.items``).  A request whose
inputs are all cached is answered here; otherwise one upstream call carries only the missing
inputs and the answer is assembled in input order, ``index`` 0..N-1, usage summed over every
item.  When the missing inputs' answer cannot be merged (another backend answered, it is
compressed, or it does not hold one embedding per input) the whole request goes upstream
instead, and nothing from it is stored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gateway.cache.control import STORE_ANY, LearnedVary, Storable, storable
from gateway.cache.embedding_seam import EmbeddingLookup
from gateway.cache.items import CachedItem, ItemPlan, assemble, fresh_items, missing
from gateway.cache.items import upstream_body as items_body
from gateway.cache.replies import (
    BYPASS,
    CACHE_HEADER,
    HIT,
    ITEMS_HEADER,
    JSON_TYPE,
    MATCH_HEADER,
    MISS,
    NONE,
    SIMILARITY_HEADER,
    Tee,
    read_whole,
)
from gateway.cache.tiers import EXACT, ResponseCache
from gateway.cache.versions import Versions
from gateway.clock import Clock
from gateway.pipeline import Call, Handler, Reply
from gateway.policy.model import Route, RouteCache
from gateway.runtime import Runtime
from gateway.transport.headers import content_encoded

log = logging.getLogger("gateway.cache")


class RouteRules:
    """One route's cache settings and per-route state for one policy generation."""

    def __init__(
        self,
        route: Route,
        rule: RouteCache,
        cache: ResponseCache,
        embedding: EmbeddingLookup | None,
        runtime: Runtime,
        vary: LearnedVary,
    ) -> None:
        self.name = route.name
        self.ttl_s = rule.ttl_s
        self.allow_sampled = rule.allow_sampled
        self.own_apis = rule.own_apis
        self.ignore_backend = rule.ignore_backend_cache_control
        self.near = rule.semantic.method != "off"
        self.cache = cache
        self.embedding = embedding
        self.vary = vary
        self._lookups = runtime.metrics.cache_lookups
        self._not_stored = runtime.metrics.cache_not_stored
        self._children: dict[tuple[str, str], Any] = {}
        self.lookup_seconds = runtime.metrics.cache_lookup_seconds.labels(route.name)

    def storable(self, reply: Reply) -> Storable | None:
        """What the backend's answer allows (``control.storable``; anything, where the
        route ignores it), the headers it varies on learned; None when it is not to be
        stored (counted by reason)."""
        if self.ignore_backend:
            return STORE_ANY
        rule = storable(reply.headers)
        if rule.ok and not self.vary.learn(rule.vary):
            rule = Storable(False, "vary_too_wide")
        if not rule.ok:
            self.not_stored(rule.reason)
            return None
        return rule

    def not_stored(self, reason: str) -> None:
        """Count an answer not stored, by ``reason`` (``gateway_cache_not_stored_total``)."""
        self._not_stored.labels(self.name, reason).inc()

    def ttl_for(self, rule: Storable) -> float:
        """The route's ``ttl_s``, capped by the answer's ``max-age``."""
        return self.ttl_s if rule.max_age_s is None else min(self.ttl_s, rule.max_age_s)

    def count(self, call: Call, result: str, match: str) -> None:
        """Count one lookup's result in the metrics, and tell it the access log (when the
        request is recorded: ``Call.record``)."""
        child = self._children.get((result, match))
        if child is None:
            child = self._children[(result, match)] = self._lookups.labels(self.name, result, match)
        child.inc()
        if call.record is not None:
            call.record.cache = result if match == NONE else f"{result}:{match}"


class ItemCache:
    """Answers embeddings requests item by item from the cache and the backend."""

    def __init__(self, clock: Clock, versions: Versions) -> None:
        self._clock = clock
        self._versions = versions

    async def __call__(
        self,
        rules: RouteRules,
        call: Call,
        call_next: Handler,
        plan: ItemPlan,
        plan_for: Callable[[str], ItemPlan | None],
        scope: str,
        no_cache: bool,
        no_store: bool,
    ) -> Reply:
        """Answer ``call`` item by item; ``plan_for(vary)`` plans it again under the headers
        its answer turned out to vary on (``control``)."""
        total = len(plan.keys)
        if no_cache:
            cached: list[CachedItem | None] = [None] * total
        else:
            started = time.perf_counter()
            cached = await rules.cache.get_items(plan)
            ended = time.perf_counter()
            rules.lookup_seconds.observe(ended - started)
            if call.record is not None:
                call.record.cache_lookup = (started, ended)
        positions = missing(cached)
        if not positions:
            rules.count(call, HIT, EXACT)
            return self._items_hit(call, cached)
        result = BYPASS if no_cache else MISS
        rules.count(call, result, NONE)
        headers = ((CACHE_HEADER, result), (ITEMS_HEADER, f"{total - len(positions)}/{total}"))
        store = not no_store
        if len(positions) == total:
            reply = (await call_next(call)).with_headers(headers)
            rule = rules.storable(reply) if store and self._mergeable(call, reply) else None
            stored = self._stored_plan(rules, call, plan_for, rule)
            if rule is not None and stored is not None:
                reply = await self._store_items_later(
                    rules, call, scope, stored, positions, reply, rules.ttl_for(rule)
                )
            return reply
        sub = items_body(call.json or {}, plan, positions)
        sub_call = dataclasses.replace(
            call,
            body=json.dumps(sub, separators=(",", ":")).encode(),
            json=sub,
            headers=tuple((k, v) for k, v in call.headers if k.lower() != "accept-encoding"),
        )
        reply = await call_next(sub_call)
        if reply.status != 200:
            return reply.with_headers(headers)
        merged = None
        if self._mergeable(call, reply):
            try:
                data = await read_whole(reply)
                fresh = fresh_items(json.loads(data), plan, positions)
                merged = assemble(call.json or {}, cached, fresh)
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                log.warning("route %s: embeddings answer not split per item: %s", rules.name, exc)
        if reply.close is not None:
            await reply.close()
        if merged is None:  # the missing items' answer cannot be merged: ask for all of them
            return (await call_next(call)).with_headers(headers)
        rule = rules.storable(reply) if store else None
        stored = self._stored_plan(rules, call, plan_for, rule)
        if rule is not None and stored is not None:
            await self._put_items(rules, call, scope, stored, fresh, rules.ttl_for(rule))
        answer = json.dumps(merged, separators=(",", ":")).encode()
        kept = tuple((k, v) for k, v in reply.headers if k.lower() != "content-type")
        out_headers = (*kept, ("Content-Type", JSON_TYPE), *headers)
        return Reply(200, out_headers, body=answer, backend=reply.backend or call.backend)

    @staticmethod
    def _stored_plan(
        rules: RouteRules,
        call: Call,
        plan_for: Callable[[str], ItemPlan | None],
        rule: Storable | None,
    ) -> ItemPlan | None:
        """The plan the answer's items are stored under: keyed by the headers it varies on
        as learned now (``rules.storable`` may just have learned more)."""
        if rule is None:
            return None
        return plan_for(rules.vary.key(call.received))

    def _items_hit(self, call: Call, cached: Sequence[CachedItem | None]) -> Reply:
        answer = assemble(call.json or {}, cached, {})
        oldest = min(item.created_at for item in cached if item is not None)
        headers = (
            ("Content-Type", JSON_TYPE),
            (CACHE_HEADER, HIT),
            (MATCH_HEADER, EXACT),
            (SIMILARITY_HEADER, "1.000"),
            ("Age", str(self._age(oldest))),
            (ITEMS_HEADER, f"{len(cached)}/{len(cached)}"),
        )
        body = json.dumps(answer, separators=(",", ":")).encode()
        return Reply(200, headers, body=body, backend=call.backend)

    def _mergeable(self, call: Call, reply: Reply) -> bool:
        """Whether items of ``reply`` may be stored and merged with cached ones: a 200,
        uncompressed, from the backend the items are keyed for."""
        return (
            reply.status == 200
            and not content_encoded(reply.headers)
            and (reply.backend or call.backend) == call.backend
        )

    async def _store_items_later(
        self,
        rules: RouteRules,
        call: Call,
        scope: str,
        plan: ItemPlan,
        positions: tuple[int, ...],
        reply: Reply,
        ttl_s: float,
    ) -> Reply:
        """Store every item of a whole upstream answer: now for a body, once streamed
        otherwise (the reply returned then tees its stream)."""

        async def put(_: tuple[str, ...] | None, body: bytes | None) -> None:
            try:
                fresh = fresh_items(json.loads(body or b""), plan, positions)
            except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                log.warning("route %s: embeddings answer not stored: %s", rules.name, exc)
                return
            await self._put_items(rules, call, scope, plan, fresh, ttl_s)

        if reply.body is not None:
            await put(None, reply.body)
        elif reply.stream is not None:
            tee = Tee(reply.stream, events=False, on_complete=put, refused=rules.not_stored)
            return reply.replace(stream=tee)
        return reply

    async def _put_items(
        self,
        rules: RouteRules,
        call: Call,
        scope: str,
        plan: ItemPlan,
        fresh: dict[int, CachedItem],
        ttl_s: float,
    ) -> None:
        await rules.cache.put_items(
            plan,
            fresh,
            ttl_s,
            scope=scope,
            backend=call.backend,
            model_version=self._versions.get(call.backend, "", call.json),
            route=call.route.name,
        )

    def _age(self, created_at: float) -> int:
        return max(0, int(self._clock.wall() - created_at))

    def __repr__(self) -> str:
        return f"<ItemCache {self._versions!r}>"
