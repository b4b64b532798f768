"""Single flight: one upstream call per key in flight, shared whole or as a fanned-out stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.coalesce.singleflight import SingleFlight
from gateway.errors import SlowReader, UpstreamTimeout, UpstreamUnavailable
from gateway.pipeline import Reply

SSE = (("content-type", "text/event-stream"),)
END = object()


class Upstream:
    """A fake upstream call: the test decides when it answers and what each chunk is."""

    def __init__(self, *, stream: bool = True) -> None:
        self.stream = stream
        self.starts = 0
        self.go = asyncio.Event()  # the head (status and headers) may go
        self.chunks: asyncio.Queue[Any] = asyncio.Queue()
        self.cancelled = asyncio.Event()
        self.closed = 0
        self.fail: BaseException | None = None

    async def start(self) -> Reply:
        self.starts += 1
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        if self.fail is not None:
            raise self.fail
        if not self.stream:
            return Reply(200, (("content-type", "application/json"),), body=b'{"ok":true}')
        return Reply(200, SSE, stream=self._chunks(), close=self._close)

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            while (item := await self.chunks.get()) is not END:
                if isinstance(item, BaseException):
                    raise item
                yield item
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def _close(self) -> None:
        self.closed += 1

    def send(self, *items: Any) -> None:
        for item in items:
            self.chunks.put_nowait(item)


async def settle() -> None:
    """Let every ready task run until it blocks (no time passes)."""
    for _ in range(20):
        await asyncio.sleep(0)


async def read_all(reply: Reply) -> bytes:
    assert reply.stream is not None
    try:
        return b"".join([chunk async for chunk in reply.stream])
    finally:
        if reply.close is not None:
            await reply.close()


async def test_identical_concurrent_requests_share_one_call():
    flights, up = SingleFlight(), Upstream(stream=False)
    calls = [asyncio.create_task(flights.do("k", up.start)) for _ in range(5)]
    await settle()
    up.go.set()
    replies = await asyncio.gather(*calls)

    assert up.starts == 1 and flights.coalesced == 4
    assert {r.body for r in replies} == {b'{"ok":true}'}
    assert [r.coalesced for r in replies] == [False, True, True, True, True]


async def test_different_keys_do_not_share_a_call():
    flights, up = SingleFlight(), Upstream(stream=False)
    up.go.set()
    await asyncio.gather(flights.do("tenant-a:k", up.start), flights.do("tenant-b:k", up.start))
    assert up.starts == 2 and flights.coalesced == 0


async def test_a_finished_flight_leaves_the_table_so_the_next_request_calls_again():
    flights, up = SingleFlight(), Upstream(stream=False)
    up.go.set()
    await flights.do("k", up.start)
    await flights.do("k", up.start)
    assert up.starts == 2 and len(flights) == 0


async def test_late_joiner_of_a_stream_gets_the_chunks_already_sent_then_the_live_ones():
    flights, up = SingleFlight(), Upstream()
    up.go.set()
    first = await flights.do("k", up.start, stream=True)
    assert first.stream is not None
    up.send(b"data: a\n\n", b"data: b\n\n")
    assert await anext(first.stream) == b"data: a\n\n"
    await settle()

    late = await flights.do("k", up.start, stream=True)
    up.send(b"data: c\n\n", END)

    assert await read_all(late) == b"data: a\n\ndata: b\n\ndata: c\n\n"
    assert await read_all(first) == b"data: b\n\ndata: c\n\n"
    assert up.starts == 1 and late.coalesced and late.headers == SSE
    assert up.closed == 1


async def test_whole_body_joiner_of_a_stream_gets_the_assembled_answer():
    def assemble(status: int, headers: Any, body: bytes) -> tuple[Any, bytes]:
        events = [line[6:] for line in body.split(b"\n") if line.startswith(b"data: ")]
        return (("content-type", "application/json"),), b"[" + b",".join(events) + b"]"

    flights, up = SingleFlight(assemble=assemble), Upstream()
    up.go.set()
    streamer = await flights.do("k", up.start, stream=True)
    whole = asyncio.create_task(flights.do("k", up.start, stream=False))
    up.send(b"data: 1\n\n", b"data: 2\n\n", END)

    reply = await whole
    assert reply.body == b"[1,2]" and reply.stream is None
    assert reply.headers == (("content-type", "application/json"),)
    assert await read_all(streamer) == b"data: 1\n\ndata: 2\n\n"


async def test_streaming_caller_does_not_join_a_whole_body_flight():
    flights, up = SingleFlight(), Upstream(stream=False)
    whole = asyncio.create_task(flights.do("k", up.start))
    await settle()
    streamer = asyncio.create_task(flights.do("k", up.start, stream=True))
    await settle()
    up.go.set()
    await asyncio.gather(whole, streamer)
    assert up.starts == 2 and flights.coalesced == 0


async def test_upstream_call_is_cancelled_only_when_every_waiting_client_has_gone():
    flights, up = SingleFlight(), Upstream()
    a = asyncio.create_task(flights.do("k", up.start, stream=True))
    b = asyncio.create_task(flights.do("k", up.start, stream=True))
    await settle()

    a.cancel()
    await settle()
    assert not up.cancelled.is_set() and flights.readers("k") == 1
    b.cancel()
    await settle()
    assert up.cancelled.is_set() and len(flights) == 0


async def test_stream_is_cancelled_when_the_last_reader_closes_not_before():
    flights, up = SingleFlight(), Upstream()
    up.go.set()
    a = await flights.do("k", up.start, stream=True)
    b = await flights.do("k", up.start, stream=True)
    up.send(b"x")
    await settle()

    assert a.close is not None and b.close is not None
    await a.close()
    await settle()
    assert not up.cancelled.is_set()
    await b.close()
    await settle()
    assert up.cancelled.is_set() and up.closed == 1


async def test_failure_of_the_shared_call_reaches_every_joiner():
    flights, up = SingleFlight(), Upstream()
    up.fail = UpstreamTimeout("no answer in 30 s")
    calls = [asyncio.create_task(flights.do("k", up.start, stream=s)) for s in (True, False, True)]
    await settle()
    up.go.set()
    results = await asyncio.gather(*calls, return_exceptions=True)

    assert [type(r) for r in results] == [UpstreamTimeout] * 3
    assert len(flights) == 0


async def test_cut_off_stream_errors_every_joiner_and_no_one_gets_it_as_whole():
    flights, up = SingleFlight(), Upstream()
    up.go.set()
    a = await flights.do("k", up.start, stream=True)
    b = await flights.do("k", up.start, stream=True)
    whole = asyncio.create_task(flights.do("k", up.start, stream=False))
    up.send(b"part 1", ConnectionResetError("peer reset"))

    for reply in (a, b):
        assert reply.stream is not None
        got = []
        with pytest.raises(UpstreamUnavailable):
            async for chunk in reply.stream:
                got.append(chunk)
        assert got == [b"part 1"]
    with pytest.raises(UpstreamUnavailable):
        await whole


async def test_slow_reader_is_dropped_without_holding_up_the_others():
    flights, up = SingleFlight(max_buffer_bytes=10), Upstream()
    up.go.set()
    slow = await flights.do("k", up.start, stream=True)
    fast = await flights.do("k", up.start, stream=True)
    up.send(b"aaaa", b"bbbb", b"cccc", b"dddd", END)

    assert await read_all(fast) == b"aaaabbbbccccdddd"
    assert slow.stream is not None
    with pytest.raises(SlowReader):
        await anext(slow.stream)
    assert flights.dropped == 1 and up.closed == 1


async def test_once_past_the_buffer_bound_new_callers_start_their_own_call():
    flights, up = SingleFlight(max_buffer_bytes=4), Upstream()
    up.go.set()
    first = await flights.do("k", up.start, stream=True)
    up.send(b"12345")
    await settle()

    other = Upstream(stream=False)
    other.go.set()
    second = await flights.do("k", other.start, stream=True)

    assert other.starts == 1 and second.body == b'{"ok":true}'
    up.send(END)
    assert await read_all(first) == b"12345"


async def test_coalesced_counter_callback_and_repr():
    seen = []
    flights, up = SingleFlight(name="chat", on_coalesced=lambda: seen.append(1)), Upstream()
    calls = [asyncio.create_task(flights.do("k", up.start, stream=True)) for _ in range(3)]
    await settle()

    assert (
        repr(flights) == "<SingleFlight chat in_flight=1 readers=3 started=1 coalesced=2 dropped=0>"
    )
    assert len(seen) == 2
    up.go.set()
    up.send(END)
    for reply in await asyncio.gather(*calls):
        await read_all(reply)
