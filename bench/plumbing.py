"""What the resilience benches share: backends, an exporter and the gateway as processes or
apps on this event loop, and a client with next to no cost of its own."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from aiohttp import web

from bench.common import free_port, wait_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
ANSWER = {
    "id": "c",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
}


class Backend:
    """A backend in this process: answers at once, fails with ``status``, or holds calls;
    records when each call arrived."""

    def __init__(self, status: int = 200, hold: bool = False) -> None:
        self.status = status
        self.hold = hold
        self.arrivals: list[float] = []
        self.arrived = asyncio.Event()
        self._held = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.chat)
        return app

    def release(self) -> None:
        self._held.set()

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.arrivals.append(time.perf_counter())
        self.arrived.set()
        if self.hold:
            await self._held.wait()
        if self.status != 200:
            return web.json_response({"error": {"message": "failing"}}, status=self.status)
        return web.json_response(ANSWER)


NATIVE_ANSWER = {"content": "ok", "stop": True, "tokens_predicted": 10, "tokens_evaluated": 3}
"""llama.cpp's ``/completion`` answer, its counts in its own words (as ``ANSWER``'s usage)."""


class Answering:
    """A model server answering each chat completion with ``answer`` (its ``status``) after
    ``delay_ms``, and each call of llama.cpp's own ``/completion`` with ``NATIVE_ANSWER``;
    counts the calls it got."""

    def __init__(
        self, delay_ms: float, answer: dict[str, Any] | None = None, status: int = 200
    ) -> None:
        self.delay_s = delay_ms / 1000
        self.answer = ANSWER if answer is None else answer
        self.status = status
        self.calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/completion", self.completion)
        return app

    async def chat(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        return web.json_response(self.answer, status=self.status)

    async def completion(self, request: web.Request) -> web.Response:
        await request.read()
        self.calls += 1
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        answer = NATIVE_ANSWER if self.status == 200 else self.answer  # a refusal is one
        return web.json_response(answer, status=self.status)


class Exporter:
    """A DCGM exporter whose temperature the bench sets."""

    def __init__(self) -> None:
        self.temperature = 50.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        return app

    async def metrics(self, request: web.Request) -> web.Response:
        labels = 'gpu="0",UUID="GPU-1"'
        return web.Response(text=f"DCGM_FI_DEV_GPU_TEMP{{{labels}}} {self.temperature}\n")


@contextlib.asynccontextmanager
async def serving(*apps: web.Application) -> AsyncIterator[list[str]]:
    runners = []
    urls = []
    try:
        for app in apps:
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
            await runner.setup()
            port = free_port()
            await web.TCPSite(runner, "127.0.0.1", port).start()
            runners.append(runner)
            urls.append(f"http://127.0.0.1:{port}")
        yield urls
    finally:
        for runner in runners:
            await runner.cleanup()


@contextlib.asynccontextmanager
async def gateway(policy: dict[str, Any], admin_port: int | None = None) -> AsyncIterator[str]:
    """``gateway serve`` on a free port with ``policy``; yields its URL.  Waits happen off the
    event loop: the backends it talks to live on that loop."""
    policy = {**policy, "server": {"shutdown_grace_s": 1, **policy.get("server", {})}}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "policy.yaml"
        file.write_text(yaml.safe_dump(policy))
        port, admin = free_port(), admin_port or free_port()
        args = [
            *(sys.executable, "-m", "gateway", "--log-level", "error", "serve"),
            *("--policy", str(file), "--port", str(port), "--admin-port", str(admin)),
        ]
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            await asyncio.to_thread(wait_port, port)
            yield f"http://127.0.0.1:{port}"
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            await asyncio.wait_for(proc.wait(), 15)


class RawClient:
    """One keep-alive HTTP/1.1 connection with next to no client-side cost."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.host, self.port = host, int(port)
        body = json.dumps(CHAT).encode()
        self.request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    async def __aenter__(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def post(self) -> tuple[int, dict[str, str]]:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                headers[k.strip().lower()] = v.strip()
        self.body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return int(lines[0].split()[1]), headers


def pcts(samples: list[float]) -> tuple[float, float, float]:
    s = sorted(samples)
    return statistics.median(s), s[int(0.99 * (len(s) - 1))], s[-1]


Runs = dict[str, list[dict[str, float]]]
"""Each path's figures, one mapping a round."""


async def closed_loop(
    urls: list[str],
    path: str,
    body: Callable[[], Any],
    duration_s: float,
    connections: int,
    headers: dict[str, str] | None = None,
) -> tuple[list[float], float, int]:
    """``connections`` clients, connection ``i`` to ``urls[i % len(urls)]``, each posting
    ``body()`` (JSON, or bytes as they are) with ``headers`` to ``path`` and waiting for the
    answer before the next: the latencies (ms) of the 200s, the seconds it took, and the
    answers other than 200."""
    latencies: list[float] = []
    failed = 0
    stop = time.perf_counter() + duration_s

    async def client(url: str, session: aiohttp.ClientSession) -> None:
        while time.perf_counter() < stop:
            started = time.perf_counter()
            payload = body()
            sent = {"data": payload} if isinstance(payload, bytes) else {"json": payload}
            async with session.post(url + path, headers=headers, **sent) as answer:
                await answer.read()
                if answer.status == 200:
                    latencies.append((time.perf_counter() - started) * 1000)
                else:
                    nonlocal failed
                    failed += 1

    began = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(urls[i % len(urls)], session) for i in range(connections)))
    return latencies, time.perf_counter() - began, failed


