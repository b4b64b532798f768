"""Hedged requests (``backends.<name>.hedge``): what a second endpoint asked after the usual
time saves the tail of a fleet whose instances stall now and then.

    python -m bench.bench_hedge [--duration 10] [--rounds 3] [--connections 8]

Three model servers: an embedding call, or a stream's first token, takes ``SERVICE_MS``
(a stream's head comes at once, its ``TOKENS`` tokens ``TOKEN_MS`` apart), and each server
now and then stalls for ``STALL_MS`` (a garbage collection, a noisy neighbour, a GPU
throttling its clocks), holding every request it has meanwhile: a stall starts on a request
with probability ``STALL_P`` when none is running.  Clients send single-input embedding
calls, then streamed chat completions, over keep-alive connections, each answered before
the next.  The paths, taking turns in each round:

- direct: each client connection to one server, in turn (what a Service's round robin
  does);
- the gateway (a process of its own) over the three as endpoints, ``least_request``;
- embeddings: the same with ``hedge: {}`` (after the 95th percentile of recent answer
  times, at most 5% more calls), and with ``hedge: {after_ms: HEDGE_MS, max_ratio: 0.1}``;
- streams: the same with ``hedge: {answers: false, streams: true}``, and with
  ``after_ms: HEDGE_MS, max_ratio: 0.1`` too: hedged on their first chunk.

Each row gives answers (streams) a second, their latency (a stream's: to its first chunk;
p50, p99, p99.9), and upstream calls per 100 answers (the hedges' extra load).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import aiohttp
from aiohttp import web

from bench.common import machine, update_section
from bench.plumbing import (
    ANSWERS_S,
    CALLS_PER_100,
    P50_MS,
    P99_MS,
    closed_loop,
    figures_of,
    gateway,
    medians,
    rounds_command,
    rounds_of,
    run_rounds,
    serving,
)

SERVICE_MS = 4.0
STALL_MS = 50.0
STALL_P = 0.008
HEDGE_MS = 15
TOKENS = 8
TOKEN_MS = 2.0
TOKEN = b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n'
STREAM = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
EMBEDDING = {"object": "list", "data": [{"object": "embedding", "index": 0, "embedding": [1.0]}]}


class StallingServer:
    """An embedding server that answers in ``SERVICE_MS`` and now and then stalls."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._stalled_until = 0.0
        self.calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.embed)
        app.router.add_post("/v1/chat/completions", self.chat)
        return app

    async def embed(self, request: web.Request) -> web.Response:
        await request.read()
        await self._work()
        return web.json_response(EMBEDDING)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        """A stream: the head at once, the first token after the prefill (and any stall),
        then ``TOKENS`` more, ``TOKEN_MS`` apart."""
        await request.read()
        stream = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await stream.prepare(request)
            await self._work()
            for _ in range(TOKENS):
                await stream.write(TOKEN)
                await asyncio.sleep(TOKEN_MS / 1000)
            await stream.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            pass  # a hedge's loser: the gateway hung up at the winner's first chunk (or head)
        return stream

    async def _work(self) -> None:
        """``SERVICE_MS``, after the stall this call starts or finds."""
        self.calls += 1
        now = time.perf_counter()
        if now >= self._stalled_until and self._rng.random() < STALL_P:
            self._stalled_until = now + STALL_MS / 1000
        await asyncio.sleep(max(0.0, self._stalled_until - now) + SERVICE_MS / 1000)


def policy(urls: list[str], hedge: dict[str, Any] | None) -> dict[str, Any]:
    backend: dict[str, Any] = {"endpoints": urls}
    if hedge is not None:
        backend["hedge"] = hedge
    return {
        "backends": {"fleet": backend},
        "routes": [{"match": {"path": "/v1/*"}, "backend": "fleet"}],
    }


