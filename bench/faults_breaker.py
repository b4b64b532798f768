"""Issue 24's breaker accounting under load: one caller's malformed row in batches under a
default breaker (it must never open), and broken streams from a primary with a fallback
(the breaker must open after a few)."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.plumbing import CHAT, serving
from bench.rawhttp import (
    POLL_S,
    Answer,
    Conn,
    GatewayProcess,
    chunk,
    post,
    stream_answer,
    stream_problem,
)

CONSECUTIVE = 5


class RowSum:
    """A KServe V2 model server: sums each row of ``x``, takes ``busy_s`` a call, and answers
    the whole call 500 when one row is malformed (a negative value), as MLServer does."""

    def __init__(self, busy_s: float) -> None:
        self.busy_s = busy_s
        self.calls: list[list[float]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        body = await request.json()
        data = body["inputs"][0]["data"]
        rows = (
            data
            if data and isinstance(data[0], list)
            else [data[i : i + 3] for i in range(0, len(data), 3)]
        )
        self.calls.append([row[0] for row in rows])
        await asyncio.sleep(self.busy_s)
        if any(v < 0 for row in rows for v in row):
            return web.json_response({"error": "malformed row: a negative value"}, status=500)
        output = {"name": "sum", "shape": [len(rows), 1], "datatype": "FP64"}
        output["data"] = [sum(row) for row in rows]
        return web.json_response(
            {"model_name": "rowsum", "id": body.get("id"), "outputs": [output]}
        )


def infer(row: list[float], rid: str) -> dict[str, Any]:
    """One caller's KServe V2 request: one row of three."""
    return {"id": rid, "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP64", "data": row}]}


async def bench_bad_input(tmp: Path, rounds: int, size: int = 15) -> dict[str, Any]:
    model = RowSum(busy_s=0.02)
    async with serving(model.app()) as (url,):
        policy = f"""backends:
  mls: {{url: "{url}", circuit_breaker: {{}}}}
routes:
  - name: infer
    match: {{path: "/v2/models/*"}}
    backend: mls
    batch: {{max_size: 16, max_wait_ms: 50}}
"""
        async with GatewayProcess(tmp, policy) as gw:
            conns = [await Conn.open(gw.port) for _ in range(size + 1)]
            path = "/v2/models/rowsum/infer"
            good: Counter[str] = Counter()
            bad: Counter[str] = Counter()
            busy_statuses: Counter[str] = Counter()
            states: set[float] = set()
            done = asyncio.Event()

            async def ask(conn: Conn, row: list[float], rid: str) -> Answer:
                conn.send(post(path, infer(row, rid)))
                return await conn.answer()

            async def watch() -> None:
                while not done.is_set():
                    states.update((await gw.series("gateway_breaker_state")).values())
                    await asyncio.sleep(POLL_S)

            watcher = asyncio.ensure_future(watch())
            for r in range(rounds):
                bad_at = r % size
                busy = asyncio.ensure_future(ask(conns[size], [999.0, 0, 0], "busy"))
                await asyncio.sleep(0.005)  # the model is busy with it: the rows pile up
                rows = [[-1.0, 1, 1] if i == bad_at else [r * 100.0 + i, 1, 2] for i in range(size)]
                answers = await asyncio.gather(
                    *(ask(conns[i], row, f"r{r}-{i}") for i, row in enumerate(rows))
                )
                busy_statuses[str((await busy).status)] += 1
                for i, (row, answer) in enumerate(zip(rows, answers, strict=True)):
                    if i == bad_at:
                        bad[str(answer.status)] += 1
                    elif answer.status != 200:
                        good[str(answer.status)] += 1
                    else:
                        body = json.loads(answer.body)
                        right = (
                            body["outputs"][0]["data"] == [sum(row)] and body["id"] == f"r{r}-{i}"
                        )
                        good["200" if right else "200 wrong"] += 1
            done.set()
            await watcher
            states.update((await gw.series("gateway_breaker_state")).values())
            opened = (await gw.series("gateway_breaker_transitions_total")).get(
                '{backend="mls",to="open"}', 0.0
            )
            failures = await gw.series("gateway_backend_failures_total")
            for conn in conns:
                conn.close()
    batched = [call for call in model.calls if len(call) > 1]
    return {
        "rounds": rounds,
        "good": good,
        "bad": bad,
        "busy": busy_statuses,
        "states": sorted(states),
        "opened": opened,
        "failures": {k.split('reason="')[1].rstrip('"}'): v for k, v in failures.items()},
        "calls": len(model.calls),
        "bad_batched": sum(1 for call in batched if -1.0 in call and len(call) >= size - 1),
    }