Load = Callable[[list[str], float, int], Awaitable[dict[str, float]]]
"""A closed-loop load on some URLs for some seconds over some connections: its figures,
``answers`` among them."""


def chat_load(body: dict[str, Any]) -> Load:
    """The closed-loop load posting ``body`` to chat completions: its figures, with the
    answers other than 200 as ``failed``."""

    async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
        latencies, elapsed, failed = await closed_loop(
            urls, "/v1/chat/completions", lambda: body, duration_s, connections
        )
        figures = figures_of(latencies, elapsed)
        figures["failed"] = float(failed)
        return figures

    return load


async def rounds_of(
    paths: dict[str, list[str]],
    load: Load,
    calls: Callable[[], int],
    duration_s: float,
    rounds: int,
    connections: int,
) -> Runs:
    """``rounds`` of ``load`` on each path in turn; each round's figures also give the
    upstream calls per 100 answers (``calls()``: the backends' calls so far)."""
    runs: Runs = {name: [] for name in paths}
    for _ in range(rounds):
        for name, targets in paths.items():
            before = calls()
            figures = await load(targets, duration_s, connections)
            figures["calls"] = 100 * (calls() - before) / max(1, figures["answers"])
            runs[name].append(figures)
    return runs


def figures_of(latencies: list[float], elapsed: float) -> dict[str, float]:
    """Answers, answers a second and latency percentiles (p50, p99, p99.9) of one load."""
    s = sorted(latencies)
    return {
        "answers": len(s),
        "rps": len(s) / elapsed,
        "p50": statistics.median(s),
        "p99": s[int(0.99 * (len(s) - 1))],
        "p999": s[int(0.999 * (len(s) - 1))],
    }


def medians(runs: Runs, columns: Sequence[tuple[str, str, str]]) -> list[str]:
    """A markdown table of each path's median figures over its rounds; ``columns`` are
    (heading, figure, format spec)."""
    return [
        "| path | " + " | ".join(heading for heading, _, _ in columns) + " |",
        "|---" * (len(columns) + 1) + "|",
        *(
            f"| {name} | "
            + " | ".join(
                format(statistics.median(r[key] for r in rounds), spec) for _, key, spec in columns
            )
            + " |"
            for name, rounds in runs.items()
        ),
    ]


def rounds_args(doc: str, duration_s: float, connections: int) -> argparse.Namespace:
    """``--duration``, ``--rounds``, ``--connections`` of a bench whose paths take turns."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--duration", type=float, default=duration_s)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=connections)
    return parser.parse_args()


def run_rounds(
    doc: str,
    duration_s: float,
    connections: int,
    main: Callable[[float, int, int], Coroutine[Any, Any, list[str]]],
) -> tuple[argparse.Namespace, list[str]]:
    """A rounds bench's ``__main__``: its arguments (``rounds_args``), ``main`` run with them,
    and its table, printed and returned for ``update_section``."""
    args = rounds_args(doc, duration_s, connections)
    lines = asyncio.run(main(args.duration, args.rounds, args.connections))
    print("\n".join(lines))
    return args, lines


ANSWERS_S = ("answers/s", "rps", ".0f")
P50_MS = ("p50 ms", "p50", ".1f")
P99_MS = ("p99 ms", "p99", ".1f")
CALLS_PER_100 = ("upstream calls per 100 answers", "calls", ".1f")
"""Columns most rounds benches show (``medians``): label, figure, format."""


def rounds_command(module: str, args: argparse.Namespace) -> str:
    """The command line that ran ``bench.<module>`` with ``rounds_args``' ``args``."""
    return (
        f"python -m bench.{module} --duration {args.duration:g} --rounds {args.rounds} "
        f"--connections {args.connections}"
    )
