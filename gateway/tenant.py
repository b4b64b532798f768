"""Who a request belongs to: the tenant scope that isolates cache entries, shared calls and
batches, and the key a per-tenant rate limit counts.

A tenant is every credential it carries: ``CREDENTIAL_HEADERS`` (``Authorization``,
``Proxy-Authorization``, Azure's ``api-key``, ``x-api-key``, ``Cookie``) is the default
scope, so two clients that differ in any one of them never share an answer, a flight or a
batch, whichever header their backend reads.

Both come from the headers as the client sent them, before hop-by-hop stripping (so a
``Connection: authorization`` cannot move a request into another scope), and in canonical
form: whitespace runs collapsed and trimmed, an auth scheme in lower case (RFC 9110 11.1),
so ``bearer  K`` and ``Bearer K`` are one tenant.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping

from gateway.errors import UnknownTenant

CREDENTIAL_HEADERS = ("authorization", "proxy-authorization", "api-key", "x-api-key", "cookie")
"""Request headers that carry a credential: the default ``cache.scope_headers``, and what a
rate limit tells tenants apart by."""
KEY_HEADERS = ("authorization", "proxy-authorization", "api-key", "x-api-key")
"""The credential headers that carry an API key (``tenants:`` matches their keys)."""
_SCHEMED = frozenset({"authorization", "proxy-authorization"})
_CREDENTIALS = frozenset(CREDENTIAL_HEADERS)


def canonical(name: str, value: str) -> str:
    """A header value as the scope and the rate limit compare it."""
    value = " ".join(value.split())
    if name.lower() in _SCHEMED:
        scheme, sep, rest = value.partition(" ")
        return scheme.lower() + sep + rest
    return value


def scope_hash(headers: Iterable[tuple[str, str]], scope_headers: Iterable[str]) -> str:
    """A hash of the scope headers' canonical values: equal only for the same tenant.

    A missing header and an empty one hash differently; an empty ``scope_headers`` makes one
    scope shared by all clients (only for a single-tenant deployment).  Computed for every
    request that is cached, coalesced, batched or binds ids, so its parts are prepared once
    per set of scope headers (``_scope_parts``).
    """
    wanted, heads = _scope_parts(
        scope_headers if isinstance(scope_headers, tuple) else tuple(scope_headers)
    )
    values: dict[str, list[str]] = {}
    for name, value in headers:
        lower = name.lower()
        if lower in wanted:
            found = values.get(lower)
            if found is None:
                found = values[lower] = []
            found.append(canonical(lower, value))
    parts = [b"scope\x00"]
    for name, head in heads:
        found = values.get(name)
        parts += (head, json.dumps(found).encode() if found else b"[]", b"\x00")
    return hashlib.sha256(b"".join(parts)).hexdigest()[:32]


@functools.lru_cache(maxsize=64)
def _scope_parts(scope_headers: tuple[str, ...]) -> tuple[frozenset[str], list[tuple[str, bytes]]]:
    """The lower-case names of ``scope_headers``, and each name with what its value's part
    of the hash opens with."""
    names = [h.lower() for h in scope_headers]
    return frozenset(names), [(n, n.encode() + b"\x00") for n in names]


def credential_key(headers: Iterable[tuple[str, str]]) -> str | None:
    """A hash of every credential the request carries (never kept in clear), or None when
    it carries none (no credential header, or only empty ones)."""
    if not any(name.lower() in _CREDENTIALS and value.strip() for name, value in headers):
        return None
    return "cred:" + scope_hash(headers, CREDENTIAL_HEADERS)[:24]


def address_key(client: str) -> str:
    """The rate-limit key of a request without a credential: its client's address."""
    return "addr:" + client


def api_keys(headers: Iterable[tuple[str, str]]) -> list[str]:
    """The API keys a request offers, one per key header: ``Authorization``'s credential
    after its scheme (``Bearer sk-...`` offers ``sk-...``), ``api-key``'s whole value."""
    keys: list[str] = []
    for name, value in headers:
        lower = name.lower()
        if lower not in KEY_HEADERS:
            continue
        value = value.strip()
        if lower in _SCHEMED:
            value = value.partition(" ")[2].strip()
        if value:
            keys.append(value)
    return keys


def key_digest(key: str) -> str:
    """The sha256 hex of an API key, as ``tenants.keys[].sha256`` holds it
    (``printf %s "$KEY" | sha256sum``)."""
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


class NamedTenants:
    """The policy's named tenants (``tenants:``), looked up by the hash of a request's key."""

    def __init__(self, by_digest: Mapping[str, str], *, required: bool) -> None:
        self._by_digest = dict(by_digest)
        self.required = required

    def identify(self, headers: Iterable[tuple[str, str]]) -> str:
        """The named tenant whose key the request offers, "" for none; ``UnknownTenant``
        when keys are required and none is listed, or when keys of two tenants are
        offered."""
        names = {self._by_digest.get(key_digest(key)) for key in api_keys(headers)}
        names.discard(None)
        if len(names) > 1:
            raise UnknownTenant("the request offers the keys of more than one tenant")
        if names:
            return str(names.pop())
        if self.required:
            raise UnknownTenant("no API key of a known tenant was offered")
        return ""

    def __repr__(self) -> str:
        return f"<NamedTenants keys={len(self._by_digest)} required={self.required}>"
