"""Small helpers shared by the test modules."""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for a condition the gateway reaches over real sockets (a guard, not a delay:
    time itself never has to pass)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)
