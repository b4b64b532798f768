"""The caller's standing in its rate limits, told as OpenAI tells it: ``x-ratelimit-*``
headers on every answer a gateway limit applies to, a 429 included
(``gateway/resilience/quota.py``)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

from gateway.pipeline import Reply
from gateway.resilience.quota import Quota, Standing, duration, tightest
from gateway.testing import FakeClock, Sent, json_reply
from tests.backends import Model, post
from tests.helpers import policy

URL = "http://main.test"
ALICE = {"Authorization": "Bearer alice"}


def told(answer: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in answer.headers.items() if k.lower().startswith("x-ratelimit")}


@pytest.mark.parametrize(
    ("seconds", "written"),
    [
        (0.0, "0s"),
        (-1.0, "0s"),
        (0.0001, "1ms"),
        (0.25, "250ms"),
        (0.9999, "1000ms"),
        (1.0, "1s"),
        (1.2, "2s"),  # whole seconds, rounded up: every client's parser reads them
        (59.5, "1m0s"),
        (360.0, "6m0s"),
        (3725.0, "1h2m5s"),
    ],
)
def test_a_reset_is_written_as_openai_writes_it(seconds: float, written: str) -> None:
    assert duration(seconds) == written


def test_the_tightest_quota_of_each_kind_is_told() -> None:
    roomy = Standing(Quota(10, 9, 0.1), Quota(1000, 10, 59))
    tight = Standing(Quota(3, 0.5, 2.5), None)
    assert tightest([roomy, tight]) == Standing(Quota(3, 0.5, 2.5), Quota(1000, 10, 59))
    assert tightest([]).headers() == []
    assert Standing(Quota(5, -3.5, 8.5)).headers() == [
        ("x-ratelimit-limit-requests", "5"),
        ("x-ratelimit-remaining-requests", "0"),  # in debt: none left, never below zero
        ("x-ratelimit-reset-requests", "9s"),
    ]


async def test_each_answer_tells_the_requests_left_and_a_429_tells_none(pipeline):
    clock = FakeClock()
    route = {"rate_limit": {"requests_per_s": 1, "burst": 3}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), Model("main"), clock=clock)
    answers = [await post(gw, headers=ALICE) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [told(a) for a in answers] == [
        {
            "x-ratelimit-limit-requests": "3",
            "x-ratelimit-remaining-requests": str(left),
            "x-ratelimit-reset-requests": f"{3 - left}s",
        }
        for left in (2, 1, 0, 0)
    ]
    clock.advance(0.5)
    bob = told(await post(gw, headers={"Authorization": "Bearer bob"}))
    assert bob["x-ratelimit-remaining-requests"] == "2"  # bob's own bucket
    alice = told(await post(gw, headers=ALICE))  # half a request back: still a 429
    assert (alice["x-ratelimit-remaining-requests"], alice["x-ratelimit-reset-requests"]) == (
        "0",
        "3s",  # 2.5 s, in whole seconds
    )


async def test_tokens_are_told_after_the_answers_usage_settled_them(pipeline):
    clock = FakeClock()
    route = {"rate_limit": {"tokens_per_min": 300}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), Model("main"), clock=clock)
    answer = await post(gw, headers=ALICE, max_tokens=100)  # estimated ~120, used 14
    assert told(answer) == {
        "x-ratelimit-limit-tokens": "300",
        "x-ratelimit-remaining-tokens": "286",
        "x-ratelimit-reset-tokens": "3s",  # 14 tokens at 5 a second
    }


async def test_a_negative_answer_bound_is_no_credit_against_the_tokens_limit(pipeline):
    """A client's ``max_tokens: -1000000`` estimates the answer at none: it is neither a
    refund at admission nor a debt of a million tokens once the usage settles it."""
    clock = FakeClock()
    route = {"rate_limit": {"tokens_per_min": 300}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), Model("main"), clock=clock)
    answer = await post(gw, headers=ALICE, max_tokens=-1_000_000)
    assert answer.status_code == 200
    assert told(answer)["x-ratelimit-remaining-tokens"] == "286"  # settled on the 14 used


async def test_the_tighter_of_a_routes_and_a_tenants_own_limit_is_told(pipeline):
    key = "acme-secret-key"
    tenants = {
        "keys": [
            {
                "name": "acme",
                "sha256": hashlib.sha256(key.encode()).hexdigest(),
                "rate_limit": {"requests_per_s": 1, "burst": 2},
            }
        ]
    }
    route = {"rate_limit": {"requests_per_s": 10, "burst": 20}}
    limited = policy({"main": {"url": URL}}, route, tenants=tenants)
    gw = await pipeline(limited, Model("main"), clock=FakeClock())
    acme = {"Authorization": f"Bearer {key}"}
    assert told(await post(gw, headers=acme))["x-ratelimit-limit-requests"] == "2"
    assert told(await post(gw, headers=ALICE))["x-ratelimit-limit-requests"] == "20"


async def test_a_backends_own_rate_headers_pass_only_where_no_gateway_limit_applies(pipeline):
    """The backend's headers describe the gateway's key upstream, shared by every tenant."""

    async def upstream(sent: Sent) -> Reply:
        headers = (
            ("x-ratelimit-limit-requests", "10000"),
            ("x-ratelimit-remaining-requests", "9876"),
            ("X-RateLimit-Remaining-Tokens", "1999000"),
        )
        answer = {"id": "c", "object": "chat.completion", "choices": []}
        return json_reply(answer, 200, headers)

    limited = policy({"main": {"url": URL}}, {"rate_limit": {"requests_per_s": 5}})
    gw = await pipeline(limited, upstream, clock=FakeClock())
    assert told(await post(gw, headers=ALICE)) == {
        "x-ratelimit-limit-requests": "5",
        "x-ratelimit-remaining-requests": "4",
        "x-ratelimit-reset-requests": "200ms",
    }
    free = await pipeline(policy({"main": {"url": URL}}), upstream)
    assert told(await post(free, headers=ALICE)) == {
        "x-ratelimit-limit-requests": "10000",
        "x-ratelimit-remaining-requests": "9876",
        "x-ratelimit-remaining-tokens": "1999000",
    }


async def test_anthropics_messages_api_is_told_in_anthropics_headers(pipeline):
    """On ``/v1/messages`` the same standing in Anthropic's names, each reset an RFC 3339
    time (the FakeClock's wall starts at 2023-11-14T22:13:20Z); a 429 alike, and the
    backend's own ``anthropic-ratelimit-*`` headers are dropped."""

    async def upstream(sent: Sent) -> Reply:
        answer = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
        return json_reply(answer, 200, (("anthropic-ratelimit-requests-remaining", "4999"),))

    route = {"rate_limit": {"requests_per_s": 1, "burst": 2}}
    gw = await pipeline(policy({"main": {"url": URL}}, route), upstream, clock=FakeClock())
    message = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
    answers = [await gw.post("/v1/messages", message, headers=ALICE) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429]
    told = [
        {k.lower(): v for k, v in a.headers.items() if "ratelimit" in k.lower()} for a in answers
    ]
    assert told == [
        {
            "anthropic-ratelimit-requests-limit": "2",
            "anthropic-ratelimit-requests-remaining": str(left),
            "anthropic-ratelimit-requests-reset": f"2023-11-14T22:13:2{2 - left}Z",
        }
        for left in (1, 0, 0)
    ]
    assert answers[2].json()["type"] == "error"  # Anthropic's error shape, as before
