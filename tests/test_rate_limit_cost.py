"""Spend budgets (``rate_limit.cost_per_day``, ``cost_per_month``): a bucket of the backends'
``price`` currency per tenant.  A call pays its estimate at the price of the backend asked
and the answer's ``usage`` settles it at the price of the one that answered; past it, a 429
``insufficient_quota`` (OpenAI's code for a spent quota).  In memory, through the gateway's
pipeline, and in a real Redis."""

from __future__ import annotations

import hashlib
from typing import Any

import httpx
import openai
import pytest
import yaml

from gateway.errors import PolicyError
from gateway.pipeline import Reply
from gateway.policy import load_policy, parse_policy_text
from gateway.policy.model import RateLimit
from gateway.resilience.quota import OverBudget, OverRate, money
from gateway.resilience.rate_limit import DAY_S, RateLimiter
from gateway.resilience.rate_redis import RedisRates
from gateway.resilience.rate_shared import SharedRateLimiter, local_share
from gateway.testing import FakeClock, Sent, json_reply
from tests.helpers import policy, write_policy
from tests.test_rate_headers import ALICE, URL
from tests.test_rate_limit_day import rates  # noqa: F401 (the fixture)
from tests.upstreams import Recorder

PRICE = {"input_per_million": 1000, "output_per_million": 2000}  # 0.001 and 0.002 a token


def test_a_budget_runs_out_and_refills_over_its_day():
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(cost_per_day=1.0), clock=clock)
    standing = limiter.check("acme", tokens=100, output=10, cost=0.6)
    assert standing.cost is not None and standing.cost.remaining == pytest.approx(0.4)
    with pytest.raises(OverBudget) as refused:
        limiter.check("acme", tokens=100, output=10, cost=0.6)
    assert refused.value.code == "insufficient_quota" and refused.value.status == 429
    assert "spend budget" in str(refused.value)
    assert refused.value.retry_after_s == pytest.approx(0.2 * DAY_S, abs=1)
    settled = limiter.charge("acme", tokens=0, cost=-0.5)  # it cost 0.1, not 0.6
    assert settled is not None and settled.cost is not None
    assert settled.cost.remaining == pytest.approx(0.9)
    limiter.check("acme", cost=0.6)
    clock.advance(DAY_S)  # a day on: full again
    assert limiter.check("acme", cost=1.0).cost is not None


def test_a_month_refills_a_thirtieth_a_day_and_a_rate_refusal_stays_a_rate_refusal():
    clock = FakeClock()
    limiter = RateLimiter(RateLimit(cost_per_month=30.0, requests_per_s=1, burst=1), clock=clock)
    limiter.check("acme", cost=30.0)
    clock.advance(DAY_S)
    with pytest.raises(OverBudget):
        limiter.check("acme", cost=1.5)  # a day gave back 1 of the month's 30
    limiter.check("acme", cost=1.0)
    with pytest.raises(OverRate) as refused:  # the budget has room; the rate has not
        limiter.check("acme", cost=0)
    assert not isinstance(refused.value, OverBudget)


def test_the_local_share_divides_a_budget_and_amounts_are_told_to_six_decimals():
    share = local_share(RateLimit(cost_per_day=10.0, cost_per_month=300.0, replicas=4))
    assert (share.cost_per_day, share.cost_per_month) == (2.5, 75.0)
    assert [money(x) for x in (5.0, 4.3723114, 0.0, 1e-9)] == ["5", "4.372311", "0", "0"]


def test_a_budget_must_be_positive_and_one_no_backend_prices_is_warned_of(tmp_path):
    def route(limit: dict[str, Any], backend: dict[str, Any]) -> dict[str, Any]:
        return policy({"main": {"url": URL, **backend}}, {"rate_limit": limit})

    parsed = parse_policy_text(yaml.safe_dump(route({"cost_per_month": 20}, {"price": PRICE})))
    assert parsed.routes[0].rate_limit == RateLimit(cost_per_month=20)
    with pytest.raises(PolicyError, match="cost_per_day: must be greater than 0"):
        parse_policy_text(yaml.safe_dump(route({"cost_per_day": 0}, {"price": PRICE})))
    file = write_policy(tmp_path, route({"cost_per_day": 5}, {}))
    warnings = [f"{w.path}: {w.message}" for w in load_policy(file).warnings]
    assert any(w.startswith("routes[0].rate_limit.cost_per_day: no backend") for w in warnings)
    # a stream the client does not ask its usage of would keep its estimate: said too
    assert any(w.startswith("routes[0].stream_usage: is `pass`") for w in warnings)


