"""DNS discovery: a backend's endpoints are the addresses a name resolves to.

A Kubernetes headless Service resolves to one A/AAAA record per ready pod.  With
``discovery: {dns, port, interval_s}`` the backend's endpoints follow it: ``follow``
resolves the name every ``interval_s`` and hands the URLs to the backend's
``EndpointSet``, which adds the new ones and drains the ones that disappeared (no new
requests; those in flight finish on their pool, which then closes).  A failed resolution
keeps the last endpoints (a DNS hiccup must not empty a backend).  The resolver is a
boundary: ``SystemResolver`` asks the OS (``getaddrinfo``), ``gateway.testing.FakeResolver``
answers what a test says.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from gateway.policy.model import Discovery

log = logging.getLogger("gateway.transport")


class Resolver(Protocol):
    """Resolves a name to its addresses (IPv4 and IPv6 text forms)."""

    async def resolve(self, host: str, port: int) -> list[str]: ...


class SystemResolver:
    """The OS resolver, off the event loop (``loop.getaddrinfo``)."""

    async def resolve(self, host: str, port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        return sorted({str(info[4][0]) for info in infos})


def urls_of(discovery: Discovery, addresses: list[str]) -> tuple[str, ...]:
    """One base URL per address, IPv6 in brackets, in a stable order; what is not an IP
    address is skipped (a resolver's garbage never becomes a URL)."""
    out = []
    for address in sorted(set(addresses)):
        try:
            version = ipaddress.ip_address(address).version
        except ValueError:
            continue
        host = f"[{address}]" if version == 6 else address
        out.append(f"{discovery.scheme}://{host}:{discovery.port}{discovery.path.rstrip('/')}")
    return tuple(out)


async def follow(
    name: str,
    discovery: Discovery,
    update: Callable[[tuple[str, ...]], None],
    resolver: Resolver,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
) -> None:
    """Resolve ``discovery.dns`` every ``interval_s`` and ``update`` the endpoints with it,
    until cancelled."""
    failed = False
    while True:
        try:
            addresses = await resolver.resolve(discovery.dns, discovery.port)
        except (OSError, ValueError) as exc:
            if not failed:
                log.warning("backend %s: cannot resolve %s: %s", name, discovery.dns, exc)
            failed = True
        else:
            if failed:
                log.info("backend %s: %s resolves again", name, discovery.dns)
            failed = False
            update(urls_of(discovery, addresses))
        await sleep(discovery.interval_s)
