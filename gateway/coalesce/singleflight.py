"""Single flight: concurrent requests with the same key share one upstream call.

The first caller of a key starts a *flight*: one task that runs the upstream call and, for a
stream, reads it into a shared append-only log of chunks.  Every caller of the key, the first
included, is a reader of that flight with its own cursor into the log:

- a streaming reader gets the chunks already sent (replayed from the start), then the live
  ones; a reader that wants a whole body gets ``assemble(status, headers, all_bytes)`` once
  the stream has ended (by default the bytes as they came, under the same headers);
- a whole-body upstream answer is handed to every reader as is; a streaming caller never
  joins a flight whose leader asked for a whole body (it makes its own call, uncounted);
- a failure of the call, or a stream cut off (the source raises), reaches every reader as
  the error itself (``UpstreamUnavailable`` for a foreign one), after the chunks it already
  had: no reader ever sees a partial answer end as if it were whole;
- the call is cancelled only when every reader has gone (a reader leaves when it is
  cancelled while waiting, when its stream's ``close`` runs, or when it has read to the end).

Slow readers.  The pump never waits for readers: they share the log (no per-reader copies),
so one slow reader cannot hold up the upstream or the others.  The log is bounded by
``max_buffer_bytes``: up to that size it is kept whole, so late joiners can replay it.  Past
it the flight takes no new joiners (a later caller starts its own call), and after each new
chunk the pump yields one turn of the event loop, so that every reader able to take more
does, and then drops any streaming reader still more than ``max_buffer_bytes`` behind (not
counting the newest chunk) with ``SlowReader``: a reader that stays that far behind is one
whose client is not reading.  Chunks every remaining reader has passed are released, so a
flight holds about ``max_buffer_bytes`` plus a chunk.  Whole-body readers are never dropped:
they collect every chunk as it comes, as a direct whole-body call would.

Whoever computes the key (the exact cache key, tenant scope included) decides what may be
shared; only deterministic requests should be coalesced.  A flight leaves the table as soon
as its call has ended: later requests are the cache's business.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from typing import Any

from gateway.errors import GatewayError, SlowReader, UpstreamUnavailable
from gateway.pipeline import Headers, Reply

DEFAULT_MAX_BUFFER_BYTES = 8 * 2**20

Start = Callable[[], Awaitable[Reply]]
Assemble = Callable[[int, Headers, bytes], tuple[Headers, bytes]]


def as_is(status: int, headers: Headers, body: bytes) -> tuple[Headers, bytes]:
    """The default assembler: a whole-body reader gets the stream's bytes under its headers."""
    return headers, body


class _Reader:
    __slots__ = ("dropped", "gone", "index", "offset", "whole")

    def __init__(self, whole: bool) -> None:
        self.whole = whole  # collects a whole body: never dropped, it needs every byte
        self.index = 0  # absolute number of the next chunk to read
        self.offset = 0  # bytes read so far
        self.dropped = False
        self.gone = False


class _Flight:
    """One shared upstream call and its log."""

    def __init__(self, key: Hashable, stream: bool) -> None:
        self.key = key
        self.stream = stream
        self.head: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self.chunks: deque[bytes] = deque()
        self.base = 0  # absolute number of chunks[0]
        self.base_offset = 0  # bytes released before chunks[0]
        self.size = 0  # bytes appended in all
        self.done = False
        self.error: BaseException | None = None
        self.readers: set[_Reader] = set()
        self.changed = asyncio.Event()
        self.open = True  # takes new joiners
        self.task: asyncio.Task[None] | None = None

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()


