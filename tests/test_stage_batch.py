"""Micro-batching through the gateway (without sockets), against a small model server per
API behind a ``FakeTransport`` (``tests.backends.ArrayModel``).

The model server answers deterministically from each input (a vector derived from the text,
the input doubled, ...), so every test can check that each client got exactly its own answer;
it records the inputs and headers of every call it served, to show which requests shared one.
Its ``gate`` holds answers: with the first call held the backend is busy, so the requests
sent next wait in the batcher (``max_wait_ms`` is far too long to elapse in a test) and go
together the moment the held call returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.backends import ArrayModel, BatchRig, embed, vector
from tests.helpers import until

NEVER_MS = 600_000  # no test waits this long for company: batches go when the backend frees

POLICY = """
backends:
  model: {{url: "{url}"}}
routes:
  - name: embeddings
    match: {{path: /v1/embeddings}}
    backend: model
    batch: {{max_size: 64, max_wait_ms: {never}}}
  - name: completions
    match: {{path: /v1/completions}}
    backend: model
    batch: {{max_size: 64, max_wait_ms: {never}}}
  - name: tei
    match: {{path: /embed}}
    backend: model
    batch: {{max_size: 64, max_wait_ms: {never}}}
  - name: kserve
    match: {{path: "/v2/models/*"}}
    backend: model
    batch: {{max_size: 64, max_wait_ms: {never}}}
  - name: tfserving
    match: {{path: "/v1/models/*"}}
    backend: model
    batch: {{max_size: 64, max_wait_ms: {never}}}
