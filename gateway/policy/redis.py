"""The policy's ``redis:`` section: the one Redis the gateway shares state through (the
cache store, ``store: redis`` rate limits, the fleet's rate history, the embedding index
streams), a standalone server, a Redis Cluster or a Sentinel-managed master.

``cache.redis_url`` stays the standalone alias: ``effective`` folds it into the section
when the section names no server of its own, so the rest of the gateway reads
``policy.redis`` only.  ``check_redis`` holds the rules the types cannot say.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from gateway.policy.metadata import doc
from gateway.policy.show import redact_url

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
URL_SCHEMES = ("redis://", "rediss://", "unix://")

Found = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Redis:
    """Where the gateway's shared state lives, and how to reach it."""

    mode: Literal["standalone", "cluster", "sentinel"] = field(
        default="standalone",
        metadata=doc(
            "`standalone` (one server at `url`), `cluster` (Redis Cluster or Valkey "
            "cluster mode: `nodes` are seeds, the topology is read from them) or "
            "`sentinel` (`nodes` are the sentinels, `service` the master they monitor)."
        ),
    )
    url: str | None = field(
        default=None,
        metadata=doc(
            "`standalone`: `redis://host:port/db`, `rediss://` for TLS, or `unix://`. "
            "`cache.redis_url` is its alias (one of the two).",
            secret=True,
            env=True,
        ),
    )
    nodes: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "`cluster`: some of the cluster's nodes as `host:port` (a managed service's "
            "configuration endpoint will do); `sentinel`: the sentinels, `host:port`."
        ),
    )
    service: str | None = field(
        default=None, metadata=doc("`sentinel`: the name the sentinels monitor the master by.")
    )
    username: str | None = field(
        default=None, metadata=doc("ACL user (Redis 6+); `${ENV}` allowed.", env=True)
    )
    password: str | None = field(
        default=None,
        metadata=doc(
            "Password of `username` (or of `requirepass`); `${ENV}` allowed, redacted "
            "wherever the policy is shown.",
            secret=True,
            env=True,
        ),
    )
    sentinel_password: str | None = field(
        default=None,
        metadata=doc(
            "`sentinel`: the sentinels' own password, when they ask for one (often the "
            "same `${ENV}` as `password`).",
            secret=True,
            env=True,
        ),
    )
    tls: bool = field(
        default=False,
        metadata=doc(
            "TLS to every node (and sentinel), the certificate verified against the system "
            "CAs or `ca_file`, its name against the address connected to. A `rediss://` "
            "url says the same."
        ),
    )
    ca_file: str | None = field(
        default=None, metadata=doc("PEM file of the CAs that sign the servers' certificates.")
    )

    @property
    def uses_tls(self) -> bool:
        return self.tls or (self.url or "").startswith("rediss://")

    def where(self) -> str:
        """The servers, without credentials (for logs and ``repr``)."""
        if self.mode == "standalone":
            return redact_url(self.url or DEFAULT_REDIS_URL)
        names = ",".join(self.nodes)
        return f"{self.service}@{names}" if self.mode == "sentinel" else names


def effective(redis: Redis, cache_redis_url: str) -> Redis:
    """The section with ``cache.redis_url`` standing in for a standalone ``url`` not given."""
    if redis.mode == "standalone" and redis.url is None:
        return dataclasses.replace(redis, url=cache_redis_url)
    return redis


def check_redis(redis: Redis, alias_given: bool) -> Found:
    """``redis``: what each mode needs and refuses; ``alias_given`` when the policy also
    wrote ``cache.redis_url`` (keys relative to ``redis``; ``..`` is the alias)."""
    found: Found = []

    def bad(key: str, message: str) -> None:
        found.append((key, message))

    if redis.mode == "standalone":
        for key in ("nodes", "service", "sentinel_password"):
            if getattr(redis, key):
                bad(key, "only for `mode: cluster` or `mode: sentinel`")
        if redis.url is not None:
            if not redis.url.startswith(URL_SCHEMES):
                bad("url", f"must start with redis://, rediss:// or unix://, not {redis.url!r}")
            elif "@" in redis.url.split("://", 1)[1].split("/", 1)[0] and (
                redis.username or redis.password
            ):
                bad("password", "the url carries credentials already: give them once")
            if alias_given:
                bad("url", "`cache.redis_url` is its alias: give one of the two")
    else:
        if redis.url is not None:
            bad("url", f"only for `mode: standalone` (`mode: {redis.mode}` takes `nodes`)")
        elif alias_given:
            bad(
                "mode", f"`cache.redis_url` is for a standalone Redis: with `{redis.mode}`, drop it"
            )
        if not redis.nodes:
            what = "seed nodes" if redis.mode == "cluster" else "sentinels"
            bad("nodes", f"`mode: {redis.mode}` needs its {what} as host:port")
        for i, node in enumerate(redis.nodes):
            if host_port(node) is None:
                bad(f"nodes[{i}]", f"must be host:port with a port from 1 to 65535, not {node!r}")
        if redis.mode == "sentinel" and not (redis.service or "").strip():
            bad("service", "`mode: sentinel` needs the master's name the sentinels monitor")
        if redis.mode == "cluster":
            for key in ("service", "sentinel_password"):
                if getattr(redis, key):
                    bad(key, "only for `mode: sentinel`")
    if redis.ca_file is not None and not redis.uses_tls:
        bad("ca_file", "applies only with `tls: true` (or a rediss:// url)")
    return found


def host_port(node: str) -> tuple[str, int] | None:
    """``host:port`` (``[v6]:port`` too) as a pair; None when it is not one."""
    host, sep, port = node.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)