class StreamingBackend:
    """Chat streams of four chunks 20 ms apart: whole ones, or (``broken``) each ending one of
    three wrong ways in turn; counts its calls."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken
        self.calls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.chat)
        return app

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.calls += 1
        parts = [chunk("x") for _ in range(3)]
        done = b"data: [DONE]\n\n"
        if not self.broken:
            parts.append(chunk("", "stop") + done)
        elif self.calls % 3 == 0:  # vLLM's mid-stream error
            error = {"error": {"message": "CUDA error", "type": "internal_error", "code": 500}}
            parts.append(b"data: " + json.dumps(error).encode() + b"\n\n" + done)
        elif self.calls % 3 == 1:
            parts.append(chunk("x"))  # ends cleanly, without finish_reason or [DONE]
        else:
            parts.append(b"data: {not json\n\n" + chunk("", "stop") + done)
        return await stream_answer(request, parts, 0.02)


async def bench_broken_streams(tmp: Path, clients: int, duration_s: float) -> dict[str, Any]:
    primary, spare = StreamingBackend(broken=True), StreamingBackend(broken=False)
    async with serving(primary.app(), spare.app()) as (primary_url, spare_url):
        policy = f"""backends:
  main: {{url: "{primary_url}", circuit_breaker: {{consecutive_failures: {CONSECUTIVE}}}}}
  spare: {{url: "{spare_url}"}}
routes:
  - {{name: chat, match: {{path: /v1/chat/completions}}, backend: main, fallback: [spare]}}
"""
        async with GatewayProcess(tmp, policy) as gw:
            seen: list[tuple[float, str, str | None]] = []  # sent at, backend, problem
            opened_at: list[float] = []
            stop = time.perf_counter() + duration_s

            async def client() -> None:
                conn = await Conn.open(gw.port)
                request = post("/v1/chat/completions", {**CHAT, "stream": True})
                while time.perf_counter() < stop:
                    sent = time.perf_counter()
                    conn.send(request)
                    answer = await conn.answer()
                    problem = stream_problem(answer.body) if answer.status == 200 else "status"
                    seen.append((sent, answer.headers.get("x-gateway-backend", ""), problem))
                    if answer.closes or not answer.whole:
                        conn.close()
                        conn = await Conn.open(gw.port)
                conn.close()

            async def watch() -> None:
                while time.perf_counter() < stop and not opened_at:
                    if (await gw.series("gateway_breaker_state")).get('{backend="main"}') == 1:
                        opened_at.append(time.perf_counter())
                    await asyncio.sleep(POLL_S / 2)

            await asyncio.gather(watch(), *(client() for _ in range(clients)))
            failures = await gw.series("gateway_backend_failures_total")
    opened = opened_at[0] if opened_at else None
    later = [s for s in seen if opened is not None and s[0] > opened]
    return {
        "clients": clients,
        "streams": len(seen),
        "broken": sum(1 for s in seen if s[2] is not None),
        "problems": Counter(s[2] for s in seen if s[2] is not None),
        "primary_calls": primary.calls,
        "opened": opened is not None,
        "after_open": len(later),
        "after_open_spare_whole": sum(1 for s in later if s[1] == "spare" and s[2] is None),
        "failures": {
            k.split('reason="')[1].rstrip('"}'): v
            for k, v in failures.items()
            if 'backend="main"' in k
        },
    }