class SingleFlight:
    """A table of in-flight upstream calls by key; ``do`` joins one or starts it."""

    def __init__(
        self,
        *,
        name: str = "",
        max_buffer_bytes: int = DEFAULT_MAX_BUFFER_BYTES,
        assemble: Assemble = as_is,
        on_coalesced: Callable[[], None] | None = None,
    ) -> None:
        if max_buffer_bytes < 1:
            raise ValueError("max_buffer_bytes must be at least 1")
        self.name = name
        self._max_buffer = max_buffer_bytes
        self._assemble = assemble
        self._on_coalesced = on_coalesced
        self._flights: dict[Hashable, _Flight] = {}
        self.coalesced = 0
        self.started = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._flights)

    def readers(self, key: Hashable) -> int:
        """Callers attached to the flight of ``key`` now (0 when none is in flight)."""
        flight = self._flights.get(key)
        return len(flight.readers) if flight else 0

    async def do(self, key: Hashable, start: Start, *, stream: bool = False) -> Reply:
        """This caller's reply from the one upstream call for ``key``.

        ``start`` makes the call; it runs at most once per flight, in a task of its own.
        ``stream`` says whether this caller wants a stream (True) or a whole body.  The
        returned reply's ``coalesced`` says whether the caller joined a flight.
        A streamed reply must be closed (``reply.close``), as the edge always does.
        """
        flight = self._flights.get(key)
        if flight is not None and (not flight.open or (stream and not flight.stream)):
            return await start()
        joined = flight is not None
        if flight is None:
            flight = self._begin(key, start, stream)
        else:
            self.coalesced += 1
            if self._on_coalesced is not None:
                self._on_coalesced()
        reader = _Reader(whole=not stream)
        flight.readers.add(reader)
        try:
            head = await asyncio.shield(flight.head)
            if head.stream is None:
                self._leave(flight, reader)
                return _copy(head, head.body, joined)
            if stream:
                return Reply(
                    status=head.status,
                    headers=head.headers,
                    stream=self._read(flight, reader),
                    backend=head.backend,
                    close=lambda: self._close(flight, reader),
                    coalesced=joined,
                )
            parts = [chunk async for chunk in self._read(flight, reader)]
            headers, body = self._assemble(head.status, head.headers, b"".join(parts))
            return Reply(head.status, headers, body=body, backend=head.backend, coalesced=joined)
        except BaseException:
            self._leave(flight, reader)
            raise

    def _begin(self, key: Hashable, start: Start, stream: bool) -> _Flight:
        flight = _Flight(key, stream)
        self._flights[key] = flight
        self.started += 1
        flight.task = asyncio.get_running_loop().create_task(self._pump(flight, start))
        return flight

    async def _pump(self, flight: _Flight, start: Start) -> None:
        reply: Reply | None = None
        try:
            reply = await start()
            flight.head.set_result(reply)
            if reply.stream is not None:
                async for chunk in reply.stream:
                    if chunk:
                        await self._append(flight, chunk)
        except asyncio.CancelledError:
            flight.error = UpstreamUnavailable("the shared upstream call was cancelled")
            raise
        except GatewayError as exc:
            flight.error = exc
        except Exception as exc:
            error = UpstreamUnavailable(f"the shared upstream call failed: {exc!r}")
            error.__cause__ = exc
            flight.error = error
        finally:
            flight.done = True
            if not flight.head.done():
                flight.head.set_exception(flight.error or UpstreamUnavailable("no reply"))
                flight.head.exception()  # retrieved: readers may all have gone
            self._retire(flight)
            flight.notify()
            if reply is not None and reply.close is not None:
                await reply.close()

    async def _append(self, flight: _Flight, chunk: bytes) -> None:
        flight.chunks.append(chunk)
        flight.size += len(chunk)
        flight.notify()
        if flight.size <= self._max_buffer:
            return
        if flight.open:
            flight.open = False
            self._retire(flight)
        # Readers that can take more run before anyone is judged: only a reader that stays
        # blocked (its client is not reading) falls behind.  Lag excludes the newest chunk,
        # so one large chunk never drops a reader that was up to date.
        await asyncio.sleep(0)
        behind = flight.size - len(chunk) - self._max_buffer
        for reader in flight.readers:
            if not reader.dropped and not reader.whole and reader.offset < behind:
                reader.dropped = True
                self.dropped += 1
        self._release(flight)

    def _release(self, flight: _Flight) -> None:
        """Forget chunks every remaining reader has read (only once no one can join)."""
        if flight.open:
            return
        keep_from = min(
            (r.index for r in flight.readers if not r.dropped),
            default=flight.base + len(flight.chunks),
        )
        while flight.base < keep_from and flight.chunks:
            flight.base_offset += len(flight.chunks.popleft())
            flight.base += 1

    async def _read(self, flight: _Flight, reader: _Reader) -> AsyncIterator[bytes]:
        try:
            while True:
                if reader.dropped:
                    raise SlowReader("the client read the shared stream too slowly")
                at = reader.index - flight.base
                if at < len(flight.chunks):
                    chunk = flight.chunks[at]
                    reader.index += 1
                    reader.offset += len(chunk)
                    yield chunk
                    continue
                if flight.error is not None:
                    raise flight.error
                if flight.done:
                    return
                await flight.changed.wait()
        finally:
            self._leave(flight, reader)

    async def _close(self, flight: _Flight, reader: _Reader) -> None:
        self._leave(flight, reader)

    def _leave(self, flight: _Flight, reader: _Reader) -> None:
        if reader.gone:
            return
        reader.gone = True
        flight.readers.discard(reader)
        if not flight.readers and not flight.done and flight.task is not None:
            flight.task.cancel()
            self._retire(flight)
        else:
            self._release(flight)

    def _retire(self, flight: _Flight) -> None:
        if self._flights.get(flight.key) is flight:
            del self._flights[flight.key]

    def __repr__(self) -> str:
        readers = sum(len(f.readers) for f in self._flights.values())
        return (
            f"<SingleFlight {self.name or '-'} in_flight={len(self._flights)} "
            f"readers={readers} started={self.started} coalesced={self.coalesced} "
            f"dropped={self.dropped}>"
        )


def _copy(head: Reply, body: Any, joined: bool) -> Reply:
    return Reply(head.status, head.headers, body=body, backend=head.backend, coalesced=joined)
