"""The demo's workload: many clients sending repeated, near-duplicate and fresh chat
prompts and single-input embedding calls, as an e-commerce recommendation service would."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import aiohttp

PRODUCTS = (
    "running shoes",
    "espresso machine",
    "noise-cancelling headphones",
    "yoga mat",
    "mechanical keyboard",
    "air fryer",
    "hiking backpack",
    "smart watch",
    "standing desk",
    "electric toothbrush",
    "rain jacket",
    "cast iron skillet",
)
QUESTIONS = tuple(f"Which {p} would you recommend for a beginner?" for p in PRODUCTS) + tuple(
    f"What should I look for when buying a {p}?" for p in PRODUCTS
)

# Share of each kind of request; the rest are embeddings.
REPEATED, NEAR_DUPLICATE, FRESH = 0.35, 0.15, 0.15
MODEL = "sim-model"


@dataclass
class Stats:
    """What one phase measured."""

    latencies_ms: list[float] = field(default_factory=list)
    errors: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    elapsed_s: float = 0.0

    def summary(self) -> dict[str, float]:
        lat = sorted(self.latencies_ms)
        n = len(lat)
        return {
            "requests": n + self.errors,
            "errors": self.errors,
            "avg_latency_ms": round(statistics.fmean(lat), 1) if lat else 0.0,
            "p95_latency_ms": round(lat[min(n - 1, int(n * 0.95))], 1) if lat else 0.0,
            "qps": round(n / self.elapsed_s, 1) if self.elapsed_s else 0.0,
        }


def near_duplicate(text: str, rng: random.Random) -> str:
    """The same question as people retype it: case, spacing, punctuation."""
    variants = (
        text.lower(),
        text.upper().rstrip("?") + "?",
        "  " + text + "  ",
        text.rstrip("?") + " ?",
        text.replace("?", "??"),
        text.capitalize(),
    )
    return rng.choice(variants)


def next_request(
    rng: random.Random, serial: int, *, chat_only: bool = False, model: str = MODEL
) -> tuple[str, str, dict[str, object]]:
    """(kind, path, body) of the next request (``chat_only``: the chat kinds in their
    proportions, no embeddings)."""
    roll = rng.random() * (REPEATED + NEAR_DUPLICATE + FRESH if chat_only else 1.0)
    if roll < REPEATED:
        kind, text = "repeated", rng.choice(QUESTIONS)
    elif roll < REPEATED + NEAR_DUPLICATE:
        kind, text = "near_duplicate", near_duplicate(rng.choice(QUESTIONS), rng)
    elif roll < REPEATED + NEAR_DUPLICATE + FRESH:
        product = rng.choice(PRODUCTS)
        kind, text = "fresh", f"Order #{serial}: is the {product} in stock in size {serial % 13}?"
    else:
        product = rng.choice(PRODUCTS)
        return (
            "embedding",
            "/v1/embeddings",
            {"model": model, "input": f"customer {rng.randrange(400)} viewed {product}"},
        )
    return (
        kind,
        "/v1/chat/completions",
        {
            "model": model,
            "temperature": 0,
            "max_tokens": 16,
            "messages": [
                {"role": "system", "content": "You are a shop assistant."},
                {"role": "user", "content": text},
            ],
        },
    )


async def drive(
    base_url: str,
    *,
    clients: int,
    duration_s: float,
    seed: int = 7,
    chat_only: bool = False,
    model: str = MODEL,
    timeout_s: float = 30,
) -> Stats:
    """Run ``clients`` closed-loop clients against ``base_url`` for ``duration_s``."""
    stats = Stats()
    rng = random.Random(seed)
    serial = 0
    connector = aiohttp.TCPConnector(limit=clients)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    started = time.perf_counter()
    deadline = started + duration_s

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal serial
        while time.perf_counter() < deadline:
            serial += 1
            kind, path, body = next_request(rng, serial, chat_only=chat_only, model=model)
            sent = time.perf_counter()
            try:
                async with session.post(base_url + path, json=body) as response:
                    await response.read()
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                stats.latencies_ms.append((time.perf_counter() - sent) * 1000)
                stats.by_kind[kind] = stats.by_kind.get(kind, 0) + 1
            else:
                stats.errors += 1

    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    stats.elapsed_s = time.perf_counter() - started
    return stats
