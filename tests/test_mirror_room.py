"""Shadow traffic is held to the mirror backend's limits and never waits for them: a copy
needs a free slot under its ``max_concurrency`` that no queued call waits for (else it is
not sent: ``no_room``), so copies never take a slot a served call needs.  Two model servers
on real sockets; httpx as the client."""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

import httpx

from gateway.mirror.stage import SHADOWS
from tests.helpers import chat, until
from tests.test_mirror import SHADOW_KEY, mirrored, outcome, scrape, servers, start

__all__ = ["servers"]  # the fixture, for pytest


async def test_a_copy_finding_the_mirrors_slots_taken_is_not_sent(servers, start_gateway, tmp_path):
    _main, canary, main_url, canary_url = servers
    doc = mirrored(main_url, canary_url)
    doc["backends"]["canary"]["max_concurrency"] = 1
    gw = await start(start_gateway, tmp_path, doc)
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    canary.gate = asyncio.Event()  # the first copy holds the canary's only slot
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        first = await client.post("/v1/chat/completions", json=chat("a"))
        await until(lambda: len(canary.calls) == 1)
        second = await client.post("/v1/chat/completions", json=chat("b"))
        assert (first.status_code, second.status_code) == (200, 200)
        assert shadow.in_flight == 1 and len(canary.calls) == 1
        assert outcome(await scrape(gw), "no_room") == 1
        canary.gate.set()
        await until(lambda: shadow.in_flight == 0)  # the copy ended: its slot is free again
        third = await client.post("/v1/chat/completions", json=chat("c"))
    assert third.status_code == 200
    await until(lambda: len(canary.calls) == 2 and shadow.in_flight == 0)
    text = await scrape(gw)
    assert (outcome(text, "2xx"), outcome(text, "no_room")) == (2, 1)


async def test_each_copy_writes_its_own_access_log_line_under_its_originals_id(
    servers, start_gateway, tmp_path, capsys
):
    _main, canary, main_url, canary_url = servers
    doc = mirrored(main_url, canary_url)
    doc["server"]["access_log"] = True
    gw = await start(start_gateway, tmp_path, doc)
    shadow = gw.gateway.registry.peek(SHADOWS, "chat")
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        for n, (tag, status) in enumerate((("same", 200), ("differs", 200), ("fails", 500))):
            canary.voice = "main" if tag == "same" else "canary"
            canary.status = status
            asked = chat(tag, temperature=0)
            await client.post("/v1/chat/completions", json=asked, headers={"X-Request-ID": tag})
            await until(functools.partial(copied, canary, shadow, n + 1))  # before the next
    lines = [json.loads(x) for x in capsys.readouterr().err.splitlines() if x.startswith("{")]
    copies = {line["id"]: line for line in lines if line.get("kind") == "mirror"}
    originals = {line["id"] for line in lines if "kind" not in line}
    assert set(copies) == originals == {"same", "differs", "fails"}
    assert copies["same"]["mirror_same"] is True and copies["differs"]["mirror_same"] is False
    assert [copies[t]["status"] for t in ("same", "differs", "fails")] == [200, 200, 500]
    assert "mirror_same" not in copies["fails"]
    line = copies["same"]
    assert (line["route"], line["backend"], line["path"]) == (
        "chat",
        "canary",
        "/v1/chat/completions",
    )
    assert line["endpoint"] == canary_url and line["duration_ms"] > 0
    assert SHADOW_KEY not in json.dumps(lines)


def copied(canary: Any, shadow: Any, calls: int) -> bool:
    """The canary has had ``calls`` copies, and none is still in flight."""
    return len(canary.calls) == calls and shadow.in_flight == 0
