"""The redis-py client for the policy's ``redis:`` section: one server, a Cluster, or the
master a set of sentinels names.

* ``standalone``: ``redis.asyncio.Redis`` from the url; a command whose pooled connection
  has died (the server restarted since it was opened) is sent once more on a new
  connection, so a restart that finished costs no command.  Only connection errors are
  retried, never a timeout: a command that timed out may have run, and running the cache's
  ``DECRBY`` or the rate limits' script twice would skew them.
* ``cluster``: ``redis.asyncio.cluster.RedisCluster`` over the seed nodes, which reads the
  slot map from them and follows ``MOVED``/``ASK``; after a connection error it reads the
  map again before its next command, which is how it finds a promoted replica.  Its own
  retries are off (``Retry(..., 0)``): a cluster pipeline retried after a timeout re-sends
  the commands whose answer it had not read.  The seeds stay the seeds
  (``dynamic_startup_nodes=False``), so a managed service's configuration endpoint keeps
  being asked after the nodes behind it change.
* ``sentinel``: ``Sentinel(...).master_for(service)``: every new connection asks the
  sentinels for the master's address first; a connection to a master since demoted fails
  on its next write (``READONLY`` becomes a connection error) and the next one goes to the
  new master.

TLS (``tls: true`` or ``rediss://``) verifies the certificate against the system CAs or
``ca_file`` and its name against the address connected to.  Socket timeouts are short
(``SOCKET_TIMEOUT_S``): the callers' budgets are shorter still, and a command that ran past
its budget is awaited only to judge the server's health.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.policy.redis import DEFAULT_REDIS_URL, Redis, host_port

SOCKET_TIMEOUT_S = 0.2
"""Connecting and each read; past it a command fails (and is evidence of an outage)."""
MAX_CONNECTIONS_PER_NODE = 1024
"""A cluster node's pool; redis-py refuses a command at once past it, so it is generous."""


def client_for(settings: Redis, socket_timeout_s: float = SOCKET_TIMEOUT_S) -> tuple[Any, Any]:
    """The client for ``settings``, and what else must be closed with it (the sentinels'
    client, or None)."""
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": socket_timeout_s,
        "username": settings.username,
        "password": settings.password,
    }
    tls: dict[str, Any] = {}
    if settings.uses_tls:
        tls = {"ssl_ca_certs": settings.ca_file, "ssl_cert_reqs": "required"}
    once = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
    if settings.mode == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(*_address(node)) for node in settings.nodes],
            dynamic_startup_nodes=False,
            retry=Retry(NoBackoff(), 0),
            max_connections=MAX_CONNECTIONS_PER_NODE,
            ssl=bool(tls),
            **tls,
            **common,
        ), None
    if settings.mode == "sentinel":
        sentinels = Sentinel(
            [_address(node) for node in settings.nodes],
            sentinel_kwargs={
                "socket_timeout": socket_timeout_s,
                "socket_connect_timeout": socket_timeout_s,
                "password": settings.sentinel_password,
                "retry": Retry(NoBackoff(), 0),
                **({"ssl": True, **tls} if tls else {}),
            },
        )
        master = sentinels.master_for(
            settings.service or "", retry=once, **({"ssl": True, **tls} if tls else {}), **common
        )
        return master, sentinels
    url = settings.url or DEFAULT_REDIS_URL
    if settings.tls and url.startswith("redis://"):
        url = "rediss://" + url.removeprefix("redis://")
    options = {key: value for key, value in common.items() if value is not None}
    return aioredis.Redis.from_url(url, retry=once, **tls, **options), None


def _address(node: str) -> tuple[str, int]:
    address = host_port(node)
    if address is None:  # the policy's checks refuse it first
        raise ValueError(f"not host:port: {node!r}")
    return address
