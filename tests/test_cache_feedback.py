"""``POST /cache/feedback`` (``gateway.cache.feedback``): a client judges a cached answer it
got, named by its ``X-Gateway-Cache-Key``; a wrong one is dropped, so neither its question
nor a paraphrase gets it again; only the entry's own tenant may judge it.  The official
``openai`` SDK as the client, a recording model server on a real socket."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import yaml

from tests.helpers import metric, problems_of, write_policy
from tests.test_stage_cache_embedding import CHAT, URL, StandInTier, fresh
from tests.test_stage_cache_embedding import POLICY as EMBEDDING_POLICY
from tests.test_stage_cache_embedding import ask as question
from tests.upstreams import Recorder

ALICE, BOB = "sk-alice", "sk-bob"
QUESTION = "How many GPUs does the cluster have in rack 12?"
PARAPHRASE = "how many gpus does the cluster have in rack 12"


def caching(url: str, **cache: Any) -> dict[str, Any]:
    """A policy whose route ``chat`` caches, SimHash near-duplicates too; ``cache``: the
    ``cache:`` block."""
    return {
        "backends": {"main": {"url": url}},
        "routes": [
            {
                "name": "chat",
                "match": {"path": "/v1/*"},
                "backend": "main",
                "cache": {"ttl_s": 60, "semantic": {"method": "simhash"}},
            }
        ],
        **({"cache": cache} if cache else {}),
    }


@pytest.fixture
async def cached(serve_app, start_gateway, tmp_path):
    upstream = Recorder()
    url = await serve_app(upstream.app())
    return upstream, await start_gateway(policy=write_policy(tmp_path, caching(url)))


async def ask(gw: Any, key: str, question: str) -> tuple[str, str | None]:
    """The answer's ``X-Gateway-Cache`` and ``X-Gateway-Cache-Key``."""
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0) as sdk:
        raw = await sdk.chat.completions.with_raw_response.create(
            model="m", messages=[{"role": "user", "content": question}], temperature=0
        )
    return raw.headers["x-gateway-cache"], raw.headers.get("x-gateway-cache-key")


async def judge(gw: Any, key: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(
            gw.url + "/cache/feedback", json=body, headers={"Authorization": f"Bearer {key}"}
        )


async def counted(gw: Any, verdict: str) -> float | None:
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    return metric(text, "gateway_cache_feedback_total", route="chat", verdict=verdict)


async def test_a_wrong_answer_is_dropped_for_its_question_and_every_paraphrase(cached):
    upstream, gw = cached
    assert await ask(gw, ALICE, QUESTION) == ("miss", None)
    result, entry = await ask(gw, ALICE, PARAPHRASE)
    assert result == "hit" and entry  # a SimHash near-duplicate names the entry it read
    assert await ask(gw, ALICE, QUESTION) == ("hit", entry)
    told = await judge(gw, ALICE, {"key": entry, "verdict": "wrong"})
    assert told.status_code == 200
    expected = {"key": entry, "verdict": "wrong", "route": "chat", "dropped": True}
    assert told.json() == {**expected, "counted": True}
    assert told.headers["x-request-id"]
    assert (await ask(gw, ALICE, PARAPHRASE))[0] == "miss"  # to the backend again
    assert len(upstream.seen) == 2
    again = await judge(gw, ALICE, {"key": entry, "verdict": "wrong"})
    assert again.status_code == 404  # gone
    assert await counted(gw, "wrong") == 1


async def test_a_right_answer_is_counted_and_kept(cached):
    _, gw = cached
    await ask(gw, ALICE, QUESTION)
    _, entry = await ask(gw, ALICE, QUESTION)
    told = await judge(gw, ALICE, {"key": entry, "verdict": "right"})
    assert told.status_code == 200 and told.json()["dropped"] is False
    assert await ask(gw, ALICE, QUESTION) == ("hit", entry)
    assert await counted(gw, "right") == 1


async def test_an_entry_counts_once_however_often_it_is_judged_right(cached):
    """A client repeating ``right`` cannot tilt its route's reported false-hit rate; a
    ``wrong`` after it still counts, and drops the entry."""
    _, gw = cached
    await ask(gw, ALICE, QUESTION)
    _, entry = await ask(gw, ALICE, QUESTION)
    told = [await judge(gw, ALICE, {"key": entry, "verdict": "right"}) for _ in range(5)]
    assert [t.json()["counted"] for t in told] == [True, False, False, False, False]
    assert await counted(gw, "right") == 1
    wrong = await judge(gw, ALICE, {"key": entry, "verdict": "wrong"})
    assert wrong.json()["counted"] is True and wrong.json()["dropped"] is True
    assert await counted(gw, "wrong") == 1
    await ask(gw, ALICE, QUESTION)  # stored afresh: a new answer, judged anew
    _, again = await ask(gw, ALICE, QUESTION)
    assert again == entry
    assert (await judge(gw, ALICE, {"key": again, "verdict": "right"})).json()["counted"]
    assert await counted(gw, "right") == 2


async def test_only_the_entrys_own_tenant_may_judge_it(cached):
    """Another tenant holding the key gets the 404 of a key that does not exist, and drops
    nothing; so does a client without a credential."""
    _, gw = cached
    await ask(gw, ALICE, QUESTION)
    _, entry = await ask(gw, ALICE, QUESTION)
    refused = await judge(gw, BOB, {"key": entry, "verdict": "wrong"})
    assert refused.status_code == 404
    assert refused.json()["error"]["code"] == "cache_entry_not_found"
    async with httpx.AsyncClient() as client:
        anonymous = await client.post(
            gw.url + "/cache/feedback", json={"key": entry, "verdict": "wrong"}
        )
    assert anonymous.status_code == 404
    assert await ask(gw, ALICE, QUESTION) == ("hit", entry)
    assert await ask(gw, BOB, QUESTION) == ("miss", None)  # and bob's own is his


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[1, 2]",
        b'{"key": "k"}',
        b'{"key": "k", "verdict": "meh"}',
        b'{"key": 7, "verdict": "wrong"}',
        b'{"key": "", "verdict": "wrong"}',
        b'{"key": "k", "verdict": "wrong", "also": 1}',
        b'{"key": "' + b"k" * 5000 + b'", "verdict": "wrong"}',
        b"\xff\xfe{}",
        b"[" * 4000,  # nested past what json reads: a RecursionError, once a 500
        b'{"key": ' + b'{"a": ' * 600 + b"1" + b"}" * 601,
    ],
)
async def test_a_body_that_is_not_one_feedback_is_a_400(cached, body):
    _, gw = cached
    async with httpx.AsyncClient() as client:
        answer = await client.post(gw.url + "/cache/feedback", content=body)
    assert answer.status_code == 400
    assert answer.json()["error"]["type"] == "invalid_request_error"


