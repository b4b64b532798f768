"""Cache stores: where answers live.  ``memory`` (default) and ``redis`` (shared)."""

from .base import CacheStore, Candidate, StoreStats
from .memory import MemoryStore
from .redis import RedisStore

__all__ = ["CacheStore", "Candidate", "MemoryStore", "RedisStore", "StoreStats"]
