"""When the batcher sends, what it merges, and how it sorts out failures of a merged call.

The upstream here is a fake transport whose calls wait until the test answers them, so every
ordering is set by the test; time moves only through ``FakeClock``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import pytest

from gateway.batching import AimdLimit, Batcher, FixedLimit, OpenAIEmbeddings
from gateway.errors import BatchSplitError, Overloaded, UpstreamTimeout, UpstreamUnavailable
from gateway.testing import FakeClock

JSON = (("content-type", "application/json"),)
Responder = Callable[[dict[str, Any]], tuple[int, bytes]]


def embed_answer(body: dict[str, Any]) -> tuple[int, bytes]:
    data = [
        {"index": i, "embedding": [float(len(t))], "text": t} for i, t in enumerate(body["input"])
    ]
    n = len(body["input"])
    return 200, json.dumps(
        {"data": data, "usage": {"prompt_tokens": n, "total_tokens": n}}
    ).encode()


class UpstreamCall:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.reply: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()

    @property
    def inputs(self) -> list[Any]:
        return list(self.body["input"])

    def ok(self) -> None:
        self.reply.set_result(embed_answer(self.body))


class Backend:
    """Fake upstream: calls queue up for the test to answer, unless ``respond`` answers them."""

    def __init__(self, respond: Responder | None = None) -> None:
        self.respond = respond
        self.queue: asyncio.Queue[UpstreamCall] = asyncio.Queue()
        self.sizes: list[int] = []

    async def __call__(
        self, body: Any, verdict: Any = None
    ) -> tuple[int, tuple[tuple[str, str], ...], bytes]:
        self.sizes.append(len(body["input"]))
        if self.respond is not None:
            status, raw = self.respond(body)
            return status, JSON, raw
        call = UpstreamCall(body)
        self.queue.put_nowait(call)
        status, raw = await call.reply
        return status, JSON, raw

    async def next(self) -> UpstreamCall:
        return await asyncio.wait_for(self.queue.get(), 5)  # a guard against hangs only

    @property
    def idle(self) -> bool:
        return self.queue.empty()


async def settle() -> None:
    """Let every ready task run until it blocks (no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


class Recorder:
    def __init__(self) -> None:
        self.sizes: list[int] = []
        self.waits: list[float] = []
        self.limits: list[int] = []
        self.splits = 0
        self.reasons: list[str] = []
        self.ooms = 0

    def batch_sent(self, items: int) -> None:
        self.sizes.append(items)

    def waited(self, seconds: float) -> None:
        self.waits.append(seconds)

    def limit_changed(self, limit: int) -> None:
        self.limits.append(limit)

    def split(self, reason: str) -> None:
        self.splits += 1
        self.reasons.append(reason)

    def oom_backoff(self) -> None:
        self.ooms += 1


def make(backend: Backend, clock: FakeClock, **kwargs: Any) -> Batcher:
    kwargs.setdefault("limit", FixedLimit(8))
    return Batcher(
        OpenAIEmbeddings(), backend, clock=clock, sleep=clock.sleep, max_wait_ms=5, **kwargs
    )


def body(text: Any, **fields: Any) -> dict[str, Any]:
    return {"model": "e5", "input": text, **fields}


async def start_busy(batcher: Batcher, backend: Backend) -> tuple[asyncio.Task[Any], UpstreamCall]:
    """One request upstream and unanswered: the backend is busy."""
    task = asyncio.create_task(batcher.submit(body("first")))
    return task, await backend.next()


async def test_idle_backend_sends_a_lone_request_at_once_without_waiting():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)

    task = asyncio.create_task(batcher.submit(body("hello")))
    call = await backend.next()  # no clock.advance: the 5 ms wait was not served
    call.ok()

    assert call.inputs == ["hello"]
    assert (await task).json["data"][0]["text"] == "hello"


async def test_requests_that_arrive_together_at_an_idle_backend_share_a_call():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)

    tasks = [asyncio.create_task(batcher.submit(body(f"t{i}"))) for i in range(3)]
    call = await backend.next()
    call.ok()

    assert call.inputs == ["t0", "t1", "t2"]
    assert [(await t).json["data"][0]["text"] for t in tasks] == ["t0", "t1", "t2"]


