"""The backend as judge: a grey-zone embedding miss is judged once by the route's own
backend, off the request path; a yes makes the paraphrase an alias of the cached answer
within the same tenant and context, until that entry expires; a no, a hard difference, an
error, a timeout, the rate budget and the queue bound each keep requests as they were.

The gateway listens on real sockets in front of an aiohttp backend that embeds (each new
text one axis of its own, so distinct texts are at cosine 0.9), answers chats with fresh
ids, and answers the judge's calls (told by its system prompt) as the test says.  Time is
the gateway's ``FakeClock``.  A paraphrase is asked with ``Cache-Control: no-store`` where
its own answer would otherwise be stored and answer its repeats from the exact tier.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from aiohttp import web

from gateway.cache.embedding import local
from gateway.cache.embedding.judge import MAX_TOKENS, PAUSE_AFTER_ERROR_S, SYSTEM_PROMPT, parse
from gateway.cache.evaluate import read_pairs
from gateway.cache.stage import EMBEDDING_TIERS
from gateway.policy.load import parse_policy_text
from gateway.policy.model import Judge
from gateway.testing import FakeClock
from tests.helpers import metric, problems_of, until, write_policy

CHAT = "/v1/chat/completions"
ASKED = "How can I learn Python quickly?"
PARAPHRASE = "What is the fastest way to learn Python?"
OTHERS = (
    "Which is the best way to learn Python fast?",
    "How do I become good at Python in a short time?",
    "Best way to pick up Python fast?",
    "How could I learn Python in little time?",
)
"""Paraphrases of ``ASKED`` the learned verifier scores in the grey zone at cosine 0.9."""
NO_STORE = {"Cache-Control": "no-store"}
ALICE = {"Authorization": "Bearer alice"}
BOB = {"Authorization": "Bearer bob"}
DIMS = 64
PAIRS = Path(__file__).resolve().parents[1] / "gateway" / "data" / "question_pairs.tsv"


class Backend:
    """Embeds, answers chats with fresh ids, and answers the judge with ``verdict``
    ("YES", "NO", "fail" for a 500, or "hang" until ``release`` is set)."""

    def __init__(self) -> None:
        self.verdict = "YES"
        self.judged: list[dict[str, Any]] = []
        self.answers = 0
        self.release = asyncio.Event()
        self._axes: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_post(CHAT, self.chat)
        return app

    def vector(self, text: str) -> list[float]:
        axis = self._axes.setdefault(text, 1 + len(self._axes) % (DIMS - 1))
        out = [0.0] * DIMS
        out[0], out[axis] = math.sqrt(0.9), math.sqrt(0.1)
        return out

    async def embeddings(self, request: web.Request) -> web.Response:
        texts = (await request.json())["input"]
        data = [{"index": i, "embedding": self.vector(t)} for i, t in enumerate(texts)]
        return web.json_response({"object": "list", "data": data})

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        if body["messages"][0]["content"] == SYSTEM_PROMPT:
            self.judged.append(body)
            if self.verdict == "fail":
                return web.json_response({"error": {"message": "down"}}, status=500)
            if self.verdict == "hang":
                await self.release.wait()
                return web.json_response(answer("judge", "YES"))
            return web.json_response(answer("judge", self.verdict))
        self.answers += 1
        return web.json_response(answer(f"chatcmpl-{self.answers}", "an answer"))


def answer(id_: str, content: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": content}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return {"id": id_, "object": "chat.completion", "choices": [choice]}


def ask(text: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


def routes(url: str, judge: dict[str, Any] | None) -> dict[str, Any]:
    semantic: dict[str, Any] = {"method": "embedding", "embedder": "gpu", "min_score": 0.95}
    if judge is not None:
        semantic["judge"] = judge
    route = {"name": "chat", "backend": "gpu", "cache": {"ttl_s": 60, "semantic": semantic}}
    return {"backends": {"gpu": {"url": url}}, "routes": [route]}


class Judged:
    """A gateway with a judging route in front of a ``Backend``."""

    def __init__(self, running: Any, backend: Backend, clock: FakeClock) -> None:
        self.running = running
        self.backend = backend
        self.clock = clock
        self.client = httpx.AsyncClient(base_url=running.url)

    @property
    def tier(self) -> Any:
        return self.running.gateway.registry.peek(EMBEDDING_TIERS, "chat")

    async def post(self, text: str, *headers: dict[str, str]) -> httpx.Response:
        merged = {k: v for h in headers for k, v in h.items()}
        reply = await self.client.post(CHAT, json=ask(text), headers=merged or ALICE)
        assert reply.status_code == 200
        return reply

    async def settled(self) -> None:
        """Until every pair handed to the judge has its verdict."""
        await until(lambda: self.tier.judge.pending == 0)

    async def metrics(self) -> str:
        async with httpx.AsyncClient() as admin:
            return (await admin.get(self.running.admin_url + "/metrics")).text


@pytest.fixture
async def judged(serve_app, start_gateway, tmp_path):
    made: list[Judged] = []

    async def start(judge: dict[str, Any] | None = None, *, off: bool = False) -> Judged:
        backend = Backend()
        url = await serve_app(backend.app())
        clock = FakeClock()
        settings = None if off else {"enabled": True, "min_score": 0.5, **(judge or {})}
        path = write_policy(tmp_path, routes(url, settings))
        made.append(Judged(await start_gateway(policy=path, clock=clock), backend, clock))
        return made[-1]

    yield start
    for gw in made:
        await gw.client.aclose()


async def test_a_grey_zone_miss_is_judged_once_and_a_yes_makes_the_paraphrase_hit(judged):
    gw = await judged()
    stored = await gw.post(ASKED)
    first = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert first.headers["X-Gateway-Cache"] == "miss"  # the judge is off the request path
    assert first.json()["id"] != stored.json()["id"]
    await gw.settled()
    (call,) = gw.backend.judged
    assert call["model"] == "m" and call["temperature"] == 0
    assert call["max_tokens"] == MAX_TOKENS and call["stream"] is False
    assert ASKED in call["messages"][1]["content"] and PARAPHRASE in call["messages"][1]["content"]
    again = await gw.post(PARAPHRASE)
    assert again.headers["X-Gateway-Cache"] == "hit"
    assert again.headers["X-Gateway-Cache-Match"] == "judged"
    assert again.json()["id"] == stored.json()["id"]
    assert len(gw.backend.judged) == 1 and gw.backend.answers == 2
    text = await gw.metrics()
    assert metric(text, "gateway_cache_judge_total", route="chat", verdict="yes") == 1
    assert metric(text, "gateway_cache_judge_total", route="chat", verdict="no") == 0
    assert metric(text, "gateway_cache_judge_aliases", route="chat") == 1
    refused = metric(text, "gateway_cache_embedding_refused_total", route="chat", reason="score")
    assert refused == 1  # the paraphrase's first lookup: under the score, so judged
    hits = metric(text, "gateway_cache_lookups_total", route="chat", result="hit", match="judged")
    assert hits == 1
    assert "aliases=1/" in repr(gw.tier.judge) and "yes=1" in repr(gw.tier.judge)


async def test_after_a_no_the_paraphrase_keeps_missing_and_is_not_asked_again(judged):
    gw = await judged()
    gw.backend.verdict = "NO"
    await gw.post(ASKED)
    await gw.post(PARAPHRASE, ALICE, NO_STORE)
    await gw.settled()
    for _ in range(3):
        again = await gw.post(PARAPHRASE, ALICE, NO_STORE)
        assert again.headers["X-Gateway-Cache"] == "miss"
    await gw.settled()
    assert len(gw.backend.judged) == 1 and gw.tier.judge.counts["no"] == 1
    assert len(gw.tier.judge) == 0


async def test_the_rate_budget_bounds_the_judge_calls(judged):
    gw = await judged({"rate_per_s": 0.5, "burst": 2})
    await gw.post(ASKED)
    for text in OTHERS:
        await gw.post(text, ALICE, NO_STORE)
    await gw.settled()
    assert len(gw.backend.judged) == 2
    assert gw.tier.judge.counts["rate_limited"] == 2
    gw.clock.advance(2.0)  # one more token
    await gw.post(OTHERS[2], ALICE, NO_STORE)
    await gw.post(OTHERS[3], ALICE, NO_STORE)
    await gw.settled()
    assert len(gw.backend.judged) == 3
    assert gw.tier.judge.counts["rate_limited"] == 3
    text = await gw.metrics()
    assert metric(text, "gateway_cache_judge_total", route="chat", verdict="rate_limited") == 3


async def test_max_pending_bounds_the_queue_and_a_pair_past_it_is_dropped(judged):
    gw = await judged({"max_pending": 1, "burst": 10})
    gw.backend.verdict = "hang"
    await gw.post(ASKED)
    await gw.post(OTHERS[0], ALICE, NO_STORE)
    await until(lambda: len(gw.backend.judged) == 1)  # being judged: out of the queue
    await gw.post(OTHERS[1], ALICE, NO_STORE)  # waits
    dropped = await gw.post(OTHERS[2], ALICE, NO_STORE)
    assert dropped.headers["X-Gateway-Cache"] == "miss"
    assert gw.tier.judge.counts["dropped"] == 1
    gw.backend.release.set()
    await gw.settled()
    assert len(gw.backend.judged) == 2 and gw.tier.judge.counts["yes"] == 2


@pytest.mark.parametrize(
    ("cached", "asked"),
    [
        ("Is 7 a prime number?", "Is 9 a prime number?"),  # numbers: another context
        ("How do I reset my password?", "How do I reset your password?"),  # pronoun
        (ASKED, "How can I quickly learn Python?"),  # the same words in another order
        ("Why is my code slow?", "Why is my code not slow?"),  # a negation
    ],
)
async def test_a_pair_with_a_hard_difference_is_never_judged(judged, cached, asked):
    gw = await judged({"min_score": 0.0})
    await gw.post(cached)
    reply = await gw.post(asked, ALICE, NO_STORE)
    assert reply.headers["X-Gateway-Cache"] == "miss"
    assert gw.backend.judged == [] and gw.tier.judge.pending == 0


@pytest.mark.parametrize(
    ("alice", "bob"),
    [
        (ALICE, BOB),
        ({"X-Api-Key": "alice"}, {"X-Api-Key": "bob"}),
        ({"api-key": "alice"}, {"api-key": "bob"}),
    ],
    ids=["authorization", "x-api-key", "api-key"],
)
async def test_another_tenant_never_gets_the_alias(judged, alice, bob):
    gw = await judged()
    stored = await gw.post(ASKED, alice)
    await gw.post(PARAPHRASE, alice, NO_STORE)
    await gw.settled()
    assert (await gw.post(PARAPHRASE, alice)).headers["X-Gateway-Cache-Match"] == "judged"
    bobs = await gw.post(PARAPHRASE, bob, NO_STORE)
    assert bobs.headers["X-Gateway-Cache"] == "miss" and bobs.json()["id"] != stored.json()["id"]
    gw.backend.verdict = "NO"
    own = await gw.post(ASKED, bob)  # Bob's own answer: his pair is his own to judge
    await gw.post(PARAPHRASE, bob, NO_STORE)
    await gw.settled()
    assert len(gw.backend.judged) == 2
    later = await gw.post(PARAPHRASE, bob, NO_STORE)
    assert later.headers["X-Gateway-Cache"] == "miss"
    assert later.json()["id"] not in (stored.json()["id"], own.json()["id"])


@pytest.mark.parametrize("failure", ["fail", "hang"])
async def test_judge_errors_and_timeouts_leave_requests_untouched(judged, failure):
    gw = await judged({"timeout_ms": 50})
    gw.backend.verdict = failure
    stored = await gw.post(ASKED)
    reply = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert reply.headers["X-Gateway-Cache"] == "miss"
    assert reply.json()["id"] not in ("judge", stored.json()["id"])
    await until(lambda: gw.tier.judge.counts["error"] == 1)
    await gw.settled()
    paused = await gw.post(PARAPHRASE, ALICE, NO_STORE)  # a failing judge rests a while
    assert paused.headers["X-Gateway-Cache"] == "miss" and gw.tier.judge.counts["paused"] == 1
    assert len(gw.backend.judged) == 1
    gw.clock.advance(PAUSE_AFTER_ERROR_S)
    again = await gw.post(PARAPHRASE, ALICE, NO_STORE)  # an error is no verdict: asked again
    assert again.headers["X-Gateway-Cache"] == "miss"
    await until(lambda: gw.tier.judge.counts["error"] == 2)
    assert len(gw.backend.judged) == 2 and len(gw.tier.judge) == 0
    assert (await gw.post(ASKED)).json()["id"] == stored.json()["id"]  # the cache as it was
    gw.backend.release.set()


async def test_with_the_judge_off_no_extra_call_is_made(judged):
    gw = await judged(off=True)  # no judge key: the default
    assert gw.tier.judge is None
    await gw.post(ASKED)
    for text in (PARAPHRASE, *OTHERS):
        assert (await gw.post(text, ALICE, NO_STORE)).headers["X-Gateway-Cache"] == "miss"
    assert gw.backend.judged == [] and gw.backend.answers == 1 + 1 + len(OTHERS)
    text = await gw.metrics()
    assert metric(text, "gateway_cache_judge_total", route="chat", verdict="yes") is None


async def test_an_expired_entry_is_not_served_through_its_alias(judged):
    gw = await judged()
    stored = await gw.post(ASKED)
    await gw.post(PARAPHRASE, ALICE, NO_STORE)
    await gw.settled()
    assert (await gw.post(PARAPHRASE, ALICE, NO_STORE)).json()["id"] == stored.json()["id"]
    gw.clock.advance(61.0)  # past ttl_s
    after = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert after.headers["X-Gateway-Cache"] == "miss"
    assert after.json()["id"] != stored.json()["id"]
    assert len(gw.tier.judge) == 0 and gw.tier.results["alias_stale"] == 1
    assert len(gw.backend.judged) == 1  # nothing left to judge it against


async def test_a_known_yes_aliases_the_answer_stored_again_without_asking(judged):
    gw = await judged()
    await gw.post(ASKED)
    await gw.post(PARAPHRASE, ALICE, NO_STORE)
    await gw.settled()
    gw.clock.advance(61.0)
    fresh = await gw.post(ASKED)  # the entry expired; a new answer is stored
    assert fresh.headers["X-Gateway-Cache"] == "miss"
    assert (await gw.post(PARAPHRASE, ALICE, NO_STORE)).headers["X-Gateway-Cache"] == "miss"
    again = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert again.headers["X-Gateway-Cache-Match"] == "judged"
    assert again.json()["id"] == fresh.json()["id"]
    assert len(gw.backend.judged) == 1


async def test_get_policy_shows_the_judge_in_force(judged):
    gw = await judged({"rate_per_s": 2})
    async with httpx.AsyncClient() as admin:
        shown = (await admin.get(gw.running.admin_url + "/policy")).json()
    judge = shown["cache_operating_points"]["chat"]["judge"]
    assert judge["enabled"] is True and judge["grey_zone"] == [0.5, 0.95]
    assert judge["rate_per_s"] == 2 and judge["model"] == "the request's"
    assert shown["policy"]["routes"][0]["cache"]["semantic"]["judge"]["enabled"] is True


@pytest.mark.parametrize(
    ("answer_", "same"),
    [
        ("YES", True),
        ("Yes.", True),
        ("  **yes**\n", True),
        ("<think>hmm, both ask about Python</think>YES", True),
        ("NO", False),
        ("Yes, but not quite", False),
        ("yes and no", False),
        ("Answer: YES", False),
        ("<think>they might be", False),
        ("", False),
        ("Y", False),
    ],
)
def test_only_a_clear_yes_is_a_yes(answer_, same):
    assert parse(answer_) is same


@pytest.mark.parametrize(
    ("judge", "semantic", "message"),
    [
        ({"rate_per_s": 0}, {}, "judge.rate_per_s: must be greater than 0"),
        ({"burst": 0, "max_pending": 0}, {}, "judge.max_pending: must be at least 1"),
        ({"min_score": 1.5}, {}, "judge.min_score: must be in [0, 1]"),
        ({"min_score": 0.9}, {"min_score": 0.8}, "must be below cache.semantic.min_score"),
        ({}, {"verifier": "rules"}, "judge.enabled: the judge needs `verifier: learned`"),
        ({}, {"embedder": "gpu"}, "runs with an `embedder` only when"),
        ({}, {"method": "simhash"}, "the judge needs `method: embedding`"),
        ({"timeout_ms": 0}, {}, "judge.timeout_ms: must be greater than 0"),
    ],
)
def test_the_judge_settings_are_checked_with_their_key_paths(judge, semantic, message):
    data = routes("http://127.0.0.1:9", {"enabled": True, **judge})
    cached = data["routes"][0]["cache"]["semantic"]
    cached.update(semantic)
    if "embedder" in semantic or "method" in semantic:
        cached.pop("min_score", None)
    found = problems_of(json.dumps(data))
    assert any("routes[0].cache.semantic." in p and message in p for p in found), found


def test_the_judge_is_off_by_default_and_its_settings_are_checked_only_when_on():
    policy = parse_policy_text(json.dumps(routes("http://127.0.0.1:9", None)), "p.yaml")
    judge = policy.routes[0].cache.semantic.judge  # type: ignore[union-attr]
    assert judge == Judge() and judge.enabled is False
    off = routes("http://127.0.0.1:9", {"enabled": False, "rate_per_s": 0})
    assert parse_policy_text(json.dumps(off), "p.yaml").routes[0].cache is not None


@pytest.mark.skipif(not local.available()[0], reason="local embedding model unavailable")
async def test_cache_eval_judge_asks_a_served_model_about_the_grey_zone(serve_app):
    """`gateway cache-eval --judge --judge-url`: every grey-zone pair is put to the server
    with the gateway's own request, and its yeses count as hits in the report."""
    pairs = PAIRS
    same = {(p.first, p.second) for p in read_pairs(pairs) if p.label}
    seen: list[dict[str, Any]] = []

    async def chat(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        first, second = re.findall(r"<<<\n(.*?)\n>>>", body["messages"][1]["content"], re.S)
        return web.json_response(answer("j", "YES" if (first, second) in same else "NO"))

    app = web.Application()
    app.router.add_post(CHAT, chat)
    url = await serve_app(app)
    command = [sys.executable, "-m", "gateway", "cache-eval", "--judge", str(pairs)]
    command += ["--judge-url", url, "--judge-model", "judge-m", "--judge-header", "X-Key: k"]
    done = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(done.communicate(), 300)
    assert done.returncode == 0, err.decode()
    report = out.decode()
    grey = re.search(r"grey zone .*: (\d+) pairs, (\d+) same", report)
    assert grey is not None, report
    assert len(seen) == int(grey[1]) > 0 and all(b["model"] == "judge-m" for b in seen)
    assert f"judged: {grey[1]} pairs asked, 0 without a verdict" in report
    judged = re.search(r"tier \+ judge's yeses: precision ([\d.]+), recall ([\d.]+)", report)
    tier = re.search(r"defaults .*: precision ([\d.]+), recall ([\d.]+)", report)
    assert judged is not None and tier is not None, report
    assert float(judged[2]) > float(tier[2]) and float(judged[1]) == 1.0


# --- mode: inline ---------------------------------------------------------------------------


async def test_inline_a_yes_answers_the_paraphrase_from_the_cache_at_once(judged):
    """The call the judge saves: the paraphrase's first ask waits for one short judge call
    and is answered with the stored answer, never generated."""
    gw = await judged({"mode": "inline"})
    stored = await gw.post(ASKED)
    first = await gw.post(PARAPHRASE)
    assert first.headers["X-Gateway-Cache"] == "hit"
    assert first.headers["X-Gateway-Cache-Match"] == "judged"
    assert first.json()["id"] == stored.json()["id"]
    assert len(gw.backend.judged) == 1 and gw.backend.answers == 1
    again = await gw.post(PARAPHRASE, ALICE, NO_STORE)  # now an alias: no second call
    assert again.headers["X-Gateway-Cache-Match"] == "judged"
    assert len(gw.backend.judged) == 1
    assert gw.tier.judge.pending == 0 and gw.tier.results["judge_inline_True"] == 1
    text = await gw.metrics()
    assert metric(text, "gateway_cache_judge_total", route="chat", verdict="yes") == 1


async def test_inline_a_no_is_generated_and_never_asked_again(judged):
    gw = await judged({"mode": "inline"})
    gw.backend.verdict = "NO"
    stored = await gw.post(ASKED)
    first = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert first.headers["X-Gateway-Cache"] == "miss"
    assert first.json()["id"] != stored.json()["id"]
    again = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert again.headers["X-Gateway-Cache"] == "miss"
    assert len(gw.backend.judged) == 1 and gw.backend.answers == 3


async def test_inline_a_judge_slower_than_its_timeout_or_failing_costs_only_the_wait(judged):
    """And once, not per miss: after a call without a verdict the judge rests for
    ``PAUSE_AFTER_ERROR_S``, so the misses meanwhile do not wait at all."""
    gw = await judged({"mode": "inline", "timeout_ms": 100})
    gw.backend.verdict = "hang"
    await gw.post(ASKED)
    slow = await gw.post(PARAPHRASE, ALICE, NO_STORE)
    assert slow.headers["X-Gateway-Cache"] == "miss" and gw.backend.answers == 2
    for text in OTHERS[:2]:  # paused: not put to the judge
        assert (await gw.post(text, ALICE, NO_STORE)).headers["X-Gateway-Cache"] == "miss"
    assert len(gw.backend.judged) == 1 and gw.tier.judge.counts["paused"] == 2
    gw.clock.advance(PAUSE_AFTER_ERROR_S)
    gw.backend.verdict = "fail"
    failed = await gw.post(OTHERS[2], ALICE, NO_STORE)
    assert failed.headers["X-Gateway-Cache"] == "miss" and gw.backend.answers == 5
    assert gw.tier.judge.counts["error"] == 2 and gw.tier.judge.pending == 0
    text = await gw.metrics()
    assert metric(text, "gateway_cache_judge_total", route="chat", verdict="paused") == 2
    gw.backend.release.set()


async def test_inline_the_rate_budget_bounds_the_calls_and_an_unjudged_miss_is_generated(judged):
    gw = await judged({"mode": "inline", "rate_per_s": 0.5, "burst": 1})
    gw.backend.verdict = "NO"
    await gw.post(ASKED)
    for text in OTHERS[:3]:
        assert (await gw.post(text, ALICE, NO_STORE)).headers["X-Gateway-Cache"] == "miss"
    assert len(gw.backend.judged) == 1 and gw.tier.judge.counts["rate_limited"] == 2
    gw.clock.advance(2.0)
    await gw.post(OTHERS[3], ALICE, NO_STORE)
    assert len(gw.backend.judged) == 2


async def test_inline_another_tenant_is_never_answered_by_a_judged_entry(judged):
    gw = await judged({"mode": "inline"})
    stored = await gw.post(ASKED, ALICE)
    bobs = await gw.post(PARAPHRASE, BOB)
    assert bobs.headers["X-Gateway-Cache"] == "miss" and bobs.json()["id"] != stored.json()["id"]
    assert gw.backend.judged == []  # Alice's entry is no candidate for Bob at all
