"""Real distributed Redis topologies for the tests, all ``redis-server`` on loopback ports.

``Cluster``: ``masters`` masters (slots split evenly) with ``replicas`` replicas each, set up
with ``CLUSTER ADDSLOTSRANGE``, ``MEET`` and ``REPLICATE`` (no ``redis-cli``), ready once
every node says ``cluster_state:ok`` and every replica's link to its master is up.
``Sentinels``: one master, one replica and three sentinels monitoring it as ``mymaster``,
ready once every sentinel knows the replica and the other two sentinels.  Both take short
timeouts (a failover within a few seconds) and can kill a node with SIGKILL.

Fixtures (a plugin of ``conftest.py``: a test module names them without importing them, so
the session has one cluster): ``redis_cluster`` (three masters, no replicas, for the
behaviour tests) and ``redis_target``, parametrised over ``standalone`` and ``cluster``:
the gateway's own ``redis:`` settings for either, so one test runs against both.
"""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis

from gateway.policy.redis import Redis as RedisSettings
from gateway.policy.show import to_data
from gateway.redis import RedisLink
from tests.redis_server import REDIS_BINARY, RedisServer, free_port

SLOTS = 16384
SERVICE = "mymaster"
ADMIN_TIMEOUT_S = 5.0
"""The tests' own clients wait long: a loaded machine must not fail a test's setup."""


def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    """Poll ``check`` until it holds (a server's state, reached in real time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if check():
                return
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis: {what} not reached in {timeout_s:.0f} s")
        time.sleep(0.05)


def client(server: RedisServer) -> redis.Redis:
    return redis.Redis(port=server.port, socket_timeout=2, decode_responses=True)


class Cluster:
    """A Redis Cluster of ``masters`` masters with ``replicas`` replicas each."""

    def __init__(self, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        options = [
            "--cluster-enabled",
            "yes",
            "--cluster-node-timeout",
            str(node_timeout_ms),
            "--cluster-replica-validity-factor",
            "0",  # a replica always stands for election, however long its master was gone
        ]
        # the bus on a port of its own: the default (port + 10000) may be taken or past 65535
        self.bus: dict[int, int] = {}
        self.masters = [self._node(options) for _ in range(masters)]
        self.replicas = [self._node(options) for _ in range(masters * replicas)]
        self.settings = RedisSettings(mode="cluster", nodes=tuple(s.address for s in self.masters))

    def _node(self, options: list[str]) -> RedisServer:
        bus = free_port()
        server = RedisServer(args=[*options, "--cluster-port", str(bus)])
        self.bus[server.port] = bus
        return server

    @property
    def servers(self) -> list[RedisServer]:
        return self.masters + self.replicas

    def start(self) -> None:
        for server in self.servers:
            server.start()
        first = client(self.masters[0])
        share = SLOTS // len(self.masters)
        for i, server in enumerate(self.masters):
            last = SLOTS - 1 if i == len(self.masters) - 1 else (i + 1) * share - 1
            client(server).execute_command("CLUSTER ADDSLOTSRANGE", i * share, last)
        for server in self.servers[1:]:
            first.execute_command("CLUSTER MEET", "127.0.0.1", server.port, self.bus[server.port])
        everyone = len(self.servers)
        wait_for(lambda: all(len(self._nodes(s)) == everyone for s in self.servers), "meet")
        ids = [client(s).cluster("myid") for s in self.masters]
        for i, replica in enumerate(self.replicas):
            master = ids[i % len(self.masters)]
            wait_for(functools.partial(self._knows_master, replica, master), "master known")
            client(replica).execute_command("CLUSTER REPLICATE", master)
        wait_for(self.ready, "cluster_state:ok with every replica in sync")

    def ready(self) -> bool:
        """Every running node says the cluster is ok, and every running replica is in sync."""
        for server in self.servers:
            if not server.running:
                continue
            if client(server).cluster("info").get("cluster_state") != "ok":
                return False
        for server in self.replicas:
            info = client(server).info("replication") if server.running else {}
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def primary_of(self, key: str) -> RedisServer:
        """The server serving ``key``'s slot now."""
        slot = int(client(self.masters[0]).cluster("keyslot", key))
        for server in self.servers:
            if not server.running:
                continue
            me = next(n for n in self._nodes(server).values() if "myself" in n["flags"])
            if "master" in me["flags"] and any(
                int(low) <= slot <= int(high) for low, high in me["slots"]
            ):
                return server
        raise LookupError(f"no running master serves slot {slot}")

    def keys_by_master(self, pattern: str) -> dict[int, list[str]]:
        """The keys matching ``pattern`` on each running master, by its port."""
        found: dict[int, list[str]] = {}
        for server in self.servers:
            if server.running and client(server).info("replication")["role"] == "master":
                found[server.port] = list(client(server).scan_iter(match=pattern))
        return found

    def close(self) -> None:
        for server in self.servers:
            server.close()

    @staticmethod
    def _nodes(server: RedisServer) -> dict[str, Any]:
        """``CLUSTER NODES`` as redis-py parses it: address -> node_id, flags, slots..."""
        return dict(client(server).cluster("nodes"))

    def _knows_master(self, replica: RedisServer, master_id: str) -> bool:
        return any(n["node_id"] == master_id for n in self._nodes(replica).values())

    def __repr__(self) -> str:
        return f"<Cluster masters={len(self.masters)} replicas={len(self.replicas)}>"


