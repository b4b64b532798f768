"""Adaptive batching: batches held while the backend is busy, sized by AIMD when they go.

Through the gateway (without sockets) with ``adaptive`` on the route, and on the batcher itself with
``hold_while_busy`` (the mode the stage uses for adaptive routes), against a fake send that
the test answers call by call; time moves only through ``FakeClock``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from gateway.batching import Batcher, FixedLimit, OpenAIEmbeddings
from gateway.testing import FakeClock
from tests.backends import ArrayModel, BatchRig, embed, vector
from tests.helpers import until

ADAPTIVE_POLICY = """
backends:
  model: {{url: "{url}"}}
routes:
  - name: embeddings
    match: {{path: /v1/embeddings}}
    backend: model
    batch: {{max_size: 16, max_wait_ms: 0, adaptive: {{target_latency_ms: 60000}}}}
"""


async def test_adaptive_route_holds_batches_while_busy_and_grows_the_size_on_fast_full_batches(
    pipeline, tmp_path
):
    model = ArrayModel()
    path = tmp_path / "policy.yaml"
    path.write_text(ADAPTIVE_POLICY.format(url="http://model.test"))
    setup = BatchRig(model, await pipeline(path, model), path)
    batcher = setup.batcher("embeddings")
    assert batcher.limit == 1
    first = await setup.busy("/v1/embeddings", embed("first"))
    texts = [f"t{i}" for i in range(5)]
    tasks = [asyncio.ensure_future(setup.post("/v1/embeddings", embed(t))) for t in texts]
    await until(lambda: batcher.waiting == len(texts))
    # Each request is a full batch at limit 1 and max_wait_ms is 0, yet none went: the
    # backend is busy, and a batch that queued there would time the queue, not the batch.
    assert len(model.calls) == 1
    model.gate.set()
    results = await asyncio.gather(*tasks)
    await first

    assert model.sizes() == [1, 2, 3]  # each batch as large as the limit when it went
    assert [a["data"][0]["embedding"] for _, a, _ in results] == [vector(t) for t in texts]
    assert batcher.limit == 4
    assert setup.metric("gateway_batch_limit", route="embeddings") == 4
    assert "held<=1" in repr(batcher)


class Backend:
    """A fake send whose calls wait until the test answers them; ``sent`` lists every call."""

    def __init__(self) -> None:
        self.sent: list[list[Any]] = []
        self.calls: asyncio.Queue[tuple[list[Any], asyncio.Future[None]]] = asyncio.Queue()

    async def __call__(
        self, body: Any, verdict: Any = None
    ) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.sent.append(list(body["input"]))
        self.calls.put_nowait((list(body["input"]), done))
        await done
        data = [{"index": i, "embedding": vector(t)} for i, t in enumerate(body["input"])]
        return 200, (("content-type", "application/json"),), json.dumps({"data": data}).encode()

    async def answer_next(self) -> list[Any]:
        """Answer the oldest call not yet answered (the backend serves in order)."""
        inputs, done = await asyncio.wait_for(self.calls.get(), 5)  # a guard against hangs
        done.set_result(None)
        await settle()
        return inputs


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def held_batcher(backend: Backend, clock: FakeClock, limit: int = 2, depth: int = 1) -> Batcher:
    return Batcher(
        OpenAIEmbeddings(),
        backend,
        limit=FixedLimit(limit),
        max_wait_ms=5,
        clock=clock,
        sleep=clock.sleep,
        max_in_flight=depth,
    )


def submit(batcher: Batcher, text: str, scope: str = "") -> asyncio.Task[Any]:
    return asyncio.create_task(batcher.submit({"model": "e", "input": text}, scope=scope))


async def test_past_the_slots_one_batch_may_queue_upstream_and_the_rest_wait_to_go_full():
    clock, backend = FakeClock(), Backend()
    batcher = held_batcher(backend, clock, limit=4, depth=2)
    tasks = [submit(batcher, "first")]
    await settle()
    assert backend.sent == [["first"]]  # idle: at once

    tasks += [submit(batcher, f"a{i}") for i in range(2)]
    await settle()
    assert len(backend.sent) == 1  # busy: waits for company...
    clock.advance(0.005)
    await settle()
    assert backend.sent[1] == ["a0", "a1"]  # ...until max_wait, then queues upstream

    tasks += [submit(batcher, f"b{i}") for i in range(6)]
    await settle()
    clock.advance(1.0)
    await settle()
    assert len(backend.sent) == 2 and batcher.waiting == 6  # full or not, no third goes

    await backend.answer_next()
    assert backend.sent[2] == ["b0", "b1", "b2", "b3"]  # a batch returned: the next goes full
    await backend.answer_next()
    assert backend.sent[3] == ["b4", "b5"]  # the rest, long past max_wait, queues behind it
    await backend.answer_next()
    await backend.answer_next()
    answers = await asyncio.gather(*tasks)
    texts = ["first", "a0", "a1", *(f"b{i}" for i in range(6))]
    assert [a.json["data"][0]["embedding"] for a in answers] == [vector(t) for t in texts]


async def test_held_batches_take_turns_between_groups_so_no_tenant_starves_another():
    clock, backend = FakeClock(), Backend()
    batcher = held_batcher(backend, clock)
    first = asyncio.create_task(batcher.submit({"model": "e", "input": "first"}, scope="a"))
    await settle()
    tasks = [
        asyncio.create_task(batcher.submit({"model": "e", "input": f"a{i}"}, scope="a"))
        for i in range(5)
    ]
    tasks.append(asyncio.create_task(batcher.submit({"model": "e", "input": "b0"}, scope="b")))
    await settle()
    clock.advance(1.0)  # far past max_wait: it does not apply while held
    await settle()
    assert backend.calls.qsize() == 1 and batcher.waiting == 6

    order = [await backend.answer_next() for _ in range(5)]

    assert order == [["first"], ["a0", "a1"], ["b0"], ["a2", "a3"], ["a4"]]
    answers = await asyncio.gather(first, *tasks)
    assert [a.json["data"][0]["embedding"] for a in answers[1:6]] == [
        vector(f"a{i}") for i in range(5)
    ]


async def test_a_held_caller_that_leaves_is_not_sent():
    clock, backend = FakeClock(), Backend()
    batcher = held_batcher(backend, clock)
    first = asyncio.create_task(batcher.submit({"model": "e", "input": "first"}))
    await settle()
    stays = asyncio.create_task(batcher.submit({"model": "e", "input": "stays"}))
    leaves = asyncio.create_task(batcher.submit({"model": "e", "input": "leaves"}))
    await settle()
    leaves.cancel()
    await settle()

    assert await backend.answer_next() == ["first"]
    assert await backend.answer_next() == ["stays"]
    await asyncio.gather(first, stays)
    assert batcher.waiting == 0 and batcher.in_flight == 0
