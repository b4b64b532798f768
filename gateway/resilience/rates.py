"""The rate limits of one policy generation, as the resilience stage applies them: each
route's per-tenant ``rate_limit`` (with its addresses' new-credential budgets,
``credentials``), and each named tenant's own limit (``tenants.keys[].rate_limit``).

A call is admitted only when every limit it counts against can pay for it (429 with
``Retry-After`` past one); model tokens are estimated up front and settled against the
answer's ``usage``: a whole body's at once, a stream's once it has ended, from the usage
event it carries (asked by its client with ``stream_options.include_usage``, or for it by
the route's ``stream_usage: ask``; a stream without one is settled at a generated token per
event it streamed, its prompt at its estimate, and one that streamed nothing keeps its
estimate).  The servers' own APIs (llama.cpp's ``/completion``, Ollama's, TGI's, SGLang's)
are estimated at the bound their body names and settled on the counts their answers name in
their own words (``openai.native_usage``); a whole answer naming none is charged a
generated token per ``CHARS_PER_TOKEN`` bytes of it, at least its estimate.  Triton's
``infer`` is one of them for a call whose tensors name a bound (``triton_bounds``):
TensorRT-LLM's answers there name no count.  A spend budget
(``cost_per_day``, ``cost_per_month``) is charged the tokens at their backend's ``price``:
the estimate at the price of the backend asked, the answer's at the price of the one that
answered (a fallback may cost more or less).  Each limit
counts in this process (``rate_limit.py``) or, with ``store: redis``, across every replica
(``rate_shared.py``).  The caller's standing in the tightest of its limits is told in the
answer's ``x-ratelimit-*`` headers (``quota.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

from gateway.clock import Clock
from gateway.errors import RateLimited
from gateway.metrics import Metrics
from gateway.openai.native_usage import (
    NativeStreamUsage,
    count_of,
    from_native_body,
    native,
    native_bound,
)
from gateway.openai.triton_bounds import infer_bound
from gateway.openai.usage import StreamUsage, from_body
from gateway.pipeline import Call, Reply
from gateway.policy.generation import LISTED_CALLS, PROMPT_NEEDED, TRITON_INFER, prompts_of
from gateway.policy.model import Policy, RateLimit
from gateway.resilience.credentials import (
    TENANT_PREFIX,
    ProvenCredentials,
    RateKey,
    newcomer_limit,
    rate_key_of,
)
from gateway.resilience.quota import OverBudget, OverRate, Standing, tightest
from gateway.resilience.rate_limit import RateLimiter
from gateway.resilience.rate_shared import SharedRateLimiter, shared_limiter
from gateway.state import Kind, Registry
from gateway.wire import anthropic_path

RATE_LIMITERS: Kind[RateLimiter] = Kind("rate_limit")
PROVEN: Kind[ProvenCredentials] = Kind("proven_credentials")
CHARS_PER_TOKEN = 4
"""Rough prompt size for a tokens-per-minute limit before the answer's ``usage`` settles it."""
NEWCOMERS_SUFFIX = ":newcomers"

Limiter = RateLimiter | SharedRateLimiter


@dataclass(frozen=True, slots=True)
class Limit:
    """One limit: its tenants' buckets, and its addresses' new-credential buckets (none for
    a named tenant's own limit: a named tenant is never new)."""

    own: Limiter
    newcomers: Limiter | None = None

    @property
    def tokens(self) -> bool:
        return self.own.counts_tokens


@dataclass(slots=True)
class Admitted:
    """A call the limits admitted: who they counted, the tokens it was estimated at, and
    the caller's standing in each limit after it."""

    key: RateKey
    limits: tuple[Limit, ...]
    estimate: int
    standings: list[Standing]
    output_estimate: int = 0
    """Of ``estimate``, the tokens the answer was expected to generate (its ``max_tokens``)."""
    cost_estimate: float = 0.0
    """What ``estimate`` costs at the price of the backend asked (a spend budget's)."""
    policy: Policy | None = None
    """The call's policy: the answering backend's ``price`` (a spend budget's)."""
    backend: str = ""
    """The backend asked (the answer's, when it does not name its own)."""
    native: bool = False
    """A call to a server's own API (its answer's counts are in its own words)."""
    shared: bool = False
    """A call to a route several servers' APIs share (``PROMPT_NEEDED``: TGI's ``/``, TEI's
    too; SageMaker's ``/invocations``; ``LISTED_CALLS``: TGI's and TEI's ``/vertex``)."""

    @property
    def prompt_estimate(self) -> int:
        """Of ``estimate``, the prompt's tokens (its body's size)."""
        return self.estimate - self.output_estimate

    @property
    def standing(self) -> Standing:
        """The tightest standing of each kind."""
        return tightest(self.standings)


