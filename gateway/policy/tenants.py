"""The policy's named tenants: API keys, by their sha256, each with a name and its limits.

Without ``tenants:`` a tenant is whatever credential a request carries (``tenant.py``).  With
it, a request whose key hashes to a listed ``sha256`` is that tenant: counted by its name in
every rate limit, and held to its own ``rate_limit`` over all routes.  With
``required: true`` only listed keys are served: any other request is a 401 at the edge,
before the cache (LiteLLM's virtual keys take the same stance).  A tenant's ``models`` holds
it to the models those globs match (``gateway/openai/allowed_models.py``); its
``max_priority`` caps the queue priority its requests get (``X-Priority`` is the client's
wish, ``resilience.stage.priority_of``); its ``max_concurrency`` caps its calls in flight
(``resilience/concurrency.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from gateway.policy.generation import Generation, tighter
from gateway.policy.metadata import doc
from gateway.policy.rate_limit import DEFAULT_RATE_LIMIT_REPLICAS, RateLimit

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TenantKey:
    """One API key of a named tenant (a tenant rotating keys lists each under its name)."""

    name: str = field(metadata=doc("The tenant's name: what its rate limits count."))
    sha256: str = field(
        metadata=doc(
            'The sha256 of the key, in hex (`printf %s "$KEY" | sha256sum`): the key as '
            "sent after `Bearer ` in `Authorization`, or the whole `api-key` / `x-api-key` "
            "value. From a Secret through `${ENV}`.",
            secret=True,
            env=True,
        )
    )
    rate_limit: RateLimit | None = field(
        default=None,
        metadata=doc(
            "The tenant's own limit over all routes (a route's `rate_limit` applies too). "
            "Give it on one of the tenant's keys, or the same on each."
        ),
    )
    models: tuple[str, ...] | None = field(
        default=None,
        metadata=doc(
            "Globs of the models the tenant may name (`gpt-4o*`, `llama-3.1-*`); none "
            "given: every model. Any other model is a 404 `model_not_found`, `GET "
            "/v1/models` (and Ollama's `/api/tags`) lists only these, Ollama's own API is "
            "held by its body's `model`, and a path whose model the gateway cannot read "
            "is a 403. Give it on one of the tenant's keys, or the same on each."
        ),
    )
    max_priority: Literal["high", "normal", "low"] = field(
        default="high",
        metadata=doc(
            "The highest queue priority the tenant's requests get, whatever the route's "
            "`priority` or their `X-Priority` header asks: a tenant capped at `normal` "
            "cannot jump other tenants' queues, shed their waiters from a full queue, or "
            "pass a `shed` throttle rule by sending `X-Priority: high`. Given on several "
            "of a tenant's keys, the lowest holds."
        ),
    )
    weight: int = field(
        default=1,
        metadata=doc(
            "The tenant's share of a backend's fair queue (`queue.fairness: tenant`): each "
            "turn it takes up to this many calls where a tenant of weight 1 takes one, and a "
            "full queue keeps its places in that proportion (weighted round robin). Only "
            "while it has calls waiting: a free slot goes to whoever asks. 1 to 100. Given "
            "on several of a tenant's keys, the lowest holds."
        ),
    )
    max_concurrency: int | None = field(
        default=None,
        metadata=doc(
            "The most of the tenant's requests in flight to backends at once, in each "
            "gateway process, or in all of them with `tenants.concurrency_store: redis` (a "
            "batched or coalesced call counts once; a stream until it ends); one more is a "
            "429 `concurrency_limit_exceeded` with `Retry-After`, before any rate limit or "
            "queue. A rate limit bounds how often a tenant starts "
            "calls, this how many it holds: long streams cannot take every slot of a "
            "backend. Counted in `gateway_tenant_in_flight{tenant}`. Given on several of a "
            "tenant's keys, the lowest holds; none: no cap."
        ),
    )
    generation: Generation | None = field(
        default=None,
        metadata=doc(
            "How much one of the tenant's calls may ask the model to generate, on every "
            "route (a route's `generation`: a free tier's shorter answers). Where a route "
            "bounds too, each bound is the lower of the two, and `refuse` wins. Given on "
            "several of a tenant's keys, the tightest holds."
        ),
    )


@dataclass(frozen=True, slots=True)
class Tenants:
    """Named tenants: who a request is, from the key it sends."""

    required: bool = field(
        default=False,
        metadata=doc(
            "Serve only requests whose key is listed: any other (an unknown key, or none) "
            "is answered 401 before anything else runs."
        ),
    )
    keys: tuple[TenantKey, ...] = field(default=(), metadata=doc("The tenants' keys."))
    max_priority: Literal["high", "normal", "low"] = field(
        default="high",
        metadata=doc(
            "The highest queue priority of a request offering no listed key, whatever the "
            "route's `priority` or its `X-Priority` header asks (`normal`: such a client "
            "cannot claim `high`, which jumps queues, sheds other waiters and passes `shed` "
            "throttle rules)."
        ),
    )
    max_concurrency: int | None = field(
        default=None,
        metadata=doc(
            "The most requests in flight to backends at once from one client offering no "
            "listed key, told apart by its address (behind `server.trusted_proxies`, the "
            "real client's), in each gateway process (or in all, as `concurrency_store` "
            "says), as nginx's `limit_conn` per address; "
            "one more is a 429 `concurrency_limit_exceeded` with `Retry-After`. Counted in "
            "`gateway_client_in_flight`. None: no cap."
        ),
    )
    concurrency_store: Literal["memory", "redis"] = field(
        default="memory",
        metadata=doc(
            "Where the `max_concurrency` caps count. `memory`: in each gateway process, so "
            "`--workers 4` in 3 replicas let a tenant capped at 2 hold 24 calls. `redis`: "
            "once for every process and replica, in the gateway's Redis (`redis:`), each "
            "call a place whose lease its process renews while it runs (a dead process's "
            "places lapse within 30 s); while Redis is down, each process holds a tenant to "
            "its cap divided by `concurrency_replicas` (at least 1)."
        ),
    )
    concurrency_replicas: int = field(
        default=DEFAULT_RATE_LIMIT_REPLICAS,
        metadata=doc(
            "`concurrency_store: redis`: the gateway processes expected to share the caps "
            "(replicas times `--workers`); while Redis is down each holds a tenant (or "
            "address) to its cap divided by this, at least 1."
        ),
    )
    response_id_secret: str = field(
        default="",
        metadata=doc(
            "Binds the Responses API's ids to the credentials that created them: each "
            "`resp_...` id a client sees carries a tag (an HMAC under this secret), and a "
            "request naming an id without its own tag (`GET /v1/responses/<id>`, "
            "`previous_response_id`) is refused before any backend; a tenant held to some "
            "`models` may then read its own. The id also names the endpoint that stored "
            "it, and a request naming it is sent there. The Conversations API's `conv_...` "
            "ids alike (`/v1/conversations/<id>` and below, a response's `conversation`), "
            "and stored chat completions, items, files, uploads, batches, vector stores and "
            "code containers (docs/models.md); a tenant held to some `models` may then keep "
            "its own conversations, files, uploads, vector stores and containers (never a "
            "batch: it runs the models its file names). At least 16 characters, "
            "the same in every replica; from a Secret through `${ENV}`. Empty: ids pass "
            "as the backend wrote them.",
            secret=True,
            env=True,
        ),
    )

    def by_digest(self) -> dict[str, str]:
        """Each listed key's sha256 (lower case) and its tenant's name."""
        return {key.sha256.strip().lower(): key.name for key in self.keys}

    def limits(self) -> dict[str, RateLimit]:
        """Each tenant's own rate limit, by name."""
        return {key.name: key.rate_limit for key in self.keys if key.rate_limit is not None}

    def max_priorities(self) -> dict[str, str]:
        """Each tenant capped below ``high``: its lowest ``max_priority`` over its keys."""
        order = ("low", "normal", "high")
        caps = _lowest(((k.name, k.max_priority) for k in self.keys), order.index)
        return {name: cap for name, cap in caps.items() if cap != "high"}

    def weights(self) -> dict[str, int]:
        """Each tenant weighted other than 1: its lowest ``weight`` over its keys."""
        weights = _lowest((k.name, k.weight) for k in self.keys)
        return {name: weight for name, weight in weights.items() if weight != 1}

    def max_concurrencies(self) -> dict[str, int]:
        """Each capped tenant's ``max_concurrency``: the lowest over its keys."""
        given = [(k.name, k.max_concurrency) for k in self.keys]
        return _lowest((name, cap) for name, cap in given if cap is not None)

    def generations(self) -> dict[str, Generation]:
        """Each bounded tenant's ``generation``: the tightest over its keys."""
        bounds: dict[str, Generation] = {}
        for key in self.keys:
            made = tighter(bounds.get(key.name), key.generation)
            if made is not None:
                bounds[key.name] = made
        return bounds

    def models(self) -> dict[str, tuple[str, ...]]:
        """The model globs of each tenant held to some, by name."""
        return {key.name: key.models for key in self.keys if key.models is not None}


def _same(value: Any) -> Any:
    return value


def _lowest(given: Iterable[tuple[str, T]], rank: Callable[[T], Any] = _same) -> dict[str, T]:
    """Each tenant's lowest value over its keys (``given``: a name and a value per key)."""
    lowest: dict[str, T] = {}
    for name, value in given:
        lowest[name] = min(lowest.get(name, value), value, key=rank)
    return lowest
