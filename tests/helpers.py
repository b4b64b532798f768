"""Small helpers shared by the test modules."""

from __future__ import annotations

import asyncio
import contextlib
import json
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httptools
import httpx
import yaml

from gateway.resilience.gpu import TELEMETRY

CHAT = {"model": "llama-3", "messages": [{"role": "user", "content": "hello there"}]}
"""A chat request body."""


def chat(tag: str = "hello", **extra: Any) -> dict[str, Any]:
    """A chat request whose one user message is ``tag``."""
    return {"model": "m", "messages": [{"role": "user", "content": tag}], **extra}


def write_policy(tmp_path: Path, policy: str | dict[str, Any], name: str = "policy.yaml") -> Path:
    """A policy file in ``tmp_path``: YAML text (dedented) or a policy as data."""
    path = tmp_path / name
    if isinstance(policy, str):
        path.write_text(textwrap.dedent(policy))
    else:
        path.write_text(yaml.safe_dump(policy, sort_keys=False))
    return path


def policy(
    backends: dict[str, dict[str, Any]], route: dict[str, Any] | None = None, **more: Any
) -> dict[str, Any]:
    """A policy whose one route (chat, ``/v1/*``) goes to the first backend."""
    first = next(iter(backends))
    routes = [{"name": "chat", "match": {"path": "/v1/*"}, "backend": first, **(route or {})}]
    return {"backends": backends, "routes": routes, **more}


INTERVAL_MS = 200
"""The telemetry interval of the throttle tests' policies."""


POLL_TRIES = 5
"""A scrape may outlast its timeout (the interval, 200 ms) on a machine busy with other
tests, a new connection's first above all; what these tests check is the sample's effect."""


async def poll(gw: Any, backend: str = "main") -> None:
    """Take one telemetry sample now (the poller's own schedule waits on the FakeClock)."""
    item = gw.gateway.registry.peek(TELEMETRY, backend)
    await until(lambda: item.poller is not None)
    for _ in range(POLL_TRIES):
        if await item.poller.poll_once():
            return
    raise AssertionError(f"no sample in {POLL_TRIES} polls: {item.poller.last_error!r}")


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one series in a Prometheus exposition."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            series, value = line.rsplit(" ", 1)
            got = series[len(name) :].strip("{}")
            if ",".join(sorted(got.split(","))) == want or (not labels and not got):
                return float(value)
    return None


async def scrape_when_recorded(admin_url: str, answers: int, timeout_s: float = 5.0) -> str:
    """The gateway's metrics once it has recorded ``answers`` answers in
    ``gateway_requests_total``: it records one after the client has read it, so a scrape
    right after the answer may come first."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with httpx.AsyncClient() as client:
        while True:
            text = (await client.get(admin_url + "/metrics")).text
            counted = sum(
                float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("gateway_requests_total{")
            )
            if counted >= answers:
                return text
            if loop.time() > deadline:
                raise AssertionError(f"{counted:g} answers recorded, {answers} expected")
            await asyncio.sleep(0.005)


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Wait for a condition the gateway reaches over real sockets (a guard, not a delay:
    time itself never has to pass)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.002)


@dataclass
class RawResponse:
    """One answer read off a raw connection."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every complete answer in ``data``, in order (llhttp reads them)."""
    answers: list[RawResponse] = []

    class Reader:
        def __init__(self) -> None:
            self.headers: dict[str, str] = {}
            self.body = bytearray()

        def on_header(self, name: bytes, value: bytes) -> None:
            self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            answers.append(RawResponse(parser.get_status_code(), self.headers, bytes(self.body)))
            self.headers, self.body = {}, bytearray()

    parser = httptools.HttpResponseParser(Reader())
    with contextlib.suppress(httptools.HttpParserError):
        parser.feed_data(data)
    return answers


async def send_raw(url: str, data: bytes, timeout_s: float = 5.0) -> list[RawResponse]:
    """Write ``data`` on a fresh connection and read until the gateway closes it; every
    answer it sent."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(data)
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout_s)
    writer.close()
    return parse_responses(raw)


def problems_of(text: str) -> list[str]:
    """The problems the loader reports for policy ``text`` (as file ``p.yaml``)."""
    from gateway.errors import PolicyError
    from gateway.policy.load import parse_policy_text

    try:
        parse_policy_text(text, "p.yaml")
    except PolicyError as exc:
        return [str(p) for p in exc.problems]
    raise AssertionError("the policy was accepted")


@contextlib.asynccontextmanager
async def sim_behind_gateway(
    start_gateway: Any, tmp_path: Path, policy: Callable[[str], str], **sim: Any
) -> Any:
    """The sim (``SimConfig(port=0, **sim)``) and a gateway in front of it serving
    ``policy(sim_url)``: yields (sim, gateway)."""
    from gateway.sim import SimConfig, start_sim

    server = await start_sim(SimConfig(port=0, **sim))
    try:
        path = write_policy(tmp_path, policy(server.url))
        yield server, await start_gateway(policy=path, warmup=False)
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def caching_sim(
    start_gateway: Any, tmp_path: Path, name: str, path: str = "*", **route: Any
) -> Any:
    """A fast sim (1 ms a call, no time a token) behind a gateway whose one route ``name``
    caches the calls to ``path`` (``route``: more of the route): yields (sim, gateway)."""

    def caching(url: str) -> str:
        cached = {"name": name, "match": {"path": path}, "backend": name, "cache": {"ttl_s": 60}}
        whole = {"backends": {name: {"url": url}}, "routes": [{**cached, **route}]}
        return yaml.safe_dump(whole, sort_keys=False)

    async with sim_behind_gateway(
        start_gateway, tmp_path, caching, base_ms=1.0, token_ms=0.0
    ) as both:
        yield both


SHIPPED_POLICIES = Path(__file__).resolve().parent.parent / "policies"


@contextlib.asynccontextmanager
async def shipped_behind_sim(
    start_gateway: Any, tmp_path: Path, name: str, its_url: str, backend: str
) -> Any:
    """``policies/<name>.yaml`` with the sim in place of ``its_url`` (the server's usual
    address), a greedy answer of 4,000 tokens unless bounded, once the gateway knows what
    ``backend`` serves (``model_version: auto``): yields (sim, gateway)."""
    from gateway.transport.identity import UNKNOWN

    shipped = (SHIPPED_POLICIES / f"{name}.yaml").read_text()
    async with sim_behind_gateway(
        start_gateway,
        tmp_path,
        lambda url: shipped.replace(its_url, url),
        base_ms=1.0,
        token_ms=0.0,
        answer_tokens=4000,
    ) as (sim, gw):
        await until(lambda: gw.gateway.transport.model_identity(backend) != UNKNOWN)
        yield sim, gw