class Sentinels:
    """One master, one replica and three sentinels monitoring it as ``mymaster``."""

    def __init__(self, down_after_ms: int = 1000) -> None:
        self.master = RedisServer()
        self.replica = RedisServer(args=["--replicaof", "127.0.0.1", str(self.master.port)])
        self.sentinels = [RedisServer() for _ in range(3)]
        for sentinel in self.sentinels:
            config = Path(sentinel.dir) / "sentinel.conf"
            config.write_text(
                f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
                f"sentinel failover-timeout {SERVICE} 10000\n"
            )
            sentinel.args = (str(config), "--sentinel")
        self.settings = RedisSettings(
            mode="sentinel", nodes=tuple(s.address for s in self.sentinels), service=SERVICE
        )

    def start(self) -> None:
        for server in (self.master, self.replica, *self.sentinels):
            server.start()
        wait_for(self.ready, "sentinels that know the replica and each other")

    def ready(self) -> bool:
        for sentinel in self.sentinels:
            state = cast(dict[str, Any], client(sentinel).sentinel_master(SERVICE))
            if int(state["num-slaves"]) < 1 or int(state["num-other-sentinels"]) < 2:
                return False
        return client(self.replica).info("replication")["master_link_status"] == "up"

    def master_port(self) -> int:
        """The master's port as the first sentinel reports it now."""
        address = client(self.sentinels[0]).sentinel_get_master_addr_by_name(SERVICE)
        return int(cast(tuple[str, int], address)[1])

    def close(self) -> None:
        for server in (*self.sentinels, self.replica, self.master):
            server.close()

    def __repr__(self) -> str:
        return f"<Sentinels master={self.master.port} replica={self.replica.port}>"


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[Cluster]:
    """A three-master cluster for the session (the behaviour tests never kill it)."""
    if REDIS_BINARY is None:
        pytest.skip("needs a redis-server binary")
    cluster = Cluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()


def settings_for(request: pytest.FixtureRequest, mode: str) -> RedisSettings:
    """The ``redis:`` settings of the session's ``standalone`` server or ``cluster``."""
    if mode == "cluster":
        cluster: Cluster = request.getfixturevalue("redis_cluster")
        return cluster.settings
    return RedisSettings(url=request.getfixturevalue("redis_url"))


def admin_client(settings: RedisSettings) -> Any:
    """A redis-py client of the test's own for ``settings`` (a Cluster client for a
    cluster), to look at and tamper with the keys."""
    return RedisLink.connect(settings, socket_timeout_s=ADMIN_TIMEOUT_S).client


@pytest.fixture
async def redis_admin(redis_target: RedisSettings) -> AsyncIterator[Any]:
    """``admin_client`` of ``redis_target``, closed after the test."""
    made = admin_client(redis_target)
    yield made
    await made.aclose()


def policy_section(settings: RedisSettings) -> dict[str, Any]:
    """``settings`` as a policy's ``redis:`` section (what differs from the defaults)."""
    data = to_data(settings, redact=False)
    return {k: v for k, v in data.items() if v != to_data(RedisSettings(), redact=False)[k]}


@pytest.fixture(params=["standalone", "cluster"])
def redis_target(request: pytest.FixtureRequest) -> RedisSettings:
    """The gateway's ``redis:`` settings for a standalone Redis or a three-master cluster."""
    return settings_for(request, request.param)
