"""What the per-address limits count a client as (``forwarding.client_key``,
``server.ipv6_client_prefix``): an IPv6 host sending from many addresses of its /64 is one
client for a caller's rate limit, the budgets of new credentials and
``tenants.max_concurrency``; an IPv4-mapped address is its IPv4 one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import yaml

from gateway.errors import PolicyError
from gateway.policy import parse_policy_text
from gateway.transport.forwarding import client_key
from tests.backends import Model
from tests.helpers import chat, policy, until
from tests.test_stage_resilience import CHAT, URL

REFUSED_WITHIN_S = 5.0


@pytest.mark.parametrize(
    ("address", "prefix", "counted"),
    [
        ("192.0.2.7", 64, "192.0.2.7"),
        ("::ffff:192.0.2.7", 64, "192.0.2.7"),  # a dual-stack socket's IPv4 client
        ("2001:db8:1:2:aaaa::1", 64, "2001:db8:1:2::/64"),
        ("2001:DB8:1:2:bbbb:0:0:9", 64, "2001:db8:1:2::/64"),  # any spelling, same host
        ("2001:db8:1:2:aaaa::1", 128, "2001:db8:1:2:aaaa::1"),
        ("2001:db8:1:2:aaaa::1", 48, "2001:db8:1::/48"),
        ("fe80::1%eth0", 64, "fe80::/64"),
        ("[2001:db8::5]:4431", 64, "2001:db8::/64"),  # as some proxies forward it
        ("203.0.113.9:51000", 64, "203.0.113.9"),
        ("unknown", 64, "unknown"),  # not an address: as it is
        ("", 64, ""),
    ],
)
def test_a_client_is_counted_by_its_address_or_its_ipv6_network(
    address: str, prefix: int, counted: str
) -> None:
    assert client_key(address, prefix) == counted


def limited(**more: Any) -> dict[str, Any]:
    return policy(
        {"main": {"url": URL}},
        {"rate_limit": {"requests_per_s": 0.001, "burst": 1}},
        tenants={"max_concurrency": 1},
        **more,
    )


async def test_one_ipv6_host_rotating_addresses_is_one_client(pipeline):
    main = Model("main")
    gw = await pipeline(limited(), main)

    def asked(peer: str) -> Any:
        return gw.send("POST", CHAT, json=chat(peer), peer=peer).done()

    first = await asked("2001:db8:1:2::1")
    assert first.status_code == 200
    rotated = await asked("2001:db8:1:2:ffff::2")  # the same /64: its rate is spent
    assert (rotated.status_code, rotated.json()["error"]["code"]) == (429, "rate_limit_exceeded")
    assert (await asked("2001:db8:1:3::1")).status_code == 200  # another /64, another client

    main.hold()
    held = gw.send("POST", CHAT, json=chat("held"), peer="2001:db8:9:9::1")
    try:
        await until(lambda: main.active == 1)
        over = await asyncio.wait_for(asked("2001:db8:9:9::abcd"), REFUSED_WITHIN_S)
        assert over.json()["error"]["code"] == "concurrency_limit_exceeded"
    finally:
        main.let()
    assert (await held.done()).status_code == 200


async def test_a_prefix_of_128_counts_each_address(pipeline):
    gw = await pipeline(limited(server={"ipv6_client_prefix": 128}), Model("main"))
    for peer in ("2001:db8:1:2::1", "2001:db8:1:2::2"):
        answer = await gw.send("POST", CHAT, json=chat(peer), peer=peer).done()
        assert answer.status_code == 200


def test_the_prefix_is_1_to_128():
    text = yaml.safe_dump(limited(server={"ipv6_client_prefix": 0}))
    with pytest.raises(PolicyError, match="ipv6_client_prefix: must be 1 to 128"):
        parse_policy_text(text)