async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
    """Single-input embedding calls on ``connections`` connections."""
    body = {"model": "embedder", "input": "hello"}
    latencies, elapsed, _ = await closed_loop(
        urls, "/v1/embeddings", lambda: body, duration_s, connections
    )
    return figures_of(latencies, elapsed)


async def stream_load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
    """Streamed chat completions on ``connections`` connections: the time to each stream's
    first chunk."""
    firsts: list[float] = []
    stop = time.perf_counter() + duration_s

    async def client(url: str, session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            async with session.post(url + "/v1/chat/completions", json=STREAM) as answer:
                await answer.content.readany()
                firsts.append((time.perf_counter() - started) * 1000)
                await answer.read()

    began = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(urls[i % len(urls)], session) for i in range(connections)))
    return figures_of(firsts, time.perf_counter() - began)


STREAMS_ONLY = {"answers": False, "streams": True}


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    servers = [StallingServer(seed) for seed in range(3)]
    fixed = {"after_ms": HEDGE_MS, "max_ratio": 0.1}
    async with serving(*(s.app() for s in servers)) as urls:
        async with (
            gateway(policy(urls, None)) as plain,
            gateway(policy(urls, {})) as adaptive,
            gateway(policy(urls, fixed)) as early,
            gateway(policy(urls, STREAMS_ONLY)) as streams,
            gateway(policy(urls, {**STREAMS_ONLY, **fixed})) as early_streams,
        ):
            answers = {
                "direct, each connection to one server": urls,
                "gateway, no hedge": [plain],
                "gateway, `hedge: {}` (p95 of recent answers, at most 5% more calls)": [adaptive],
                f"gateway, `hedge: {{after_ms: {HEDGE_MS}, max_ratio: 0.1}}`": [early],
            }
            firsts = {
                "direct, each connection to one server": urls,
                "gateway, no hedge": [plain],
                "gateway, `hedge: {answers: false, streams: true}`": [streams],
                f"gateway, the same with `after_ms: {HEDGE_MS}, max_ratio: 0.1`": [early_streams],
            }
            for target in (plain, adaptive, early):  # connections made, answer times learned
                await load([target], 1.0, connections)
            for target in (streams, early_streams):
                await stream_load([target], 1.0, connections)

            def calls() -> int:
                return sum(s.calls for s in servers)

            whole = await rounds_of(answers, load, calls, duration_s, rounds, connections)
            streamed = await rounds_of(firsts, stream_load, calls, duration_s, rounds, connections)
    return [
        *medians(whole, COLUMNS),
        "",
        "Streamed chat completions, the time to the first chunk:",
        "",
        *medians(streamed, STREAM_COLUMNS),
    ]


COLUMNS = (
    ANSWERS_S,
    P50_MS,
    P99_MS,
    ("p99.9 ms", "p999", ".1f"),
    CALLS_PER_100,
)
STREAM_COLUMNS = (
    ("streams/s", "rps", ".0f"),
    ("first chunk p50 ms", "p50", ".1f"),
    P99_MS,
    ("p99.9 ms", "p999", ".1f"),
    ("upstream calls per 100 streams", "calls", ".1f"),
)


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 10.0, 8, main)
    command = rounds_command("bench_hedge", args)
    update_section(
        "hedge",
        "## Hedged requests (`backends.<name>.hedge`)\n\n"
        f"`{command}` on {machine()}. Three model servers answer an embedding call, or a "
        f"stream's first token, in {SERVICE_MS:g} ms (a stream's head at once, its {TOKENS} "
        f"tokens {TOKEN_MS:g} ms apart); each stalls now and then for {STALL_MS:g} ms, "
        f"holding every request it has meanwhile (a stall starts on {STALL_P:.1%} of the "
        f"requests arriving while none runs). {args.connections} connections send "
        "single-input embedding calls, then streamed chat completions, each answered before "
        "the next; the gateways run as processes of their own. Each figure is the median "
        "over the rounds, in which the paths take turns.\n\n" + "\n".join(lines),
    )
