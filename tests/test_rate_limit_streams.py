"""A stream's tokens settle a tokens limit too (``rates.py``): once it has ended, from the
usage event it carries (asked by its client, or for it by the route's ``stream_usage:
ask``), so a tenant cannot stream past its ``tokens_per_min``; a stream without its usage
is settled at a token per event it streamed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gateway.policy import load_policy
from gateway.resilience.rate_limit import RateLimiter
from gateway.resilience.rates import RATE_LIMITERS
from gateway.tenant import credential_key
from gateway.testing import FakeClock
from gateway.testing.harness import Pipeline
from tests.backends import CHAT_PATH, STREAM_USAGE, Model, post
from tests.helpers import chat, policy, until, write_policy
from tests.test_rate_headers import ALICE, URL, told

LIMIT = 10_000
USED = STREAM_USAGE["total_tokens"]


def limited(**route: Any) -> dict[str, Any]:
    return policy({"main": {"url": URL}}, {"rate_limit": {"tokens_per_min": LIMIT}, **route})


def left(gw: Pipeline) -> float:
    """Alice's tokens left in the route's bucket, taking nothing."""
    limiter = gw.gateway.registry.peek(RATE_LIMITERS, "chat")
    key = credential_key(ALICE.items())
    assert isinstance(limiter, RateLimiter) and key is not None
    standing = limiter.standing(key)
    assert standing is not None and standing.tokens is not None
    return standing.tokens.remaining


def streamed(gw: Pipeline, **fields: Any) -> Any:
    body = chat("streamed", stream=True, max_tokens=500, **fields)
    return gw.send("POST", CHAT_PATH, json=body, headers=ALICE)


async def test_a_streams_usage_settles_its_estimate_once_it_has_ended(pipeline):
    gw = await pipeline(limited(), Model("main"), clock=FakeClock())
    stream = streamed(gw, stream_options={"include_usage": True})
    answer = await stream.done()
    assert b'"usage"' in answer.body
    estimated = LIMIT - int(told(answer)["x-ratelimit-remaining-tokens"])
    assert estimated > 500  # the prompt's rough tokens and max_tokens, told with the headers
    await until(lambda: left(gw) == LIMIT - USED)  # settled on the 16 the stream said it used


async def test_the_route_asking_for_usage_settles_a_stream_whose_client_did_not(pipeline):
    gw = await pipeline(limited(stream_usage="ask"), Model("main"), clock=FakeClock())
    answer = await streamed(gw).done()
    assert b'"usage"' not in answer.body  # asked for the gateway, kept from the client
    await until(lambda: left(gw) == LIMIT - USED)


async def test_a_stream_without_its_usage_is_settled_at_a_token_per_event(pipeline):
    """A model server streams a token an event: a stream that carried no usage (its client
    did not ask, or it was cut before it) is settled at its prompt's estimate and a token
    for each event it streamed, not at its ``max_tokens``."""
    main = Model("main")
    gw = await pipeline(limited(), main, clock=FakeClock())
    answer = await streamed(gw).done()
    estimated = LIMIT - int(told(answer)["x-ratelimit-remaining-tokens"])
    prompt = estimated - 500  # its max_tokens, paid up front
    await until(lambda: left(gw) == LIMIT - prompt - events(answer.body))
    assert events(answer.body) < 500
    before = left(gw)
    main.break_stream_after = 2  # cut before its usage
    cut = await streamed(gw, stream_options={"include_usage": True}).done()
    assert b'"usage"' not in cut.body and events(cut.body) >= 1
    prompt = int(before) - int(told(cut)["x-ratelimit-remaining-tokens"]) - 500  # a longer body
    await until(lambda: left(gw) == before - prompt - events(cut.body))
    answer = await post(gw, headers=ALICE)  # a whole body settles as before
    assert answer.status_code == 200


def events(body: bytes) -> int:
    """The ``data:`` events of a streamed body, but ``[DONE]``."""
    return body.count(b"data:") - body.count(b"data: [DONE]")


def test_a_tokens_limit_on_a_route_passing_streams_as_asked_is_warned_of(tmp_path: Path):
    def warned(route: dict[str, Any]) -> list[str]:
        file = write_policy(tmp_path, policy({"main": {"url": URL}}, route))
        return [f"{w.path}: {w.message}" for w in load_policy(file).warnings]

    (warning,) = warned({"rate_limit": {"tokens_per_day": 10**6}})
    assert warning.startswith("routes[0].stream_usage: is `pass`: a stream whose client does")
    assert warned({"rate_limit": {"tokens_per_min": LIMIT}, "stream_usage": "ask"}) == []
    assert warned({"rate_limit": {"requests_per_s": 5}}) == []


async def test_a_streams_usage_settles_the_answers_tokens_apart(pipeline):
    """``output_tokens_per_min``: the stream paid its ``max_tokens`` up front, and its
    ``completion_tokens`` settle that once it has ended."""
    route = {"rate_limit": {"output_tokens_per_min": LIMIT}, "stream_usage": "ask"}
    gw = await pipeline(policy({"main": {"url": URL}}, route), Model("main"), clock=FakeClock())
    await streamed(gw).done()
    limiter = gw.gateway.registry.peek(RATE_LIMITERS, "chat")
    key = credential_key(ALICE.items())
    assert isinstance(limiter, RateLimiter) and key is not None

    def output_left() -> float | None:
        standing = limiter.standing(key)
        quota = standing.output_tokens if standing is not None else None
        return quota.remaining if quota is not None else None

    await until(lambda: output_left() == LIMIT - STREAM_USAGE["completion_tokens"])
