"""Cache stores: where answers live.  ``memory`` (default) and ``redis`` (shared)."""

from gateway.cache.stores.base import CacheStore, Candidate, StoreStats
from gateway.cache.stores.memory import MemoryStore
from gateway.cache.stores.redis import RedisStore

__all__ = ["CacheStore", "Candidate", "MemoryStore", "RedisStore", "StoreStats"]
