"""Issue 24's reload under load: clients on the embeddings route while the policy file is
renamed into place, then rewritten in place by a writer that pauses mid-file; when each
version went live (the generation on the admin port), and every answer's status."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from aiohttp import web

from bench.plumbing import ANSWER, serving
from bench.rawhttp import POLL_S, Conn, GatewayProcess, NoAnswer, post
from gateway.policy.model import DEFAULT_RELOAD_SETTLE_S


class FastBackend:
    """Answers embeddings (and anything else, as chat) at once."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.Response:
        await request.read()
        if request.path.endswith("/embeddings"):
            vector = {"object": "embedding", "index": 0, "embedding": [0.1, 0.2]}
            usage = {"prompt_tokens": 1, "total_tokens": 1}
            return web.json_response({"object": "list", "data": [vector], "usage": usage})
        return web.json_response(ANSWER)


def reload_parts(url: str, version: int) -> list[str]:
    """A policy in three parts, each prefix a valid policy; only the whole file has the
    embeddings route (and the version's own)."""
    head = (
        f'backends:\n  fast: {{url: "{url}"}}\nroutes:\n'
        "  - {name: chat, match: {path: /v1/chat/completions}, backend: fast}\n"
    )
    middle = "  - {name: completions, match: {path: /v1/completions}, backend: fast}\n"
    rest = (
        "  - {name: embeddings, match: {path: /v1/embeddings}, backend: fast}\n"
        f"  - {{name: version-{version}, match: {{path: /version/{version}}}, backend: fast}}\n"
    )
    return [head, middle, rest]


def write_in_place(path: Path, parts: list[str], pauses_s: list[float]) -> float:
    """Rewrite ``path`` in place (the same inode) part by part, pausing between; when the
    last part was written."""
    with open(path, "r+") as f:
        f.truncate(0)
        for i, part in enumerate(parts):
            f.write(part)
            f.flush()
            if i < len(pauses_s):
                time.sleep(pauses_s[i])
        return time.perf_counter()


def rename_into_place(path: Path, text: str) -> float:
    """Write ``text`` beside ``path`` and rename it over ``path`` (a new inode, as ``sed -i``
    and most editors leave it); when it was in place."""
    staged = path.with_name(".policy.yaml.new")
    staged.write_text(text)
    os.replace(staged, path)
    return time.perf_counter()


async def bench_reload(tmp: Path, clients: int, renames: int) -> dict[str, Any]:
    async with serving(FastBackend().app()) as (url,):
        async with GatewayProcess(tmp, "".join(reload_parts(url, 0))) as gw:
            statuses: Counter[str] = Counter()
            generations: list[tuple[float, int]] = [(time.perf_counter(), await gw.generation())]
            done = asyncio.Event()

            async def client() -> None:
                conn = await Conn.open(gw.port)
                request = post("/v1/embeddings", {"model": "e", "input": "hello"})
                while not done.is_set():
                    conn.send(request)
                    try:
                        answer = await conn.answer()
                        statuses[str(answer.status)] += 1
                    except NoAnswer as exc:
                        statuses[f"no answer ({exc.how})"] += 1
                        conn.close()
                        conn = await Conn.open(gw.port)
                conn.close()

            async def watch() -> None:
                while not done.is_set():
                    generation = await gw.generation()
                    if generation != generations[-1][1]:
                        generations.append((time.perf_counter(), generation))
                    await asyncio.sleep(POLL_S)

            async def applied(after: float, timeout_s: float) -> float | None:
                """Seconds from ``after`` to the first new generation seen after it."""
                deadline = time.perf_counter() + timeout_s
                while time.perf_counter() < deadline:
                    later = [t for t, _ in generations if t > after]
                    if later:
                        return later[0] - after
                    await asyncio.sleep(POLL_S)
                return None

            tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
            watcher = asyncio.ensure_future(watch())
            await asyncio.sleep(1.0)
            rename_s = []
            for version in range(1, renames + 1):
                text = "".join(reload_parts(url, version))
                at = await asyncio.to_thread(rename_into_place, gw.policy, text)
                rename_s.append(await applied(at, 5.0))
                await asyncio.sleep(0.5)
            version = renames + 1
            began = time.perf_counter()
            last_write = await asyncio.to_thread(
                write_in_place, gw.policy, reload_parts(url, version), [2.0, 5.0]
            )
            in_place_s = await applied(last_write, DEFAULT_RELOAD_SETTLE_S + 5.0)
            live = json.loads(await gw.get("/policy"))["policy"]
            await asyncio.sleep(0.5)
            done.set()
            await asyncio.gather(*tasks, watcher)
    return {
        "clients": clients,
        "statuses": statuses,
        "rename_s": rename_s,
        "in_place_s": in_place_s,
        "early": sum(1 for t, _ in generations if began <= t <= last_write),
        "whole": {r["name"] for r in live["routes"]} >= {"embeddings", f"version-{version}"},
        "generations": len(generations) - 1,
    }
