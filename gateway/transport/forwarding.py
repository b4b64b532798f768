"""Who sent a request, as the backend is told: ``X-Forwarded-For``, ``X-Forwarded-Host``,
``X-Forwarded-Proto``, ``X-Real-IP`` and ``Forwarded`` (RFC 7239).

A client may write any of them, so none is believed unless the connection's peer is in
``server.trusted_proxies`` (CIDRs: a load balancer or ingress in front of the gateway).
From an untrusted peer they are replaced: the peer is the client.  After a trusted hop the
proxy's ``X-Forwarded-Host``/``-Proto``, ``X-Real-IP`` and ``Forwarded`` are kept (the last
extended by this hop), and the peer is appended to ``X-Forwarded-For``; the client is then
the right-most address in it that is not itself a trusted proxy (what nginx's
``real_ip_recursive`` and Envoy's ``xff_num_trusted_hops`` find).

What the per-address limits count that client as is ``client_key``: an IPv6 client by its
``server.ipv6_client_prefix`` network (a /64 by default), since one host is given a whole
/64 and may send from any address in it; counted address by address, it would get a
caller's rate, new-credential budget and ``tenants.max_concurrency`` as many times as it
has addresses (Cloudflare and AWS WAF group IPv6 the same way).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from functools import lru_cache

from gateway.transport.headers import FORWARDING

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """The CIDRs whose forwarding headers are believed."""

    __slots__ = ("_networks", "trusts")

    def __init__(self, cidrs: Sequence[str]) -> None:
        self._networks: tuple[Network, ...] = tuple(
            ipaddress.ip_network(c, strict=False) for c in cidrs
        )
        self.trusts = lru_cache(maxsize=1024)(self._trusts) if self._networks else _never

    def _trusts(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        return any(ip in net for net in self._networks)

    def __repr__(self) -> str:
        return f"<TrustedProxies {[str(n) for n in self._networks]}>"


def _never(address: str) -> bool:
    return False


def forwarding_headers(
    headers: Sequence[tuple[str, str]],
    peer: str,
    host: str,
    proto: str,
    trusted: TrustedProxies,
) -> tuple[list[tuple[str, str]], str]:
    """(the forwarding headers to send upstream, the client's address).  ``headers`` are
    the request's own, as received; ``host`` is its Host header."""
    if not trusted.trusts(peer):
        return [
            ("X-Forwarded-For", peer),
            ("X-Forwarded-Proto", proto),
            *((("X-Forwarded-Host", host),) if host else ()),
            ("X-Real-IP", peer),
            ("Forwarded", _element(peer, host, proto)),
        ], peer
    given: dict[str, list[str]] = {}
    for key, value in headers:
        lower = key.lower()
        if lower in FORWARDING:
            given.setdefault(lower, []).append(value)
    hops = [h.strip() for v in given.get("x-forwarded-for", ()) for h in v.split(",")]
    hops = [h for h in hops if h]
    client = peer
    for hop in reversed(hops):
        client = hop
        if not trusted.trusts(hop):
            break
    out = [
        ("X-Forwarded-For", ", ".join([*hops, peer])),
        ("X-Forwarded-Proto", _first(given, "x-forwarded-proto") or proto),
    ]
    forwarded_host = _first(given, "x-forwarded-host") or host
    if forwarded_host:
        out.append(("X-Forwarded-Host", forwarded_host))
    out.append(("X-Real-IP", _first(given, "x-real-ip") or client))
    earlier = ", ".join(given.get("forwarded", ()))
    element = _element(peer, host, proto)
    out.append(("Forwarded", f"{earlier}, {element}" if earlier else element))
    return out, client


@lru_cache(maxsize=4096)
def client_key(address: str, ipv6_prefix: int = 64) -> str:
    """What the per-address limits count ``address`` as: an IPv4 address as itself (an
    IPv4-mapped IPv6 one too), an IPv6 address as its ``/ipv6_prefix`` network, each written
    canonically (a forwarded ``[v6]:port`` or ``v4:port`` without its port, an IPv6 zone
    dropped); anything else (a name a proxy forwarded) as it is."""
    ip = _ip(address.strip())
    if ip is None:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        if ipv6_prefix < 128:
            return str(ipaddress.IPv6Network((ip, ipv6_prefix), strict=False))
    return str(ip)


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if text.startswith("[") and "]" in text:  # [v6] or [v6]:port
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # v4:port
        text = text.partition(":")[0]
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


def _first(given: dict[str, list[str]], name: str) -> str:
    values = given.get(name)
    return values[0].strip() if values else ""


def _element(peer: str, host: str, proto: str) -> str:
    """One RFC 7239 element: ``for=...;host=...;proto=...``."""
    node = f'"[{peer}]"' if ":" in peer else peer or "unknown"
    parts = [f"for={node}"]
    if host:
        parts.append('host="' + host.replace("\\", "\\\\").replace('"', '\\"') + '"')
    parts.append(f"proto={proto}")
    return ";".join(parts)