"""


@pytest.fixture
async def setup(pipeline, tmp_path) -> AsyncIterator[BatchRig]:
    model = ArrayModel()
    path = tmp_path / "policy.yaml"
    path.write_text(POLICY.format(url="http://model.test", never=NEVER_MS))
    rig = BatchRig(model, await pipeline(path, model), path)
    yield rig
    model.gate.set()


async def test_concurrent_callers_each_get_exactly_their_own_vectors_also_when_sending_lists(setup):
    first = await setup.busy("/v1/embeddings", embed("first"))
    inputs: list[Any] = [
        f"text number {i}" if i % 3 else [f"list {i} a", f"list {i} bb", f"list {i} ccc"]
        for i in range(24)
    ]
    tasks = [asyncio.ensure_future(setup.post("/v1/embeddings", embed(x))) for x in inputs]
    await until(lambda: setup.batcher("embeddings").waiting == len(inputs))
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)
    await first

    assert len(setup.model.calls) == 2  # the held one, then everyone else together
    sent = [t for x in inputs for t in (x if isinstance(x, list) else [x])]
    assert sorted(setup.model.calls[1].inputs) == sorted(sent)
    prompt_tokens = 0
    for x, (status, answer, _) in zip(inputs, results, strict=True):
        assert status == 200
        own = x if isinstance(x, list) else [x]
        assert [d["index"] for d in answer["data"]] == list(range(len(own)))
        assert [d["embedding"] for d in answer["data"]] == [vector(t) for t in own]
        prompt_tokens += answer["usage"]["prompt_tokens"]
    assert prompt_tokens == sum(len(t.split()) for t in sent)  # usage apportioned, none lost
    assert setup.metric("gateway_batch_size_count", route="embeddings") == 2
    assert setup.metric("gateway_batch_size_sum", route="embeddings") == 1 + len(sent)


ADAPTER_CASES = {
    "openai-embeddings": (
        "/v1/embeddings",
        lambda i: embed(f"text {i}" * (i + 1)),
        lambda i, a: (
            a["data"]
            == [{"object": "embedding", "index": 0, "embedding": vector(f"text {i}" * (i + 1))}]
        ),
    ),
    "tei-embed": (
        "/embed",
        lambda i: {"inputs": f"text {i}" * (i + 1), "normalize": True},
        lambda i, a: a == [vector(f"text {i}" * (i + 1))],
    ),
    "kserve-v2": (
        "/v2/models/double/infer",
        lambda i: {
            "id": f"r{i}",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [i, i + 0.5]}],
        },
        lambda i, a: (
            a["id"] == f"r{i}"
            and a["outputs"][0]["shape"] == [1, 2]
            and a["outputs"][0]["data"] == [2 * i, 2 * i + 1]
        ),
    ),
    "tfserving-predict": (
        "/v1/models/sum:predict",
        lambda i: {"instances": [[i, 10]]},
        lambda i, a: a["predictions"] == [i + 10],
    ),
    "openai-completions": (
        "/v1/completions",
        lambda i: {"model": "c", "prompt": f"prompt {i}", "temperature": 0, "max_tokens": 4},
        lambda i, a: (
            a["choices"]
            == [{"index": 0, "text": f"prompt {i}!", "finish_reason": "stop", "logprobs": None}]
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(ADAPTER_CASES))
async def test_each_adapter_merges_concurrent_requests_into_one_call_and_answers_each_its_own(
    setup, case
):
    path, make, check = ADAPTER_CASES[case]
    first = await setup.busy(path, make(100))
    tasks = [asyncio.ensure_future(setup.post(path, make(i))) for i in range(5)]
    await until(lambda: setup.waiting() == 5)
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)
    status, answer, _ = await first

    assert status == 200 and check(100, answer)
    assert setup.model.sizes(setup.model.calls[0].path) == [1, 5]
    for i, (status, answer, headers) in enumerate(results):
        assert status == 200, answer
        assert check(i, answer), answer
        assert headers["Content-Type"].startswith("application/json")


async def test_a_poison_input_fails_only_its_own_request_by_bisection(setup):
    first = await setup.busy("/v1/embeddings", embed("first"))
    texts = ["alpha", "beta", "POISON", "gamma", "delta"]
    tasks = [asyncio.ensure_future(setup.post("/v1/embeddings", embed(t))) for t in texts]
    await until(lambda: setup.batcher("embeddings").waiting == len(texts))
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)
    await first

    for text, (status, answer, _) in zip(texts, results, strict=True):
        if text == "POISON":
            assert status == 400
            assert answer == {"error": {"message": "bad input POISON"}}  # the upstream's own
        else:
            assert status == 200
            assert answer["data"][0]["embedding"] == vector(text)
    assert setup.metric("gateway_batch_splits_total", route="embeddings") >= 2


async def test_out_of_memory_halves_the_batch_size_and_every_request_still_succeeds(setup):
    setup.model.oom_above = 2
    first = await setup.busy("/v1/embeddings", embed("first"))
    texts = [f"t{i}" for i in range(4)]
    tasks = [asyncio.ensure_future(setup.post("/v1/embeddings", embed(t))) for t in texts]
    await until(lambda: setup.batcher("embeddings").waiting == len(texts))
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)
    await first

    assert [status for status, _, _ in results] == [200] * 4
    assert [a["data"][0]["embedding"] for _, a, _ in results] == [vector(t) for t in texts]
    assert setup.model.sizes() == [1, 4, 2, 2]
    assert setup.batcher("embeddings").limit == 2
    assert setup.metric("gateway_batch_oom_backoffs_total", route="embeddings") == 1
    assert setup.metric("gateway_batch_limit", route="embeddings") == 2


async def test_requests_of_different_tenants_never_share_a_call(setup):
    first = await setup.busy("/v1/embeddings", embed("first"))
    tenants = ["a", "b", "a", "b", "c"]
    tasks = [
        asyncio.create_task(
            setup.post("/v1/embeddings", embed(f"{t}-{i}"), auth=f"Bearer tenant-{t}")
        )
        for i, t in enumerate(tenants)
    ]
    await until(lambda: setup.batcher("embeddings").waiting == len(tenants))
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)
    await first

    assert all(status == 200 for status, _, _ in results)
    merged = setup.model.calls[1:]
    assert sorted(len(c.inputs) for c in merged) == [1, 2, 2]
    for call in merged:
        owners = {text.split("-")[0] for text in call.inputs}
        assert len(owners) == 1
        assert call.authorization == f"Bearer tenant-{owners.pop()}"  # each on its own credentials


async def test_requests_differing_in_a_parameter_never_share_a_call(setup):
    first = await setup.busy("/v1/embeddings", embed("first"))
    bodies = [embed(f"x{i}", model="small" if i % 2 else "large", dimensions=8) for i in range(4)]
    bodies.append(embed("x4", model="small", dimensions=16))
    tasks = [asyncio.ensure_future(setup.post("/v1/embeddings", b)) for b in bodies]
    await until(lambda: setup.batcher("embeddings").waiting == len(bodies))
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)
    await first

    assert all(status == 200 for status, _, _ in results)
    merged = setup.model.calls[1:]
    assert sorted(len(c.inputs) for c in merged) == [1, 2, 2]
    for call in merged:
        mine = [b for b in bodies if b["input"] in call.inputs]
        assert {(b["model"], b["dimensions"]) for b in mine} == {
            (call.body["model"], call.body["dimensions"])
        }


async def test_streaming_and_sampled_requests_are_never_merged(setup):
    setup.model.gate.clear()
    bodies: list[dict[str, Any]] = [
        {"model": "c", "prompt": "sampled 1", "temperature": 0.8},
        {"model": "c", "prompt": "sampled 2", "temperature": 0.8},
        {"model": "c", "prompt": "no temperature"},
        {"model": "c", "prompt": "streamed 1", "temperature": 0, "stream": True},
        {"model": "c", "prompt": "streamed 2", "temperature": 0, "stream": True},
    ]

    async def send(body: dict[str, Any]) -> tuple[int, bytes]:
        answer = await setup.gw.post("/v1/completions", body)
        return answer.status_code, answer.body

    tasks = [asyncio.create_task(send(b)) for b in bodies]
    await until(lambda: len(setup.model.calls) == len(bodies))  # each went on alone, at once
    setup.model.gate.set()
    results = await asyncio.gather(*tasks)

    assert setup.model.sizes() == [1] * len(bodies)
    assert all(status == 200 for status, _ in results)
    assert b"data: [DONE]" in results[3][1]
    assert setup.batcher("completions").upstream_calls == 0


async def test_a_body_the_adapter_cannot_batch_goes_straight_on(setup):
    first = await setup.busy("/embed", {"inputs": "first"})
    task = asyncio.ensure_future(setup.post("/embed", {"inputs": []}))  # no input: not batchable
    await until(lambda: len(setup.model.calls) == 2)  # it did not wait for the busy backend
    setup.model.gate.set()
    status, answer, _ = await task
    assert (status, answer) == (200, [])
    await first
    assert setup.batcher("tei").upstream_calls == 1


async def test_a_reload_keeps_an_unchanged_batcher_and_replaces_a_changed_one(setup):
    gateway = setup.gw.gateway
    before = setup.batcher("embeddings")
    text = setup.policy_path.read_text()
    setup.policy_path.write_text(text.replace("name: tei", "name: tei-renamed"))
    gateway.reload()  # (the file watcher may have been first)
    assert "tei-renamed" in [r.name for r in gateway.snapshot.policy.routes]
    assert setup.batcher("embeddings") is before

    setup.policy_path.write_text(
        text.replace(
            f"batch: {{max_size: 64, max_wait_ms: {NEVER_MS}}}\n  - name: completions",
            f"batch: {{max_size: 8, max_wait_ms: {NEVER_MS}}}\n  - name: completions",
        )
    )
    gateway.reload()
    after = setup.batcher("embeddings")
    assert after is not before and after.limit == 8
    status, answer, _ = await setup.post("/v1/embeddings", embed("after reload"))
    assert status == 200 and answer["data"][0]["embedding"] == vector("after reload")


def test_policies_without_batch_or_coalesce_get_neither_stage():
    from gateway.batching import stage as batch
    from gateway.clock import SYSTEM_CLOCK
    from gateway.coalesce import stage as coalesce
    from gateway.metrics import Metrics
    from gateway.policy.load import zero_config_policy
    from gateway.runtime import Runtime
    from gateway.state import Registry

    runtime = Runtime(Metrics(), Registry(), SYSTEM_CLOCK, transport=None)  # type: ignore[arg-type]
    policy = zero_config_policy("http://127.0.0.1:1")
    assert batch.build(policy, runtime) == [] and coalesce.build(policy, runtime) == []
    assert repr(runtime.registry) == "<Registry {}>"