async def test_while_busy_requests_accumulate_and_go_the_moment_the_batch_returns():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)

    tasks = [asyncio.create_task(batcher.submit(body(f"t{i}"))) for i in range(3)]
    await settle()
    assert backend.idle and batcher.waiting == 3
    call1.ok()
    call2 = await backend.next()

    assert call2.inputs == ["t0", "t1", "t2"]
    call2.ok()
    await asyncio.gather(first, *tasks)


async def test_full_batch_goes_at_once_even_while_the_backend_is_busy():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock, limit=FixedLimit(4))
    first, call1 = await start_busy(batcher, backend)

    tasks = [asyncio.create_task(batcher.submit(body(f"t{i}"))) for i in range(5)]
    call2 = await backend.next()

    assert call2.inputs == ["t0", "t1", "t2", "t3"]
    assert batcher.waiting == 1  # t4 starts the next batch
    for c in (call1, call2):
        c.ok()
    call3 = await backend.next()
    call3.ok()
    await asyncio.gather(first, *tasks)


async def test_max_wait_sends_a_partial_batch_while_the_backend_is_busy():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)

    tasks = [asyncio.create_task(batcher.submit(body(f"t{i}"))) for i in range(2)]
    await settle()
    clock.advance(0.004)
    await settle()
    assert backend.idle
    clock.advance(0.001)
    call2 = await backend.next()

    assert call2.inputs == ["t0", "t1"]
    assert batcher.in_flight == 2
    call1.ok()
    call2.ok()
    await asyncio.gather(first, *tasks)


@pytest.mark.parametrize(
    "other",
    [
        body("b", model="other"),
        body("b", dimensions=256),
        body("b", encoding_format="base64"),
        body("b", user="someone"),
        body([[1, 2, 3]]),  # token arrays never share a call with texts
    ],
)
async def test_requests_differing_in_any_non_input_field_never_share_a_call(other):
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)

    a = asyncio.create_task(batcher.submit(body("a")))
    b = asyncio.create_task(batcher.submit(other))
    await settle()
    call1.ok()
    calls = [await backend.next()]
    calls[0].ok()
    calls.append(await backend.next())
    calls[1].ok()

    assert sorted(len(c.inputs) for c in calls) == [1, 1]
    await asyncio.gather(first, a, b)


async def test_requests_of_different_scopes_never_share_a_call():
    """The scope carries the tenant (and route, backend, path) the lead adds to the key."""
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)

    a = asyncio.create_task(batcher.submit(body("a"), scope=("tenant-a",)))
    b = asyncio.create_task(batcher.submit(body("b"), scope=("tenant-b",)))
    await settle()
    assert "2 groups" in repr(batcher)
    call1.ok()
    (call2 := await backend.next()).ok()
    (call3 := await backend.next()).ok()

    assert [call2.inputs, call3.inputs] == [["a"], ["b"]]
    await asyncio.gather(first, a, b)


async def test_caller_gone_before_dispatch_leaves_the_pending_batch():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)

    gone = asyncio.create_task(batcher.submit(body("gone")))
    stays = asyncio.create_task(batcher.submit(body("stays")))
    await settle()
    gone.cancel()
    await settle()
    call1.ok()
    call2 = await backend.next()
    call2.ok()

    assert call2.inputs == ["stays"]
    assert (await stays).json["data"][0]["text"] == "stays"
    assert (await first).status == 200 and gone.cancelled()


async def test_last_caller_gone_before_dispatch_leaves_nothing_to_send():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)

    gone = asyncio.create_task(batcher.submit(body("gone")))
    await settle()
    gone.cancel()
    await settle()
    clock.advance(1)
    call1.ok()
    await first
    await settle()

    assert backend.idle and batcher.waiting == 0 and batcher.upstream_calls == 1


async def test_caller_gone_after_dispatch_has_its_share_discarded():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)

    gone = asyncio.create_task(batcher.submit(body("gone")))
    stays = asyncio.create_task(batcher.submit(body("stays")))
    call = await backend.next()
    gone.cancel()
    await settle()
    call.ok()

    assert call.inputs == ["gone", "stays"]
    assert (await stays).json["data"][0]["text"] == "stays"
    assert gone.cancelled()


