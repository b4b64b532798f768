"""Load for the real-model bench (``bench/bench_llama.py``): chat requests to llama.cpp's
server, directly or through the gateway, closed loop (a fixed number of clients) or open
loop (on a fixed schedule, each request timed from the moment it was due), with what each
request measured: its status, its latency, its time to first token when streamed."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.testing.llama import MODEL_ALIAS

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Outcome:
    """What the requests of one run measured."""

    statuses: list[int] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)  # answered 200
    ttfts_ms: list[float] = field(default_factory=list)  # streamed and answered 200
    refused_ms: list[float] = field(default_factory=list)  # answered 503
    failures: list[str] = field(default_factory=list)  # what went wrong, but for 503s
    completion_tokens: int = 0
    elapsed_s: float = 0.0

    @property
    def ok(self) -> int:
        return self.statuses.count(200)

    @property
    def errors(self) -> int:
        return len(self.statuses) - self.ok

    def failed(self) -> str:
        """The failures but for 503s, counted by kind: "2 ReadTimeout", or "0"."""
        kinds = sorted(set(self.failures))
        return ", ".join(f"{self.failures.count(k)} {k}" for k in kinds) or "0"

    def rate(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def chat(system: str | None, user: str, max_tokens: int, *, stream: bool = False) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    body: dict[str, Any] = {
        "model": MODEL_ALIAS,
        "messages": [*messages, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def send(
    http: httpx.AsyncClient,
    url: str,
    body: dict,
    outcome: Outcome,
    due: float,
    path: str = CHAT_PATH,
) -> None:
    """One request to ``path``, timed from ``due`` (a perf_counter time); streamed when the
    body says (OpenAI's chat, or llama.cpp's own ``/completion``)."""
    try:
        if body.get("stream"):
            async with http.stream("POST", url + path, json=body) as reply:
                first = None
                async for line in reply.aiter_lines():
                    if first is None and '"content":"' in line:
                        first = time.perf_counter()
                    last = '"usage":{' in line or '"stop":true' in line  # llama.cpp's last
                    if line.startswith("data: {") and last:
                        event = json.loads(line[6:])
                        counted = (event.get("usage") or {}).get("completion_tokens")
                        outcome.completion_tokens += counted or event.get("tokens_predicted", 0)
                status = reply.status_code
                if status == 200 and first is not None:
                    outcome.ttfts_ms.append((first - due) * 1000)
        else:
            reply = await http.post(url + path, json=body)
            status = reply.status_code
            if status == 200:
                answer = reply.json()  # OpenAI's usage, or llama.cpp's own count
                counted = answer.get("usage", {}).get("completion_tokens")
                outcome.completion_tokens += counted or answer.get("tokens_predicted", 0)
    except httpx.HTTPError as exc:
        status = 0
        outcome.failures.append(type(exc).__name__)
    outcome.statuses.append(status)
    took_ms = (time.perf_counter() - due) * 1000
    if status == 200:
        outcome.latencies_ms.append(took_ms)
    elif status == 503:
        outcome.refused_ms.append(took_ms)
    elif status:
        outcome.failures.append(str(status))


async def closed_loop(
    url: str | Sequence[str],
    bodies: Sequence[dict],
    clients: int,
    timeout_s: float = 300,
    path: str = CHAT_PATH,
) -> Outcome:
    """``bodies`` to ``path`` in order, ``clients`` at a time; several URLs are taken in
    turn."""
    outcome = Outcome()
    pending = iter(enumerate(bodies))
    urls = [url] if isinstance(url, str) else list(url)

    async def client(http: httpx.AsyncClient) -> None:
        for index, body in pending:
            await send(http, urls[index % len(urls)], body, outcome, time.perf_counter(), path)

    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        outcome.elapsed_s = time.perf_counter() - started
    return outcome


async def open_loop(
    url: str, bodies: Sequence[dict], rate_per_s: float, timeout_s: float
) -> Outcome:
    """``bodies`` sent at ``rate_per_s`` (Poisson arrivals, seeded), whatever the answers."""
    outcome = Outcome()
    rng = random.Random(11)
    limits = httpx.Limits(max_connections=len(bodies))
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as http:
        started = time.perf_counter()
        due = started
        tasks = []
        for body in bodies:
            due += rng.expovariate(rate_per_s)
            await asyncio.sleep(max(0.0, due - time.perf_counter()))
            tasks.append(asyncio.create_task(send(http, url, body, outcome, due)))
        await asyncio.gather(*tasks)
        outcome.elapsed_s = time.perf_counter() - started
    return outcome
