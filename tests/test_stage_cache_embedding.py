"""The seam to the embedding tier: asked after the exact and SimHash tiers, told about every
stored answer, never able to serve another tenant's entry; and when its module is missing,
``gateway check`` and the gateway say so and keep serving the other tiers.

The gateway takes its tier factory as a parameter (``Gateway(embedding_tiers=...)``), so
these tests give it a stand-in tier that has gone wrong; the extra's absence is shown by
hiding the third-party packages the local model needs.  The gateway runs without sockets
(``gateway.testing.harness.Pipeline``) in front of a backend that gives every answer a fresh id.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.cache.embedding.local import MODEL, RUNTIME_MODULES, TOKENIZER
from gateway.cache.embedding_seam import EmbeddingContext, unavailable
from gateway.cache.keys import RequestKey
from gateway.cache.tiers import Hit
from gateway.cli import main
from gateway.pipeline import Reply
from gateway.policy.model import Semantic
from gateway.testing import Sent, json_reply

POLICY = """
backends:
  gpu: {{url: "{url}"}}
routes:
  - name: chat
    match: {{path: /v1/chat/completions}}
    backend: gpu
    cache: {{ttl_s: 60, semantic: {{method: embedding}}}}
"""


class StandInTier:
    """Answers every lookup with the last entry added, whoever asks: a tier gone wrong."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.added: list[tuple[str, str]] = []
        self.looked_up: list[str] = []

    async def lookup(self, key: RequestKey, text: str) -> Hit | None:
        self.looked_up.append(text)
        if not self.added:
            return None
        entry_key = self.added[-1][1]
        entry = await self.store.get(entry_key)
        return Hit(entry, "embedding", 0.97, entry_key) if entry is not None else None

    async def add(self, key: RequestKey, text: str, entry_key: str) -> None:
        self.added.append((text, entry_key))


URL = "http://gpu.test"
CHAT = "/v1/chat/completions"
_IDS = itertools.count(1)


def fresh(sent: Sent) -> Reply:
    """A chat answer with an id of its own, so a cached answer is told from a fresh one."""
    message = {"role": "assistant", "content": "an answer"}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    return json_reply(
        {"id": f"chatcmpl-{next(_IDS)}", "object": "chat.completion", "choices": [choice]}
    )


class StandIns:
    """A tier factory for ``Gateway(embedding_tiers=...)`` that keeps what it made."""

    def __init__(self) -> None:
        self.made: list[StandInTier] = []

    def __call__(self, semantic: Semantic, context: EmbeddingContext) -> StandInTier:
        assert semantic.method == "embedding" and context.route == "chat"
        self.made.append(StandInTier(context.store))
        return self.made[-1]


@pytest.fixture
def tiers() -> StandIns:
    return StandIns()


def ask(text: str) -> dict[str, Any]:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": text}]}


async def test_the_embedding_tier_answers_after_exact_and_simhash(
    tiers: StandIns, pipeline: Any
) -> None:
    gw = await pipeline(POLICY.format(url=URL), fresh, embedding_tiers=tiers)
    (tier,) = tiers.made
    alice = {"Authorization": "Bearer a"}
    stored = await gw.post(CHAT, ask("What is the capital of France?"), headers=alice)
    assert stored.headers["X-Gateway-Cache"] == "miss"
    assert tier.added and tier.added[0][0] == "What is the capital of France?"
    exact = await gw.post(CHAT, ask("What is the capital of France?"), headers=alice)
    near = await gw.post(CHAT, ask("what is the capital of france"), headers=alice)
    assert exact.headers["X-Gateway-Cache-Match"] == "exact"
    assert near.headers["X-Gateway-Cache-Match"] == "simhash"
    assert tier.looked_up == ["What is the capital of France?"]  # only on the miss
    para = await gw.post(CHAT, ask("Which city is France's capital?"), headers=alice)
    assert para.headers["X-Gateway-Cache"] == "hit"
    assert para.headers["X-Gateway-Cache-Match"] == "embedding"
    assert para.headers["X-Gateway-Cache-Similarity"] == "0.970"
    assert para.json()["id"] == stored.json()["id"]


async def test_an_embedding_hit_of_another_tenant_or_context_is_refused(
    tiers: StandIns, pipeline: Any
) -> None:
    gw = await pipeline(POLICY.format(url=URL), fresh, embedding_tiers=tiers)
    alice = {"Authorization": "a"}
    await gw.post(CHAT, ask("Alice's secret question"), headers=alice)
    other_context = ask("Alice asks again")
    other_context["max_tokens"] = 3
    own = await gw.post(CHAT, other_context, headers=alice)
    assert own.headers["X-Gateway-Cache"] == "miss"
    bob = await gw.post(CHAT, ask("Bob asks this"), headers={"Authorization": "b"})
    assert bob.headers["X-Gateway-Cache"] == "miss"
    assert len(tiers.made[0].looked_up) == 3  # each was offered the wrong entry, and refused


async def test_without_the_embedding_extra_check_warns_and_the_gateway_serves_the_rest(
    monkeypatch: pytest.MonkeyPatch,
    pipeline: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in (*RUNTIME_MODULES, MODEL.package, TOKENIZER.package):
        monkeypatch.setitem(sys.modules, name, None)  # as if the extra were not installed
    reason = unavailable(Semantic(method="embedding"))
    assert reason is not None and "embedding tier is unavailable" in reason
    assert "the embedding extra is not installed" in reason
    policy = tmp_path / "p.yaml"
    policy.write_text(POLICY.format(url=URL))
    assert main(["check", str(policy)]) == 0
    err = capsys.readouterr().err
    assert "routes[0].cache.semantic.method: the embedding tier is unavailable" in err
    gw = await pipeline(policy, fresh)
    await gw.post(CHAT, ask("Still cached?"))
    again = await gw.post(CHAT, ask("still cached"))
    assert again.headers["X-Gateway-Cache-Match"] == "simhash"


def test_a_backend_embedder_with_the_learned_verifier_needs_the_extra_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The learned verifier reads candidates with a cross-encoder on the local model's
    runtime: without the extra the tier says so (startup log, gateway check) instead of
    missing every candidate silently; with the rules it needs nothing."""
    learned = Semantic(method="embedding", embedder="emb", min_score=0.9)
    rules = Semantic(method="embedding", embedder="emb", verifier="rules")
    assert unavailable(rules) is None
    for name in (*RUNTIME_MODULES, MODEL.package, TOKENIZER.package):
        monkeypatch.setitem(sys.modules, name, None)
    reason = unavailable(learned)
    assert reason is not None and "cross-encoder" in reason and "verifier: rules" in reason
    assert unavailable(rules) is None


def test_check_warns_when_max_distance_exceeds_the_index(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    policy = tmp_path / "p.yaml"
    policy.write_text(
        POLICY.format(url="http://127.0.0.1:1").replace(
            "method: embedding", "method: simhash, max_distance: 9"
        )
    )
    assert main(["check", str(policy)]) == 0
    assert "max_distance: 9 is beyond what the SimHash index finds; 3 is used" in (
        capsys.readouterr().err
    )