def test_a_priced_budget_without_a_default_bound_is_warned_of(tmp_path):
    """A call naming no ``max_tokens`` is held at one generated token until it settles:
    ``generation.default_max_tokens`` holds what it may cost before it runs."""

    def warned(route: dict[str, Any]) -> list[str]:
        backends = {"main": {"url": URL, "price": PRICE}}
        file = write_policy(
            tmp_path, policy(backends, {"rate_limit": {"cost_per_day": 5}, **route})
        )
        return [f"{w.path}: {w.message}" for w in load_policy(file).warnings]

    hint = "routes[0].rate_limit.cost_per_day: a call naming no `max_tokens` is held"
    assert any(w.startswith(hint) for w in warned({}))
    for bounds in ({"default_max_tokens": 256}, {"max_tokens": 1024}):
        assert not any(w.startswith(hint) for w in warned({"generation": bounds}))


def answering(completion: int) -> Any:
    """A backend whose every answer used 3 prompt tokens and generated ``completion``."""

    async def upstream(sent: Sent) -> Reply:
        message = {"role": "assistant", "content": "ok"}
        usage = {
            "prompt_tokens": 3,
            "completion_tokens": completion,
            "total_tokens": 3 + completion,
        }
        choice = {"index": 0, "message": message, "finish_reason": "stop"}
        return json_reply(
            {"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage}
        )

    return upstream


def ask(content: str, max_tokens: int = 10, **more: Any) -> dict[str, Any]:
    message = {"role": "user", "content": content}
    return {"model": "m", "messages": [message], "max_tokens": max_tokens, **more}


async def test_a_tenant_past_its_budget_gets_insufficient_quota_and_its_standing(pipeline):
    """Each call pays its estimate (its body's 18 tokens or so at 0.001, its 10 ``max_tokens``
    at 0.002: about 0.038) and is settled at what it cost: 3 x 0.001 + 10 x 0.002 = 0.023."""
    route = {"rate_limit": {"cost_per_day": 0.08}}
    doc = policy({"main": {"url": URL, "price": PRICE}}, route)
    gw = await pipeline(doc, answering(10), clock=FakeClock())
    first = await gw.post("/v1/chat/completions", ask("a"), headers=ALICE)
    assert first.status_code == 200
    assert first.headers["x-ratelimit-limit-cost"] == "0.08"
    assert float(first.headers["x-ratelimit-remaining-cost"]) == pytest.approx(0.057, abs=1e-6)
    second = await gw.post("/v1/chat/completions", ask("b"), headers=ALICE)
    assert second.status_code == 200
    assert float(second.headers["x-ratelimit-remaining-cost"]) == pytest.approx(0.034, abs=1e-6)
    third = await gw.post("/v1/chat/completions", ask("c"), headers=ALICE)  # 0.038 > 0.034
    assert third.status_code == 429
    error = third.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "insufficient_quota")
    assert int(third.headers["Retry-After"]) > 60  # a day's 0.08 refills 0.001 in 18 min
    assert "x-ratelimit-reset-cost" in third.headers
    other = await gw.post("/v1/chat/completions", ask("d"), headers={"Authorization": "Bearer b"})
    assert other.status_code == 200  # another tenant's budget is its own
    metrics = gw.gateway.metrics
    assert metrics.spend_refused.labels("chat")._value.get() == 1
    assert metrics.rate_limited.labels("chat")._value.get() == 1


async def test_a_cached_answer_costs_the_budget_nothing(pipeline):
    route = {"rate_limit": {"cost_per_day": 0.08}, "cache": {"ttl_s": 60}}
    doc = policy({"main": {"url": URL, "price": PRICE}}, route)
    gw = await pipeline(doc, answering(10), clock=FakeClock())
    asked = ask("same question", temperature=0)
    first = await gw.post("/v1/chat/completions", asked, headers=ALICE)
    hits = [await gw.post("/v1/chat/completions", asked, headers=ALICE) for _ in range(5)]
    assert first.status_code == 200
    assert [h.headers["X-Gateway-Cache"] for h in hits] == ["hit"] * 5
    fresh = await gw.post("/v1/chat/completions", ask("another"), headers=ALICE)
    assert fresh.status_code == 200  # two answers computed, 0.023 each; the hits cost none
    assert float(fresh.headers["x-ratelimit-remaining-cost"]) == pytest.approx(0.034, abs=1e-6)


# -- in Redis ----------------------------------------------------------------------------


@pytest.mark.redis
async def test_a_budget_is_one_more_key_in_redis(rates: RedisRates):  # noqa: F811
    limiter = SharedRateLimiter("chat", RateLimit(cost_per_day=1.0, store="redis"), rates)
    standing = await limiter.check("acme", tokens=100, output=10, cost=0.6)
    assert standing.cost is not None and 0.399 <= standing.cost.remaining <= 0.401
    with pytest.raises(OverBudget):
        await limiter.check("acme", cost=0.6)
    settled = await limiter.charge("acme", tokens=0, cost=-0.5)
    assert settled is not None and settled.cost is not None
    assert 0.899 <= settled.cost.remaining <= 0.901
    await limiter.check("acme", cost=0.6)
    assert limiter.decided == {"redis": 3, "local": 0}
    told = [await limiter.standing("acme") for _ in range(2)]  # reading takes nothing
    remaining = [t.cost.remaining for t in told if t is not None and t.cost is not None]
    assert len(remaining) == 2 and 0.299 <= remaining[0] <= remaining[1] <= 0.301


