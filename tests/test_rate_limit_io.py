"""The prompt's and the answer's tokens limited apart (``rate_limit.input_tokens_per_min``,
``output_tokens_per_min``: Anthropic's ITPM and OTPM).  The answer's are what a GPU spends
its time on: a call pays its ``max_tokens`` up front (one without it) and the answer's
``completion_tokens`` settle it, in memory and in a real Redis; on Anthropic's Messages API
the standing is told in its ``input-tokens`` and ``output-tokens`` headers."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.pipeline import Reply
from gateway.policy import load_policy, parse_policy_text
from gateway.policy.model import RateLimit
from gateway.resilience.quota import OverRate
from gateway.resilience.rate_limit import RateLimiter
from gateway.resilience.rate_redis import RedisRates
from gateway.resilience.rate_shared import SharedRateLimiter, local_share
from gateway.testing import FakeClock, Sent, json_reply
from tests.helpers import policy, write_policy
from tests.test_rate_headers import ALICE, URL
from tests.test_rate_limit_day import rates  # noqa: F401 (the fixture)


def test_the_answers_tokens_run_out_apart_from_the_prompts():
    clock = FakeClock()
    limiter = RateLimiter(
        RateLimit(input_tokens_per_min=1000, output_tokens_per_min=100), clock=clock
    )
    standing = limiter.check("acme", tokens=580, output=80)  # a 500-token prompt, max 80
    assert standing.input_tokens is not None and standing.output_tokens is not None
    assert (standing.input_tokens.remaining, standing.output_tokens.remaining) == (500, 20)
    with pytest.raises(OverRate) as refused:
        limiter.check("acme", tokens=130, output=80)  # the prompt would fit; the answer not
    assert refused.value.retry_after_s == 36  # 60 more tokens at 100 a minute
    settled = limiter.charge("acme", tokens=-70, output=-70)  # it generated 10
    assert settled is not None and settled.output_tokens is not None
    assert settled.output_tokens.remaining == 90
    limiter.check("acme", tokens=130, output=80)


def test_scaling_and_the_local_share_take_the_prompts_and_the_answers_limits():
    limit = RateLimit(input_tokens_per_min=4000, output_tokens_per_min=800, replicas=4)
    share = local_share(limit)
    assert (share.input_tokens_per_min, share.output_tokens_per_min) == (1000, 200)


def test_either_alone_is_a_limit_and_must_be_positive():
    def route(limit: dict[str, Any]) -> str:
        return yaml.safe_dump(policy({"main": {"url": URL}}, {"rate_limit": limit}))

    parsed = parse_policy_text(route({"output_tokens_per_min": 5000}))
    assert parsed.routes[0].rate_limit == RateLimit(output_tokens_per_min=5000)
    with pytest.raises(PolicyError, match="input_tokens_per_min: must be greater than 0"):
        parse_policy_text(route({"input_tokens_per_min": 0}))


def generating(completion: int) -> Any:
    """A Messages API backend whose every answer generated ``completion`` tokens."""

    async def upstream(sent: Sent) -> Reply:
        usage = {"input_tokens": 3, "output_tokens": completion}
        answer = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
        return json_reply({**answer, "usage": usage})

    return upstream


def ask(max_tokens: int | None) -> dict[str, Any]:
    bound = {} if max_tokens is None else {"max_tokens": max_tokens}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bound}


async def test_an_anthropic_client_is_told_its_input_and_output_tokens(pipeline):
    route = {"rate_limit": {"input_tokens_per_min": 6000, "output_tokens_per_min": 100}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), generating(60), clock=FakeClock())
    answers = [await gw.post("/v1/messages", ask(60), headers=ALICE) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 429]
    first = {k.lower(): v for k, v in answers[0].headers.items() if "tokens" in k.lower()}
    assert first["anthropic-ratelimit-output-tokens-limit"] == "100"
    assert first["anthropic-ratelimit-output-tokens-remaining"] == "40"
    assert first["anthropic-ratelimit-input-tokens-limit"] == "6000"
    assert first["anthropic-ratelimit-output-tokens-reset"].startswith("2023-11-14T22:1")
    assert answers[1].headers["Retry-After"] == "12"  # 20 more at 100 a minute
    assert answers[1].headers["anthropic-ratelimit-output-tokens-remaining"] == "40"
    chat = await gw.post("/v1/chat/completions", ask(1), headers=ALICE)
    assert not [k for k in chat.headers if "output-tokens" in k.lower()]  # OpenAI has none


async def test_a_client_naming_no_bound_still_waits_out_its_output_debt(pipeline):
    """Without ``max_tokens`` a call pays one token up front; what it generated puts the
    tenant in debt, and its next call waits whatever bound it names."""
    route = {"rate_limit": {"output_tokens_per_min": 100}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), generating(400), clock=FakeClock())
    first = await gw.post("/v1/messages", ask(None), headers=ALICE)
    second = await gw.post("/v1/messages", ask(None), headers=ALICE)
    assert (first.status_code, second.status_code) == (200, 429)
    assert int(second.headers["Retry-After"]) >= 180  # 300 tokens of debt at 100 a minute


# -- in Redis ----------------------------------------------------------------------------


@pytest.mark.redis
async def test_the_answers_tokens_are_one_more_key_in_redis(rates: RedisRates):  # noqa: F811
    limit = RateLimit(input_tokens_per_min=1000, output_tokens_per_min=100, store="redis")
    limiter = SharedRateLimiter("chat", limit, rates)
    standing = await limiter.check("acme", tokens=580, output=80)
    assert standing.output_tokens is not None and 19 <= standing.output_tokens.remaining <= 21
    with pytest.raises(OverRate):
        await limiter.check("acme", tokens=130, output=80)
    settled = await limiter.charge("acme", tokens=-70, output=-70)
    assert settled is not None and settled.output_tokens is not None
    assert 89 <= settled.output_tokens.remaining <= 91
    await limiter.check("acme", tokens=130, output=80)
    assert limiter.decided == {"redis": 3, "local": 0}


def test_an_output_limit_on_a_route_passing_streams_as_asked_is_warned_of(tmp_path):
    route = {"rate_limit": {"output_tokens_per_min": 1000}}
    file = write_policy(tmp_path, policy({"main": {"url": URL}}, route))
    (warning,) = [f"{w.path}: {w.message}" for w in load_policy(file).warnings]
    assert warning.startswith("routes[0].stream_usage: is `pass`")