async def test_the_path_is_the_gateways_own(cached):
    upstream, gw = cached
    async with httpx.AsyncClient() as client:
        answer = await client.get(gw.url + "/cache/feedback")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert upstream.seen == []  # never the backend's


async def test_a_callers_verdicts_are_limited_per_minute(serve_app, start_gateway, tmp_path):
    """``cache.feedback_per_min``: past a minute's worth a caller gets a 429 with
    ``Retry-After``, as a rate limit's, counted; another tenant has its own.  A reload that
    changes the rate keeps the cache (its entries are not the feedback's)."""
    url = await serve_app(Recorder().app())
    path = write_policy(tmp_path, caching(url, feedback_per_min=3))
    gw = await start_gateway(policy=path)
    await ask(gw, ALICE, QUESTION)
    _, entry = await ask(gw, ALICE, QUESTION)
    told = [await judge(gw, ALICE, {"key": entry, "verdict": "right"}) for _ in range(3)]
    assert [t.status_code for t in told] == [200, 200, 200]
    over = await judge(gw, ALICE, {"key": entry, "verdict": "wrong"})
    assert over.status_code == 429 and int(over.headers["retry-after"]) >= 1
    error = over.json()["error"]
    assert error["type"] == "rate_limit_error" and "3 verdicts a minute" in error["message"]
    assert (await judge(gw, BOB, {"key": entry, "verdict": "wrong"})).status_code == 404
    async with httpx.AsyncClient() as client:
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert metric(text, "gateway_cache_feedback_limited_total") == 1
    write_policy(tmp_path, caching(url, feedback_per_min=100))
    assert gw.gateway.reload(force=True)
    assert await ask(gw, ALICE, QUESTION) == ("hit", entry)  # the cache kept
    assert (await judge(gw, ALICE, {"key": entry, "verdict": "wrong"})).status_code == 200


def test_the_feedback_rate_must_be_above_zero():
    text = yaml.safe_dump(caching("http://main.test", feedback_per_min=0))
    assert any("cache.feedback_per_min: must be greater than 0" in p for p in problems_of(text))


async def test_without_a_caching_route_there_is_nothing_to_judge(serve_app, start_gateway):
    gw = await start_gateway(upstream=await serve_app(Recorder().app()))
    async with httpx.AsyncClient() as client:
        answer = await client.post(
            gw.url + "/cache/feedback", json={"key": "k", "verdict": "wrong"}
        )
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


class Forgetful(StandInTier):
    """A stand-in embedding tier that also forgets, as the real one does."""

    def __init__(self, store: Any) -> None:
        super().__init__(store)
        self.forgotten: list[str] = []

    def forget(self, entry_key: str) -> bool:
        self.forgotten.append(entry_key)
        self.added = [(text, key) for text, key in self.added if key != entry_key]
        return True


async def test_a_wrong_embedding_hit_is_forgotten_by_its_routes_tier(pipeline):
    made: list[Forgetful] = []

    def tiers(semantic: Any, context: Any) -> Forgetful:
        made.append(Forgetful(context.store))
        return made[-1]

    gw = await pipeline(EMBEDDING_POLICY.format(url=URL), fresh, embedding_tiers=tiers)
    alice = {"Authorization": "Bearer a"}
    await gw.post(CHAT, question("What is the capital of France?"), headers=alice)
    para = await gw.post(CHAT, question("Which city is France's capital?"), headers=alice)
    assert para.headers["X-Gateway-Cache-Match"] == "embedding"
    entry = para.headers["X-Gateway-Cache-Key"]
    told = await gw.post("/cache/feedback", {"key": entry, "verdict": "wrong"}, headers=alice)
    assert told.status_code == 200 and made[0].forgotten == [entry]
    again = await gw.post(CHAT, question("Which city is France's capital?"), headers=alice)
    assert again.headers["X-Gateway-Cache"] == "miss"
