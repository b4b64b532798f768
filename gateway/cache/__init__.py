"""Response caching that is safe by design: exact and near-duplicate (SimHash) tiers.

keys.py       what is cacheable; exact key, context key (the tenant scope: ../tenant.py)
normalize.py  a message reduced to comparable tokens, quoted spans and code
simhash.py    64-bit fingerprints and their bands
guard.py      the check every near-duplicate hit must pass
entry.py      CachedResponse and its serialised form
replay.py     JSON answers <-> SSE streams; which streams may be stored
items.py      per-item caching for /v1/embeddings
tiers.py      ResponseCache: the tiers over a store, store failures as misses
stores/       memory (LRU by bytes, TTL) and Redis (plain commands, circuit)
evaluate.py   precision / recall / false-hit rate per tier and setting
"""

from gateway.cache.entry import CachedResponse
from gateway.cache.guard import Verdict, check
from gateway.cache.keys import Cacheability, RequestKey, cacheability, request_key
from gateway.cache.tiers import EXACT, SIMHASH, Hit, ResponseCache
from gateway.tenant import scope_hash

__all__ = [
    "EXACT",
    "SIMHASH",
    "Cacheability",
    "CachedResponse",
    "Hit",
    "RequestKey",
    "ResponseCache",
    "Verdict",
    "cacheability",
    "check",
    "request_key",
    "scope_hash",
]
