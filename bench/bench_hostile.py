"""Hostile inputs against ``gateway serve`` at its default limits (issue 23): what each costs
the gateway in memory and in event-loop time, and whether others are still served.

Each probe runs against a fresh gateway process (so its peak RSS, ``VmHWM``, is the probe's)
in front of a small backend process; beside it a sampler process sends a tiny proxied
request every 20 ms, and the worst of their latencies, less the quiet median, is what the
probe stalled the gateway's loop.  The attacks come from this process.

    python -m bench.bench_hostile [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
from aiohttp import web

from bench.common import free_port, machine, update_section, wait_port

MiB = 1024 * 1024
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"


class Backend:
    """Answers chat, models, and (``/trailers``) a chunked answer with huge trailers; run as
    a process of its own (``--backend``)."""

    def __init__(self, port: int | None = None, trailer_port: int | None = None) -> None:
        self.port = port or free_port()
        self.trailer_port = trailer_port or free_port()

    async def serve(self) -> None:
        await self.start()
        await asyncio.Event().wait()

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * MiB)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/v1/models", self.models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.port).start()
        await asyncio.start_server(self.trailers, "127.0.0.1", self.trailer_port)

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"id": "c", "bytes": len(body), "choices": []})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def trailers(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-Pad: "
            )
            piece = b"p" * MiB
            for _ in range(200):  # 200 MiB of one trailer field
                writer.write(piece)
                await writer.drain()
            writer.write(b"\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        writer.close()


class Gateway:
    """A ``gateway serve`` process at the default limits."""

    def __init__(self, backend: Backend, policy_dir: Path, cached: bool = False) -> None:
        self.port = free_port()
        self.admin = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        policy = policy_dir / f"policy-{self.port}.yaml"
        cache = ", cache: {ttl_s: 60, semantic: {method: embedding}}" if cached else ""
        policy.write_text(
            f"backends:\n  main: {{url: 'http://127.0.0.1:{backend.port}'}}\n"
            f"  raw: {{url: 'http://127.0.0.1:{backend.trailer_port}'}}\n"
            "routes:\n  - {match: {path: /trailers}, backend: raw}\n"
            f"  - {{backend: main{cache}}}\n"
        )
        self.args = [
            sys.executable, "-m", "gateway", "serve", "--policy", str(policy),
            "--port", str(self.port), "--admin-port", str(self.admin),
        ]  # fmt: skip
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> Gateway:
        self.proc = await asyncio.create_subprocess_exec(
            *self.args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
        )
        await asyncio.to_thread(wait_port, self.port)
        async with httpx.AsyncClient() as client:
            await client.post(self.url + "/v1/chat/completions", json=CHAT)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.kill()
        await self.proc.wait()

    async def lag_counts(self) -> dict[float, float]:
        """The gateway's event-loop lag histogram: cumulative count per bucket bound."""
        async with httpx.AsyncClient() as client:
            text = (await client.get(f"http://127.0.0.1:{self.admin}/metrics")).text
        counts = {}
        for line in text.splitlines():
            if line.startswith("gateway_event_loop_lag_seconds_bucket"):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                counts[float(bound)] = float(line.rsplit(" ", 1)[1])
        return counts

    def kib(self, field: str) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        return 0


async def raw(url: str, data: bytes | Callable[[asyncio.StreamWriter], Awaitable[None]]) -> int:
    """Send a raw request; the answer's status (0 for none)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        if isinstance(data, bytes):
            writer.write(data)
            await writer.drain()
        else:
            await data(writer)
        answer = await asyncio.wait_for(reader.read(64), 120)
    except (ConnectionError, TimeoutError):
        answer = b""
    writer.close()
    return int(answer[9:12]) if answer[:5] == b"HTTP/" else 0


async def sampled(url: str, stop: asyncio.Event) -> list[float]:
    """The latencies the sampler process saw until ``stop``."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.bench_hostile", "--sample", url,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    await stop.wait()
    out, _ = await proc.communicate(b"stop\n")
    return [float(x) for x in out.split()]


