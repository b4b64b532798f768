"""The case study's request path: a recommendation model behind KServe V2, its answers cached
by the gateway (``cache.own_apis``).

    python -m bench.bench_cache_own_apis [--duration 10] [--rounds 3] [--connections 16]

One KServe V2 model server runs one inference at a time in ``SERVICE_MS`` (a model on one
GPU: about 200 answers a second at best, the case study's ceiling).  Clients ask it for the
scores of one user's features, drawn from ``USERS`` users by popularity (Zipf, s = 1, a
fixed seed: some users come back often, most rarely), each call with a fresh ``id`` as
KServe's own client sends, over keep-alive connections, each answered before the next.
The paths, taking turns in each round:

- direct: to the model server;
- the gateway (a process of its own) without a cache;
- the gateway with single flight alone (``coalesce: true``, no cache): identical calls in
  flight share one, whatever their ids;
- the gateway caching the route (``cache: {ttl_s: 600}``; its ``own_apis`` on, the
  default), its cache warmed by nothing but the rounds before.

Each row gives answers a second, latency and upstream calls per 100 answers (what reached
the model).
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

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

SERVICE_MS = 5.0
USERS = 2_000
PATH = "/v2/models/recommender/infer"


class Recommender:
    """A KServe V2 model server scoring one user's features, one call at a time."""

    def __init__(self) -> None:
        self.calls = 0
        self._one = asyncio.Lock()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        return app

    async def infer(self, request: web.Request) -> web.Response:
        body = await request.json()
        async with self._one:
            self.calls += 1
            await asyncio.sleep(SERVICE_MS / 1000)
        row = body["inputs"][0]["data"]
        scores = [round((row[0] * 31 + i * 17) % 97 / 97, 4) for i in range(8)]
        output = {"name": "scores", "shape": [1, 8], "datatype": "FP32", "data": scores}
        answer = {"model_name": "recommender", "id": body.get("id"), "outputs": [output]}
        return web.json_response(answer)


def requests(seed: int = 7) -> Any:
    """Each call's body: one user's features, users drawn by Zipf popularity."""
    draw = random.Random(seed)
    weights = [1 / rank for rank in range(1, USERS + 1)]
    users = list(range(USERS))

    def body() -> dict[str, Any]:
        user = draw.choices(users, weights)[0]
        features = [float(user), float(user % 13), float(user % 7)]
        tensor = {"name": "x", "shape": [1, 3], "datatype": "FP32", "data": features}
        return {"id": f"{draw.getrandbits(128):032x}", "inputs": [tensor]}  # as KServe's client

    return body


def policy(url: str, cache: bool, coalesce: bool = False) -> dict[str, Any]:
    route: dict[str, Any] = {"match": {"path": "/v2/models/*"}, "backend": "model"}
    if cache:
        route["cache"] = {"ttl_s": 600}
    if coalesce:
        route["coalesce"] = True
    return {"backends": {"model": {"url": url, "model_version": "recs@1"}}, "routes": [route]}


async def load(urls: list[str], duration_s: float, connections: int) -> dict[str, float]:
    latencies, elapsed, failed = await closed_loop(urls, PATH, BODY, duration_s, connections)
    if failed:
        raise RuntimeError(f"{failed} calls failed")
    return figures_of(latencies, elapsed)


BODY = requests()


async def main(duration_s: float, rounds: int, connections: int) -> list[str]:
    model = Recommender()
    async with serving(model.app()) as (url,):
        async with (
            gateway(policy(url, False)) as plain,
            gateway(policy(url, False, coalesce=True)) as shared,
            gateway(policy(url, True)) as cached,
        ):
            paths = {
                "direct, the model server": [url],
                "gateway, no cache": [plain],
                "gateway, `coalesce: true` (single flight alone)": [shared],
                "gateway, `cache: {ttl_s: 600}` (`own_apis`)": [cached],
            }
            runs = await rounds_of(
                paths, load, lambda: model.calls, duration_s, rounds, connections
            )
    return medians(runs, COLUMNS)


COLUMNS = (
    ANSWERS_S,
    P50_MS,
    P99_MS,
    CALLS_PER_100,
)


if __name__ == "__main__":
    args, lines = run_rounds(__doc__, 10.0, 16, main)
    update_section(
        "cache_own_apis",
        "## A recommendation model behind KServe V2, cached (`cache.own_apis`)\n\n"
        f"`{rounds_command('bench_cache_own_apis', args)}` on {machine()}. One KServe V2 "
        f"model server runs one inference at a time in {SERVICE_MS:g} ms; "
        f"{args.connections} connections ask it for one user's scores, the users drawn "
        f"from {USERS:,} by Zipf popularity (s = 1, a fixed seed), each call with a fresh "
        "`id` as KServe's own client sends (the server echoes it) and answered before "
        "the next; the gateway runs as a process of its own. Each figure is the median "
        "over the rounds, in which the paths take turns; the cached path's entries "
        "persist from round to round. Before `own_apis`, the last row was the second: "
        "every KServe V2 `infer` passed a caching route uncached. Before single flight "
        "shared calls whatever their ids (KServe's client sends a fresh one each call), "
        "the third row was the second too: no two calls were ever identical.\n\n"
        + "\n".join(lines),
    )
