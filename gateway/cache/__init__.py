"""Response caching that is safe by design: exact, near-duplicate (SimHash) and embedding
tiers, and the stage that applies them.

stage.py          the cache stage: whole answers (lookup, hit replies, tee into the store)
item_stage.py     per-item caching for /v1/embeddings, and each route's ``RouteRules``
keys.py           what is cacheable; exact key, context key (the tenant scope: ../tenant.py)
normalize.py      a message reduced to comparable tokens, quoted spans and code
simhash.py        64-bit fingerprints and their bands
guard.py          the check every near-duplicate hit must pass
entry.py          CachedResponse and its serialised form
replies.py        hit replies in the shape asked for; ``Tee`` stores a stream once it ended
items.py          planning per-item lookups and assembling the answer
tiers.py          ResponseCache: the tiers over a store, store failures as misses
state.py          CacheState: the one store every caching route shares (registry: CACHE_STATE)
stores/           memory (LRU by bytes, TTL) and Redis (plain commands, health by evidence)
embedding_seam.py what the stage needs of an embedding tier, and how it gets one
embedding/        the embedding tier (MiniLM locally, or a backend's /v1/embeddings)
vector_stream.py  the shared embedding index's record format in Redis
evaluate.py       precision / recall / false-hit rate per tier and setting

SSE framing (JSON answers <-> event streams) is the OpenAI wire format's: ``gateway.openai.sse``.
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
