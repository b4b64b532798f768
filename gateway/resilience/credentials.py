"""Who a rate limit counts, such that invented credentials cannot escape it.

A rate limit keyed on a credential alone is escaped by sending a new made-up one with every
request (against a backend that does not check keys, each gets its own fresh budget).  So a
credential is *new* until a backend has answered it with a success, and while it is new
its requests are counted twice: against its own budget, as every request is, and against
its client address's new-credential budget (``new:<address>``, ``NEWCOMER_FACTOR`` times
one tenant's), which every new credential from that address shares.  A client that invents
a key per request therefore gets at most twice one tenant's budget in all, and a real
tenant never more than its own: only its first request (or first few, while the answer is
on its way) also counts against its address's new-credential budget.

A named tenant (``tenants:`` in the policy, matched by its key's hash at the edge) is
counted by its name, and a request without any credential by its address.  The client
address is the forwarded one where the peer is a trusted proxy (``server.trusted_proxies``),
so tenants behind a shared ingress keep their own budgets.

What this does not stop: a client that reuses keys it made up, against a backend that
accepts any key, earns a budget per key.  ``tenants: {required: true}`` (only listed keys
are served; Envoy's descriptors and LiteLLM's virtual keys take the same stance) does.
"""

from __future__ import annotations

from collections import OrderedDict

from gateway.pipeline import Call
from gateway.policy.rate_limit import RateLimit
from gateway.resilience.rate_limit import scaled
from gateway.tenant import address_key, credential_key

DEFAULT_MAX_PROVEN = 100_000
"""Credentials remembered as proven at most; the least recently used are forgotten first
(and are new again on their next request, until a success proves them once more)."""
NEWCOMER_FACTOR = 2.0
"""An address's new-credential budget, in tenants' budgets."""
NEW_PREFIX = "new:"
TENANT_PREFIX = "tenant:"


def newcomer_limit(limit: RateLimit) -> RateLimit:
    """The new-credential budget of one address under ``limit``."""
    return scaled(limit, NEWCOMER_FACTOR)


class ProvenCredentials:
    """The credentials a backend has answered with a success: each has its own budget."""

    def __init__(self, max_size: int = DEFAULT_MAX_PROVEN) -> None:
        self.max_size = max_size
        self._seen: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        if key in self._seen:
            self._seen.move_to_end(key)
            return True
        return False

    def add(self, key: str) -> None:
        self._seen[key] = None
        self._seen.move_to_end(key)
        while len(self._seen) > self.max_size:
            self._seen.popitem(last=False)

    def __len__(self) -> int:
        return len(self._seen)

    def __repr__(self) -> str:
        return f"<ProvenCredentials {len(self._seen)}/{self.max_size}>"


class RateKey:
    """Who a call's rate limits count: ``key`` always, and ``newcomer`` (its address's
    new-credential budget) too while its credential is new."""

    __slots__ = ("key", "newcomer")

    def __init__(self, key: str, newcomer: str | None = None) -> None:
        self.key = key
        self.newcomer = newcomer

    def settle(self, status: int, proven: ProvenCredentials) -> None:
        """A success proves a new credential: its later calls count against its own
        budget only."""
        if self.newcomer is not None and 200 <= status < 300:
            proven.add(self.key)

    def __repr__(self) -> str:
        return f"<RateKey {self.key} newcomer={self.newcomer}>"


def rate_key_of(call: Call, proven: ProvenCredentials) -> RateKey:
    """Who the rate limits count for ``call``: its named tenant, its credential (and,
    while that is new, its address's new-credential budget), or without a credential its
    address."""
    if call.tenant:
        return RateKey(TENANT_PREFIX + call.tenant)
    credential = credential_key(call.received)
    if credential is None:
        return RateKey(address_key(call.client))
    if credential in proven:
        return RateKey(credential)
    return RateKey(credential, NEW_PREFIX + call.client)