async def sample(url: str) -> None:
    """The sampler process: tiny requests until stdin says stop; latencies on stdout."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(sys.stdin.fileno(), stop.set)
    latencies = await tiny_latencies(url, stop)
    print(" ".join(f"{x:.6f}" for x in latencies))


async def tiny_latencies(url: str, stop: asyncio.Event) -> list[float]:
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=60) as client:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                await client.get(url + "/v1/models")
            except httpx.TransportError:
                # At max_connections the gateway closes the connection idle longest (this
                # one, between its requests) to make room; a client opens another.
                continue
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(0.02)
    return latencies


async def probe(
    backend: Backend,
    tmp: Path,
    name: str,
    attack: Callable[[Gateway], Awaitable[str]],
    cached: bool = False,
) -> dict[str, Any]:
    async with Gateway(backend, tmp, cached) as gw:
        quiet_stop = asyncio.Event()
        quiet_task = asyncio.ensure_future(sampled(gw.url, quiet_stop))
        await asyncio.sleep(2.0)
        quiet_stop.set()
        quiet = statistics.median(await quiet_task)
        before = gw.kib("VmRSS")
        lags_before = await gw.lag_counts()
        stop = asyncio.Event()
        beside = asyncio.ensure_future(sampled(gw.url, stop))
        await asyncio.sleep(1.0)  # the sampler started
        started = time.perf_counter()
        outcome = await attack(gw)
        took = time.perf_counter() - started
        stop.set()
        latencies = await beside
        grown = (gw.kib("VmHWM") - before) / 1024
        lags = await gw.lag_counts()
    stall_ms = (max(latencies) - quiet) * 1000
    # The loop's own timer, due every 0.25 s: the bucket its latest-running tick fell in
    # (the first whose count grew by as much as every tick's).
    bounds = sorted(lags)
    grew = {b: lags[b] - lags_before.get(b, 0.0) for b in bounds}
    total = grew[bounds[-1]] if bounds else 0.0
    first = next((i for i, b in enumerate(bounds) if total and grew[b] == total), None)
    lag_ms = "-"
    if first is not None:
        low = bounds[first - 1] * 1000 if first else 0.0
        lag_ms = f"{low:g}-{bounds[first] * 1000:g}"
    print(
        f"{name}: {outcome}; +{grown:.0f} MiB, loop lag {lag_ms} ms, beside {stall_ms:.0f} ms",
        flush=True,
    )
    return {
        "name": name, "outcome": outcome, "mib": grown, "stall_ms": stall_ms,
        "lag_ms": lag_ms, "s": took,
    }  # fmt: skip


def two_byte_chunks(size: int) -> bytes:
    body = json.dumps({**CHAT, "metadata": {"note": "x" * (size - 100)}}).encode()
    chunks = b"".join(
        b"%x\r\n%s\r\n" % (len(body[i : i + 2]), body[i : i + 2]) for i in range(0, len(body), 2)
    )
    return HEAD + b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + chunks + b"0\r\n\r\n"


async def run(quick: bool, only: str | None = None) -> list[dict[str, Any]]:
    backend = Backend()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.bench_hostile",
        "--backend", str(backend.port), str(backend.trailer_port),
    )  # fmt: skip
    await asyncio.to_thread(wait_port, backend.port)
    try:
        return await probes(backend, quick, only)
    finally:
        process.kill()
        await process.wait()


async def probes(backend: Backend, quick: bool, only: str | None) -> list[dict[str, Any]]:
    tmp = Path("/tmp") / f"bench-hostile-{backend.port}"
    tmp.mkdir(exist_ok=True)
    size = 2 * MiB if quick else 8 * MiB
    results = []

    async def add(
        name: str, attack: Callable[[Gateway], Awaitable[str]], cached: bool = False
    ) -> None:
        if only is None or only in name:
            results.append(await probe(backend, tmp, name, attack, cached))

    async def chunks(gw: Gateway) -> str:
        data = two_byte_chunks(size)
        statuses = await asyncio.gather(*(raw(gw.url, data) for _ in range(4)))
        return f"statuses {sorted(statuses)}"

    await add(f"4 x {size // MiB} MiB in 2-byte chunks", chunks)

    async def wide(gw: Gateway) -> str:
        body = b'{"model": "m", "messages": [], "x": [' + b"{}," * (5 * MiB) + b"{}]}"
        data = HEAD + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        statuses = await asyncio.gather(*(raw(gw.url, data) for _ in range(2)))
        return f"statuses {sorted(statuses)}"

    await add("2 x 15 MiB of {} (5M values)", wide)

    async def prose(gw: Gateway) -> str:
        text = "Summarise this, please: [a], {b}, c. " * (15 * MiB // 38)
        body = json.dumps({**CHAT, "messages": [{"role": "user", "content": text}]}).encode()
        data = HEAD + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
        return f"status {await raw(gw.url, data)} ({len(body) / MiB:.1f} MiB)"

    await add("a 15 MiB chat body (within limits)", prose)

    async def cached_prose(gw: Gateway) -> str:
        """Two long prompts alike, on a route with the semantic cache (SimHash and the
        embedding tier): a message this long gets the exact tier only."""
        statuses = []
        for ending in ("Who signed it?", "When was it signed?"):
            text = "Summarise this contract, please: [a], {b}, c. " * (15 * MiB // 48) + ending
            message = {"role": "user", "content": text}
            body = json.dumps({**CHAT, "temperature": 0, "messages": [message]}).encode()
            data = HEAD + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body
            statuses.append(await raw(gw.url, data))
        return f"statuses {statuses}"

    await add("2 x 15 MiB chat prompts, semantic cache on", cached_prose, cached=True)

    async def trailers(gw: Gateway) -> str:
        status = await raw(gw.url, b"GET /trailers HTTP/1.1\r\nHost: gw\r\n\r\n")
        return f"status {status}"

    await add("200 MiB of response trailers", trailers)

    async def slow_uploads(gw: Gateway) -> str:
        async def upload(writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"Content-Length: %d\r\n\r\n" % (16 * MiB))
            for _ in range(16 * MiB // (256 * 1024) - 1):
                writer.write(b"x" * (256 * 1024))
                await writer.drain()
            for _ in range(60 if not quick else 8):  # then a byte every 2 s
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(2)

        uploads = [asyncio.ensure_future(raw(gw.url, upload)) for _ in range(4)]
        await asyncio.sleep(4)
        async with httpx.AsyncClient(timeout=60) as client:
            started = time.perf_counter()
            normal = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
            waited = time.perf_counter() - started
        statuses = await asyncio.gather(*uploads)
        return f"normal POST {normal.status_code} in {waited:.2f} s; uploads {sorted(statuses)}"

    await add("4 slow 16 MiB uploads + a normal POST", slow_uploads)

    async def slow_connections(gw: Gateway) -> str:
        async def body(writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"Content-Length: 1000\r\n\r\n")
            for _ in range(40 if not quick else 5):
                await asyncio.sleep(2)
                writer.write(b"x")
                await writer.drain()

        slow = [asyncio.ensure_future(raw(gw.url, body)) for _ in range(1030)]
        await asyncio.sleep(3)
        async with httpx.AsyncClient(timeout=60) as client:
            started = time.perf_counter()
            status: int | str
            try:
                r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
                status = r.status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            waited = time.perf_counter() - started
        for task in slow:
            task.cancel()
        await asyncio.gather(*slow, return_exceptions=True)
        return f"new client {status} in {waited:.2f} s"

    await add("1,030 slow-body connections + a new client", slow_connections)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller bodies, shorter trickles")
    parser.add_argument("--only", help="run the probes whose name holds this (docs unchanged)")
    parser.add_argument("--sample", help=argparse.SUPPRESS)
    parser.add_argument("--backend", nargs=2, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.sample:
        asyncio.run(sample(args.sample))
        return 0
    if args.backend:
        asyncio.run(Backend(*args.backend).serve())
        return 0
    results = asyncio.run(run(args.quick, args.only))
    if args.only:
        return 0
    command = "python -m bench.bench_hostile" + (" --quick" if args.quick else "")
    rows = "\n".join(
        f"| {r['name']} | {r['outcome']} | {r['mib']:+.0f} MiB | {r['lag_ms']} ms "
        f"| {r['stall_ms']:.0f} ms |"
        for r in results
    )
    update_section(
        "hostile",
        f"""## Hostile inputs at the default limits (issue 23)

`{command}` on {machine()}. Each probe against a fresh `gateway serve` at the default
`server:` limits; the peak RSS growth is its `VmHWM` over its RSS before; the loop lag is
the bucket of `gateway_event_loop_lag_seconds` (a timer of the gateway's own, due every
0.25 s) that its latest tick fell in during the probe: the longest the loop was held; beside
is the worst latency of a tiny proxied request sent every 20 ms from another process, less
the quiet median (it also waits its turn among the attack's connections). Targets: RSS
growth <= 150 MiB, no single request holding the loop over 100 ms, others served within 5 s.

| probe | outcome | peak RSS | loop lag | beside |
|---|---|---|---|---|
{rows}
""",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