async def test_caller_with_more_items_than_the_limit_goes_alone_and_unsplit():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock, limit=FixedLimit(4))
    first, call1 = await start_busy(batcher, backend)

    big = asyncio.create_task(batcher.submit(body([f"b{i}" for i in range(6)])))
    call2 = await backend.next()
    call2.ok()

    assert call2.inputs == [f"b{i}" for i in range(6)]
    assert len((await big).json["data"]) == 6
    call1.ok()
    await first


async def test_poison_input_is_bisected_so_only_its_caller_gets_the_4xx():
    def respond(b: dict[str, Any]) -> tuple[int, bytes]:
        if "bad" in b["input"]:
            return 422, b'{"error": "input bad is not allowed"}'
        return embed_answer(b)

    clock, recorder = FakeClock(), Recorder()
    backend = Backend(respond)
    batcher = make(backend, clock, observer=recorder)
    texts = ["a", "b", "c", "bad", "d", "e", "f"]

    answers = await asyncio.gather(*(batcher.submit(body(t)) for t in texts))

    assert [a.status for a in answers] == [422 if t == "bad" else 200 for t in texts]
    assert answers[3].body == b'{"error": "input bad is not allowed"}'
    assert [a.json["data"][0]["text"] for a in answers if a.status == 200] == [
        "a",
        "b",
        "c",
        "d",
        "e",
        "f",
    ]
    assert backend.sizes[0] == 7 and recorder.splits == batcher.splits >= 2
    assert set(recorder.reasons) == {"4xx"}


async def test_429_and_408_are_not_bisected_but_go_to_every_caller():
    clock = FakeClock()
    backend = Backend(lambda b: (429, b'{"error": "slow down"}'))
    batcher = make(backend, clock)

    answers = await asyncio.gather(*(batcher.submit(body(t)) for t in "abcd"))

    assert [a.status for a in answers] == [429] * 4
    assert backend.sizes == [4] and batcher.splits == 0


@pytest.mark.parametrize(
    ("status", "raw"),
    [
        (500, b'{"error": "CUDA out of memory. Tried to allocate 2.00 GiB"}'),
        (500, b"torch.OutOfMemoryError: CUDA OOM"),
        (507, b"insufficient storage"),
    ],
)
async def test_out_of_memory_halves_the_limit_and_retries_in_smaller_batches(status, raw):
    def respond(b: dict[str, Any]) -> tuple[int, bytes]:
        return (status, raw) if len(b["input"]) > 2 else embed_answer(b)

    clock, recorder = FakeClock(), Recorder()
    backend = Backend(respond)
    batcher = make(backend, clock, observer=recorder)

    answers = await asyncio.gather(*(batcher.submit(body(f"t{i}")) for i in range(8)))

    assert [a.json["data"][0]["text"] for a in answers] == [f"t{i}" for i in range(8)]
    assert backend.sizes == [8, 4, 2, 2, 2, 2]
    assert batcher.limit == 2 and batcher.oom_backoffs == 2
    assert recorder.limits == [4, 2] and recorder.ooms == 2
    assert "limit=2/8" in repr(batcher) and "oom_backoffs=2" in repr(batcher)


async def test_out_of_memory_on_a_lone_caller_reaches_it_and_still_lowers_the_limit():
    clock = FakeClock()
    backend = Backend(lambda b: (500, b"RuntimeError: CUDA error: out of memory"))
    batcher = make(backend, clock)

    answer = await batcher.submit(body(["a", "b", "c", "d"]))

    assert answer.status == 500 and answer.json is None and b"out of memory" in answer.body
    assert batcher.limit == 2


async def test_other_5xx_goes_to_every_caller_without_retry():
    clock = FakeClock()
    backend = Backend(lambda b: (503, b'{"error": "loading model"}'))
    batcher = make(backend, clock)

    answers = await asyncio.gather(*(batcher.submit(body(t)) for t in "abc"))

    assert {(a.status, a.body, a.split) for a in answers} == {
        (503, b'{"error": "loading model"}', False)
    }
    assert backend.sizes == [3] and batcher.limit == 8


