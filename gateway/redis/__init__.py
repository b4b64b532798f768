"""The one Redis layer: every user of the gateway's shared state reaches Redis through it.

``connect.py``   the redis-py client for the policy's ``redis:`` section (standalone,
                 ``rediss://`` with TLS verification, Cluster, Sentinel)
``link.py``      ``RedisLink``: commands under a budget, errors translated once into
                 ``StoreError``, the down state and its background probe
``health.py``    ``Health``: whether Redis is up, by the evidence of its commands
``keys.py``      hash tags, so keys used together share a Cluster slot
``shared.py``    the gateway's one link, in the registry (``REDIS_LINK``)

Its users: the cache store (``cache/stores/redis.py``, and through it the embedding index
streams), the shared rate limits (``resilience/rate_redis.py``), the shared concurrency
caps (``resilience/concurrency_redis.py``) and the fleet's rate
history (``pool/shared.py``).
"""

from gateway.redis.health import Health
from gateway.redis.link import RedisLink
from gateway.redis.shared import REDIS_LINK, shared_link

__all__ = ["REDIS_LINK", "Health", "RedisLink", "shared_link"]