async def test_an_answer_is_charged_at_the_price_of_the_backend_that_gave_it(pipeline):
    """The primary (ten times the price) fails; its fallback answers and sets the charge."""

    async def failing(sent: Sent) -> Reply:
        return json_reply({"error": {"message": "down"}}, status=500)

    dear = {"input_per_million": 10_000, "output_per_million": 20_000}
    backends = {"main": {"url": URL, "price": dear}, "spare": {"url": URL, "price": PRICE}}
    doc = policy(backends, {"rate_limit": {"cost_per_day": 1.0}, "fallback": ["spare"]})
    gw = await pipeline(doc, {"main": failing, "spare": answering(10)}, clock=FakeClock())
    answered = await gw.post("/v1/chat/completions", ask("a"), headers=ALICE)
    assert answered.status_code == 200 and answered.headers["X-Gateway-Backend"] == "spare"
    left = float(answered.headers["x-ratelimit-remaining-cost"])
    assert left == pytest.approx(1.0 - 0.023, abs=1e-6)  # the spare's price, not the primary's


async def test_the_openai_sdk_sees_a_spent_budget_as_its_rate_limit_error(
    serve_app, start_gateway, tmp_path
):
    url = await serve_app(Recorder().app())
    route = {"rate_limit": {"cost_per_month": 0.05}}
    gw = await start_gateway(
        policy=write_policy(tmp_path, policy({"main": {"url": url, "price": PRICE}}, route))
    )
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="sk-team", max_retries=0)
    try:
        messages: Any = [{"role": "user", "content": "hi"}]
        raw = await client.chat.completions.with_raw_response.create(
            model="m", messages=messages, max_tokens=5
        )
        assert raw.headers["x-ratelimit-limit-cost"] == "0.05"
        with pytest.raises(openai.RateLimitError) as refused:
            for _ in range(20):
                await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    finally:
        await client.close()
    assert refused.value.code == "insufficient_quota"
    assert refused.value.response.headers["retry-after"]


async def test_the_admin_tells_each_named_tenants_standing_taking_nothing(
    serve_app, start_gateway, tmp_path
):
    """``GET /tenants``: each named tenant's own limit and each route's, bucket by bucket;
    one untouched is full, and reading takes nothing."""
    url = await serve_app(Recorder().app())
    acme, globex = "sk-acme", "sk-globex"
    doc = policy(
        {"main": {"url": url, "price": PRICE}},
        {"rate_limit": {"requests_per_s": 5, "burst": 10}},
        tenants={
            "keys": [
                {"name": "acme", "sha256": digest(acme), "rate_limit": {"cost_per_month": 2}},
                {"name": "globex", "sha256": digest(globex)},
            ]
        },
    )
    gw = await start_gateway(policy=write_policy(tmp_path, doc), clock=FakeClock())
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=acme, max_retries=0)
    try:
        messages: Any = [{"role": "user", "content": "hi"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    finally:
        await client.close()
    async with httpx.AsyncClient() as http:
        told = [(await http.get(gw.admin_url + "/tenants")).json() for _ in range(2)]
    assert told[0] == told[1]  # reading spends nothing
    by_name = {t["name"]: t for t in told[0]["tenants"]}
    cost = by_name["acme"]["own"]["cost"]
    assert cost["limit"] == 2 and 0 < 2 - cost["remaining"] < 0.1 and cost["reset_s"] > 0
    assert by_name["acme"]["routes"]["chat"]["requests"]["remaining"] == pytest.approx(9, abs=0.01)
    assert by_name["globex"]["own"] is None  # no limit of its own
    assert by_name["globex"]["routes"]["chat"]["requests"] == {
        "limit": 10,
        "remaining": 10,
        "reset_s": 0,
    }


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def test_without_any_rate_limit_the_admin_names_the_tenants_with_nothing_to_stand_in(
    serve_app, start_gateway, tmp_path
):
    url = await serve_app(Recorder().app())
    keys = [{"name": "acme", "sha256": digest("sk-acme")}]
    doc = policy({"main": {"url": url}}, {}, tenants={"keys": keys})
    gw = await start_gateway(policy=write_policy(tmp_path, doc))
    async with httpx.AsyncClient() as http:
        told = (await http.get(gw.admin_url + "/tenants")).json()
    assert told == {"tenants": [{"name": "acme", "own": None, "routes": {}}]}
