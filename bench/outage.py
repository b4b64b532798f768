"""A busy primary that suddenly fails (issue 12): closed-loop clients against a primary that
is healthy, then answers every call with 500, with a healthy fallback.  Measured over the
outage: the client-visible errors, and how long after the first failure the breaker
opened (read from the gateway's own ``gateway_breaker_state``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from bench.common import free_port
from bench.plumbing import Backend, RawClient, gateway, serving

POLL_S = 0.01


async def bench_sudden_outage(
    clients: int, healthy_s: float, outage_s: float, breaker: dict[str, Any]
) -> dict[str, Any]:
    primary, spare = Backend(), Backend()
    async with serving(primary.app(), spare.app()) as (primary_url, spare_url):
        policy = {
            "backends": {
                "main": {"url": primary_url, "circuit_breaker": breaker},
                "spare": {"url": spare_url},
            },
            "routes": [
                {
                    "name": "chat",
                    "match": {"path": "/v1/*"},
                    "backend": "main",
                    "fallback": ["spare"],
                }
            ],
        }
        admin = free_port()
        async with gateway(policy, admin_port=admin) as gw:
            sent: list[tuple[float, int]] = []
            start = time.perf_counter()
            stop = start + healthy_s + outage_s

            async def worker() -> None:
                async with RawClient(gw) as client:
                    while time.perf_counter() < stop:
                        at = time.perf_counter()
                        status, _ = await client.post()
                        sent.append((at, status))

            async def outage() -> tuple[float, float | None]:
                await asyncio.sleep(healthy_s)
                primary.status = 500
                began = time.perf_counter()
                url = f"http://127.0.0.1:{admin}/metrics"
                async with aiohttp.ClientSession() as session:
                    while time.perf_counter() < stop:
                        async with session.get(url) as r:
                            text = await r.text()
                        if 'gateway_breaker_state{backend="main"} 1.0' in text:
                            return began, time.perf_counter()
                        await asyncio.sleep(POLL_S)
                return began, None

            watched = asyncio.create_task(outage())
            await asyncio.gather(*(worker() for _ in range(clients)))
            began, opened = await watched
    during = [status for at, status in sent if at >= began]
    before = [status for at, status in sent if at < began]
    first_failure = next((t for t in sorted(primary.arrivals) if t >= began), began)
    return {
        "clients": clients,
        "requests": len(during),
        "errors": sum(1 for s in during if s != 200),
        "healthy_requests": len(before),
        "healthy_errors": sum(1 for s in before if s != 200),
        "open_after_s": None if opened is None else opened - first_failure,
        "primary_calls_in_outage": sum(1 for t in primary.arrivals if t >= began),
        "breaker": breaker,
    }


def rows(results: list[dict[str, Any]]) -> list[str]:
    """The report's lines for each run: errors against <= 1%, opening against <= 1 s."""
    out = []
    for r in results:
        share = r["errors"] / r["requests"] if r["requests"] else 0.0
        opened = r["open_after_s"]
        shown = "never (within the outage)" if opened is None else f"{opened * 1000:.0f} ms"
        trip = (
            "rate only (`consecutive_failures: 0`, the behaviour before)"
            if r["breaker"].get("consecutive_failures") == 0
            else "defaults (`consecutive_failures: 5` beside the rate)"
        )
        met = share <= 0.01 and opened is not None and opened <= 1.0
        out.append(
            f"| {r['clients']} clients, breaker {trip} | {r['errors']} of {r['requests']} "
            f"({share:.2%}) | {shown} | {r['primary_calls_in_outage']} | "
            f"{'yes' if met else '**no**'} |"
        )
    return out
