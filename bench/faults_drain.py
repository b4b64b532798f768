"""Issue 24's drain under load: closed-loop clients, streams and whole answers, against a
paced backend behind ``max_concurrency`` and a queue, pipelined pairs on a few connections,
and a SIGTERM mid-load; every request's answer as its client saw it, and whether the
gateway read those that got none (its access log, and the ids the backend saw)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.plumbing import ANSWER, CHAT, serving
from bench.rawhttp import (
    Answer,
    Conn,
    GatewayProcess,
    NoAnswer,
    chunk,
    events,
    post,
    stream_answer,
)

GRACE_S = 2.0
STEP_S = 0.1
"""One streamed chunk of the drain's backend, or a tenth of a whole answer's time."""
MAX_STEPS = 60
"""The drain's answers take 0.2 s to 6 s: some are cut at the deadline."""
PIPELINED = 4
CUT_RACE = "the connection of a stream cut at the deadline, as the drain closed it"


class PacedBackend:
    """Chat answers that take ``max_tokens`` steps (streamed a chunk a step, or whole at the
    end); records when it saw each request id."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen[request.headers.get("X-Request-ID", "")] = time.perf_counter()
        steps = int(body.get("max_tokens", 1))
        if not body.get("stream"):
            await asyncio.sleep(steps * STEP_S)
            return web.json_response(ANSWER)
        parts = [chunk("x") for _ in range(steps - 1)]
        return await stream_answer(
            request, [*parts, chunk("", "stop") + b"data: [DONE]\n\n"], STEP_S
        )


@dataclass(slots=True)
class Sent:
    """One request of a drain's client: when it went, when its answer ended, how, and the
    request before it on the same connection (None: a new connection)."""

    id: str
    stream: bool
    at: float
    previous: Sent | None
    done: float = 0.0
    outcome: str = ""


def outcome(answer: Answer, stream: bool) -> str:
    """How one answer of the drain ended, as its client sees it."""
    if answer.status == 503:
        if "before this answer was complete" in answer.error_message():
            return "503 cut at the deadline"
        return "503 refused"
    if answer.status != 200 or not answer.whole:
        return f"{answer.status} cut" if not answer.whole else f"{answer.status}"
    if not stream:
        return "200 whole answer"
    last = events(answer.body)[-1:] or [b""]
    if last == [b"[DONE]"]:
        return "200 stream, complete"
    if last[0].startswith(b"{") and b'"error"' in last[0]:
        return "stream ended by an error event"
    return "stream cut without an error event"


def where(item: Sent, signalled: float) -> str:
    """Which connection a request went on, for those left without an answer."""
    previous = item.previous
    if previous is None:
        return "a new connection"
    if previous.done < signalled:
        return "a connection idle at SIGTERM"
    if previous.outcome == "stream ended by an error event":
        return CUT_RACE
    return "a connection whose answer ended in the drain, kept alive"


async def drain_run(tmp: Path, clients: int, load_s: float, seed: int) -> dict[str, Any]:
    backend = PacedBackend()
    async with serving(backend.app()) as (url,):
        queue = f"{{capacity: {4 * clients}, timeout_ms: 60000}}"
        policy = f"""server: {{shutdown_grace_s: {GRACE_S}}}
backends:
  main: {{url: "{url}", max_concurrency: {clients // 2}, queue: {queue}}}
  pipe: {{url: "{url}"}}
routes:
  - {{name: pipe, match: {{path: "/pipe/*"}}, backend: pipe}}
  - {{name: chat, match: {{path: /v1/chat/completions}}, backend: main}}
"""
        sent: list[Sent] = []
        refused = closed_idle = 0
        async with GatewayProcess(tmp, policy, access_log=True) as gw:

            async def client(n: int, stream: bool) -> None:
                nonlocal refused, closed_idle
                rng = random.Random(seed * 1000 + n)
                conn: Conn | None = None
                previous: Sent | None = None
                for i in range(10**6):
                    if conn is not None and await conn.closed_by_peer():
                        closed_idle += 1  # a pooled client opens another
                        conn.close()
                        conn = None
                    if conn is None:
                        try:
                            conn = await Conn.open(gw.port)
                        except OSError:
                            refused += 1  # the listener is closed: the gateway is going
                            return
                        previous = None
                    body = {**CHAT, "max_tokens": rng.randint(2, MAX_STEPS), "stream": stream}
                    rid = f"{'s' if stream else 'w'}-{n}-{i}"
                    item = Sent(rid, stream, time.perf_counter(), previous)
                    sent.append(item)
                    conn.send(post("/v1/chat/completions", body, item.id))
                    try:
                        answer = await conn.answer()
                    except NoAnswer as exc:
                        item.outcome = f"no answer ({exc.how})"
                        conn.close()
                        conn = None
                    else:
                        item.outcome = outcome(answer, stream)
                        if answer.closes or not answer.whole:
                            conn.close()
                            conn = None
                    item.done = time.perf_counter()
                    previous = item

            async def pipelined(n: int) -> dict[str, Any]:
                """Two requests in one write: the first takes 1 s and spans the SIGTERM."""
                conn = await Conn.open(gw.port)
                slow = {**CHAT, "max_tokens": 10}
                ids = (f"pipe-{n}-1", f"pipe-{n}-2")
                conn.send(*(post("/pipe/v1/chat/completions", slow, i) for i in ids))
                result: dict[str, Any] = {}
                for key in ("first", "second"):
                    try:
                        answer = await conn.answer()
                        result[key] = f"{answer.status}" + (" close" if answer.closes else "")
                        result[key + "_at"] = time.perf_counter()
                    except NoAnswer as exc:
                        result[key] = f"no answer ({exc.how})"
                        break
                conn.close()
                return result

            warm = await Conn.open(gw.port)
            warm.send(post("/v1/chat/completions", {**CHAT, "max_tokens": 1}))
            await warm.answer()
            warm.close()
            loops = [asyncio.ensure_future(client(n, stream=n % 2 == 0)) for n in range(clients)]
            await asyncio.sleep(load_s - 0.3)
            pipes = [asyncio.ensure_future(pipelined(n)) for n in range(PIPELINED)]
            await asyncio.sleep(0.3)
            signalled, exited = await gw.terminate()
            await asyncio.gather(*loops)
            pairs = await asyncio.gather(*pipes)
            read = gw.access_log()
    during = [s for s in sent if s.done >= signalled]
    for item in during:
        if item.outcome == "503 refused":
            item.outcome += " (sent after SIGTERM)" if item.at >= signalled else " (queued)"
    unanswered = [s for s in during if s.outcome.startswith("no answer")]
    return {
        "exit_s": exited - signalled,
        "before": sum(1 for s in sent if s.done < signalled),
        "outcomes": Counter(s.outcome for s in during),
        "unanswered_on": Counter(where(s, signalled) for s in unanswered),
        "unanswered_read": [s.id for s in unanswered if s.id in read or s.id in backend.seen],
        "refused_connects": refused,
        "closed_idle": closed_idle,
        "pairs": pairs,
        "firsts_after_signal": sum(1 for p in pairs if p.get("first_at", 0) >= signalled),
        "seconds_dispatched": sum(1 for n in range(PIPELINED) if f"pipe-{n}-2" in backend.seen),
    }