@pytest.mark.parametrize(
    ("raised", "expected"),
    [
        (UpstreamTimeout("slow"), UpstreamTimeout),
        (ConnectionResetError("reset"), UpstreamUnavailable),
    ],
)
async def test_transport_error_goes_to_every_caller_of_the_call(raised, expected):
    async def send(b: Any, verdict: Any) -> Any:
        raise raised

    batcher = Batcher(OpenAIEmbeddings(), send, max_wait_ms=5)
    results = await asyncio.gather(*(batcher.submit(body(t)) for t in "ab"), return_exceptions=True)

    assert [type(r) for r in results] == [expected, expected]


async def test_an_answer_that_cannot_be_split_is_bisected_down_to_callers_alone():
    """The backend answers one vector whatever it is sent: the batch of two cannot be
    split, so each caller is asked alone, and each alone gets an answer that fits."""
    clock, recorder = FakeClock(), Recorder()
    backend = Backend(lambda b: (200, b'{"data": [{"index": 0, "embedding": [1.0]}]}'))
    batcher = make(backend, clock, observer=recorder)
    results = await asyncio.gather(*(batcher.submit(body(t)) for t in "ab"))
    assert [r.status for r in results] == [200, 200]
    assert backend.sizes == [2, 1, 1]
    assert recorder.reasons == ["unsplittable"]


async def test_an_answer_that_cannot_be_split_even_alone_fails_its_caller():
    clock = FakeClock()
    backend = Backend(lambda b: (200, b'{"data": []}'))
    batcher = make(backend, clock)

    results = await asyncio.gather(*(batcher.submit(body(t)) for t in "ab"), return_exceptions=True)

    assert all(isinstance(r, BatchSplitError) for r in results)


async def test_observer_sees_batch_sizes_and_each_callers_wait():
    clock, backend, recorder = FakeClock(), Backend(), Recorder()
    batcher = make(backend, clock, observer=recorder)
    first, call1 = await start_busy(batcher, backend)

    tasks = [asyncio.create_task(batcher.submit(body(f"t{i}"))) for i in range(2)]
    await settle()
    clock.advance(0.003)
    call1.ok()
    (await backend.next()).ok()
    await asyncio.gather(first, *tasks)

    assert recorder.sizes == [1, 2]
    assert recorder.waits == [0.0, pytest.approx(0.003), pytest.approx(0.003)]


async def test_aimd_limit_grows_on_fast_full_batches_and_feeds_the_observer():
    clock, recorder = FakeClock(), Recorder()
    backend = Backend(embed_answer)
    limit = AimdLimit(8, target_latency_ms=100, clock=clock, initial=1)
    batcher = make(backend, clock, limit=limit, observer=recorder)

    for _ in range(3):
        await asyncio.gather(*(batcher.submit(body(f"t{i}")) for i in range(batcher.limit)))

    assert batcher.limit == 4 and recorder.limits == [2, 3, 4]
    assert backend.sizes == [1, 2, 3]


async def test_repr_shows_live_state():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock, name="embed")
    first, call1 = await start_busy(batcher, backend)
    task = asyncio.create_task(batcher.submit(body(["x", "y"])))
    await settle()

    assert repr(batcher) == (
        "<Batcher embed limit=8/8 waiting=1 (2 items, 1 groups) in_flight=1/1 calls=1 splits=0 oom_backoffs=0>"
    )
    call1.ok()
    (await backend.next()).ok()
    await asyncio.gather(first, task)


async def test_closing_fails_waiting_callers_and_refuses_new_ones():
    clock, backend = FakeClock(), Backend()
    batcher = make(backend, clock)
    first, call1 = await start_busy(batcher, backend)
    waiting = asyncio.create_task(batcher.submit(body("w")))
    await settle()

    closing = asyncio.create_task(batcher.aclose())
    await settle()
    call1.ok()
    await closing

    assert (await first).status == 200
    with pytest.raises(Overloaded):
        await waiting
    with pytest.raises(Overloaded):
        await batcher.submit(body("late"))