class RateLimits:
    """Every rate limit of a policy generation."""

    def __init__(
        self,
        routes: Mapping[str, Limit],
        tenants: Mapping[str, Limit],
        proven: ProvenCredentials,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self._routes = routes
        self._tenants = tenants
        self._proven = proven
        self._metrics = metrics
        self._clock = clock
        self._settling: set[asyncio.Task[None]] = set()  # streams' tokens being settled

    def __bool__(self) -> bool:
        return bool(self._routes or self._tenants)

    async def admit(self, call: Call) -> Admitted | None:
        """Count ``call`` against every limit it is under, or raise ``RateLimited``; None
        when it is under none."""
        limits = self._limits_of(call)
        if not limits:
            return None
        key = rate_key_of(call, self._proven)
        counted = any(lim.tokens for lim in limits)
        own = native(call.method, call.path)
        # at least one: an answer generates a token, and a tenant whose output is in debt
        # must wait even when it names no bound (its estimate would be none, asked of no one)
        output = 0
        if counted and own:
            output = await native_bound(call)
        elif counted and call.path.startswith("/v2/") and TRITON_INFER.fullmatch(call.path):
            output = await infer_bound(call)  # TensorRT-LLM's tensor: its answer names no count
            own = output > 0  # a model's call that generates nothing is counted as before
        elif counted:
            output = answer_bound(call)
        output = max(1, output) if counted else 0
        estimate = len(call.body) // CHARS_PER_TOKEN + output if counted else 0
        price = call.policy.price_of(call.backend) if counted else None
        cost = price.of(estimate - output, output) if price is not None else 0.0
        standings: list[Standing] = []
        try:
            for limit in limits:
                tokens, generated, paid = (estimate, output, cost) if limit.tokens else (0, 0, 0.0)
                if key.newcomer is not None and limit.newcomers is not None:
                    await _check(limit.newcomers, key.newcomer, tokens, generated, paid)
                standings.append(await _check(limit.own, key.key, tokens, generated, paid))
        except RateLimited as exc:
            self._metrics.rate_limited.labels(call.route.name).inc()
            if isinstance(exc, OverBudget):
                self._metrics.spend_refused.labels(call.route.name).inc()
            if isinstance(exc, OverRate) and anthropic_path(call.path):
                exc.extra_headers = tuple(self.told(call, exc.standing))
            raise
        return Admitted(
            key,
            limits,
            estimate,
            standings,
            output,
            cost,
            call.policy,
            call.backend,
            own,
            call.path in PROMPT_NEEDED or call.path in LISTED_CALLS,
        )

    def told(self, call: Call, standing: Standing) -> list[tuple[str, str]]:
        """``standing`` as the headers of ``call``'s API (Anthropic's or OpenAI's)."""
        if anthropic_path(call.path):  # its resets are times: the wall clock's
            return standing.headers(anthropic=True, wall=self._clock.wall())
        return standing.headers()

    async def settle(self, admitted: Admitted, served: Reply) -> Reply:
        """After the answer: a success proves a new credential, and the token limits'
        estimate is settled against the answer's ``usage`` (the standings with it): a whole
        body's now, a stream's when it is done (the reply returned watches it)."""
        key = admitted.key
        key.settle(served.status, self._proven)
        if not any(lim.tokens for lim in admitted.limits):
            return served
        if served.body is None:
            return self._settled_when_done(admitted, served)
        used = _native_counts(admitted, served.body) if admitted.native else from_body(served.body)
        if used is not None:
            await self._settle_tokens(admitted, used, served.backend)
        return served

    def _settled_when_done(self, admitted: Admitted, served: Reply) -> Reply:
        """``served``'s stream, watched for its usage, settled once it is done."""
        assert served.stream is not None
        usage = served.usage
        if usage is None:
            usage = NativeStreamUsage() if admitted.native else StreamUsage()
            served = served.replace(stream=_fed(served.stream, usage), usage=usage)

        def done() -> None:
            counts = usage.counts or streamed_counts(admitted, usage.events)
            if counts is not None and isinstance(usage, NativeStreamUsage):
                if not usage.prompt_named:  # TGI's: the prompt at its estimate
                    counts = (admitted.prompt_estimate, counts[1])
            if counts is not None:
                settled = self._settle_tokens(admitted, counts, served.backend)
                task = asyncio.ensure_future(settled)
                self._settling.add(task)
                task.add_done_callback(self._settling.discard)

        return served.when_done(done)

    async def _settle_tokens(self, admitted: Admitted, used: tuple[int, int], by: str) -> None:
        """Settle the estimate against ``used``, the answer's (prompt, completion) tokens,
        made by the backend ``by`` (its price, for a spend budget)."""
        key = admitted.key
        difference = sum(used) - admitted.estimate
        generated = used[1] - admitted.output_estimate
        policy = admitted.policy
        price = policy.price_of(by or admitted.backend) if policy is not None else None
        cost = (price.of(*used) if price is not None else 0.0) - admitted.cost_estimate
        for i, limit in enumerate(admitted.limits):
            if not limit.tokens:
                continue
            after = await _charge(limit.own, key.key, difference, generated, cost)
            if after is not None:  # its tokens' standing now; its requests' as admitted
                admitted.standings[i] = dataclasses.replace(
                    after, requests=admitted.standings[i].requests
                )
            if key.newcomer is not None and limit.newcomers is not None:
                await _charge(limit.newcomers, key.newcomer, difference, generated, cost)

    def _limits_of(self, call: Call) -> tuple[Limit, ...]:
        route = self._routes.get(call.route.name)
        tenant = self._tenants.get(call.tenant) if call.tenant else None
        return tuple(limit for limit in (route, tenant) if limit is not None)

    def __repr__(self) -> str:
        return (
            f"<RateLimits routes={sorted(self._routes)} tenants={sorted(self._tenants)} "
            f"{self._proven!r}>"
        )


def streamed_counts(admitted: Admitted, events: int) -> tuple[int, int] | None:
    """The (prompt, completion) tokens of a stream that carried no usage: its prompt's
    estimate, and a token per event it streamed (None when it streamed none)."""
    if events <= 0:
        return None
    return admitted.prompt_estimate, events


_GENERATED = b'"generated_text"'
"""What TGI's whole answer holds (its text); another answer naming no count on a shared
route keeps its estimate: TEI's and vLLM's vectors are not generated text."""


def _native_counts(admitted: Admitted, body: bytes) -> tuple[int, int]:
    """The (prompt, completion) tokens of a server's own whole answer: the counts it names,
    else its prompt's estimate and a generated token per ``CHARS_PER_TOKEN`` bytes of it
    (at least the estimate: TGI names none unless asked for its ``details``)."""
    prompt = admitted.prompt_estimate
    named = from_native_body(body, prompt)
    if named is not None:
        return named
    if admitted.shared and _GENERATED not in body:  # not TGI's text: TEI's vectors, say
        return prompt, admitted.output_estimate
    return prompt, max(admitted.output_estimate, len(body) // CHARS_PER_TOKEN)


def answer_bound(call: Call) -> int:
    """The most tokens a request's answer may generate, as its body bounds it (none: 0):
    its bound on one answer times the answers it asks for (``n``, a completion's
    ``best_of``, which decodes that many), times a completion's prompts (a list of them is
    answered one by one)."""
    data = call.json or {}
    answer = count_of(
        data.get("max_completion_tokens")
        or data.get("max_tokens")
        or data.get("max_output_tokens")  # the Responses API
    )
    each = max(1, count_of(data.get("n")), count_of(data.get("best_of")))
    prompts = prompts_of(call.path, data)
    return answer * each * prompts


def build_rate_limits(
    policy: Policy, registry: Registry, clock: Clock, metrics: Metrics
) -> RateLimits:
    """The limits of ``policy``, their buckets kept across reloads while unchanged."""
    shared: list[SharedRateLimiter] = []

    def limiter(name: str, limit: RateLimit, *, reported: bool = True) -> Limiter:
        if limit.store == "redis":
            made = shared_limiter(registry, name, limit, policy.redis, clock, metrics)
            if reported:
                shared.append(made)
            return made
        return registry.get(
            RATE_LIMITERS, name, limit, functools.partial(RateLimiter, limit, clock=clock)
        )

    def with_newcomers(name: str, limit: RateLimit) -> Limit:
        newcomers = limiter(name + NEWCOMERS_SUFFIX, newcomer_limit(limit), reported=False)
        return Limit(limiter(name, limit), newcomers)

    routes = {
        route.name: with_newcomers(route.name, route.rate_limit)
        for route in policy.routes
        if route.rate_limit is not None
    }
    tenants = {
        name: Limit(limiter(TENANT_PREFIX + name, limit))
        for name, limit in policy.tenants.limits().items()
    }
    metrics.rate_limits.routes = lambda: [s.figures() for s in shared]
    proven = registry.get(PROVEN, "", None, ProvenCredentials) if routes else ProvenCredentials(0)
    return RateLimits(routes, tenants, proven, metrics, clock)


async def _fed(stream: AsyncIterator[bytes], usage: StreamUsage) -> AsyncIterator[bytes]:
    """``stream`` as it is, each chunk fed to ``usage`` on its way."""
    async for chunk in stream:
        usage.feed(chunk)
        yield chunk


async def _check(limiter: Limiter, key: str, tokens: float, output: float, cost: float) -> Standing:
    if isinstance(limiter, SharedRateLimiter):
        return await limiter.check(key, tokens, output, cost)
    return limiter.check(key, tokens, output, cost)


async def _charge(
    limiter: Limiter, key: str, tokens: float, output: float, cost: float
) -> Standing | None:
    if isinstance(limiter, SharedRateLimiter):
        return await limiter.charge(key, tokens, output, cost)
    return limiter.charge(key, tokens, output, cost)
