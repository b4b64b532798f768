"""The one Redis layer (``gateway/redis/``) and the policy's ``redis:`` section: each mode
parses, ``cache.redis_url`` stays the standalone alias, mistakes are named by key path and
line, credentials come from the environment and are never shown; ``rediss://`` verifies the
server's certificate; a purge of everything reaches every Cluster master; and the layer's
figures reach ``/metrics``."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.cache.entry import CachedResponse
from gateway.cache.stores import RedisStore
from gateway.errors import PolicyError, StoreError
from gateway.policy.load import parse_policy_text
from gateway.policy.model import Redis
from gateway.redis import REDIS_LINK
from tests.helpers import CHAT, write_policy
from tests.redis_cluster import Cluster
from tests.redis_server import REDIS_BINARY, RedisServer, free_port

BACKENDS = "backends: {main: {url: 'http://main.test'}}\nroutes: []\n"


def problems(text: str) -> list[str]:
    with pytest.raises(PolicyError) as info:
        parse_policy_text(BACKENDS + text)
    return str(info.value).splitlines()


def entry(text: str) -> CachedResponse:
    return CachedResponse(200, (), text.encode(), None, 1.0, "main", "v1", "r", "")


# -- the policy ----------------------------------------------------------------------------


def test_each_mode_parses_and_cache_redis_url_is_the_standalone_alias() -> None:
    assert parse_policy_text(BACKENDS).redis == Redis(url="redis://127.0.0.1:6379/0")
    aliased = parse_policy_text(BACKENDS + "cache: {store: redis, redis_url: 'redis://r:1/2'}")
    assert aliased.redis == Redis(url="redis://r:1/2")
    cluster = parse_policy_text(BACKENDS + "redis: {mode: cluster, nodes: ['a:1', '[::1]:2']}")
    assert cluster.redis.nodes == ("a:1", "[::1]:2") and cluster.redis.url is None
    sentinel = parse_policy_text(
        BACKENDS + "redis: {mode: sentinel, nodes: ['s:26379'], service: mymaster, tls: true}"
    )
    assert sentinel.redis.service == "mymaster" and sentinel.redis.uses_tls
    assert parse_policy_text(BACKENDS + "redis: {url: 'rediss://r:6380/0'}").redis.uses_tls


def test_redis_mistakes_are_named_by_key_path_and_line() -> None:
    found = problems(
        "cache: {redis_url: 'redis://elsewhere:6379/0'}\n"
        "redis:\n"
        "  mode: cluster\n"
        "  nodes: ['a:1', 'no-port', 'b:70000']\n"
        "  service: mymaster\n"
        "  ca_file: /etc/ca.pem\n"
    )
    assert found == [
        "<policy>:5: redis.mode: `cache.redis_url` is for a standalone Redis: with `cluster`, "
        "drop it",
        "<policy>:6: redis.nodes[1]: must be host:port with a port from 1 to 65535, not 'no-port'",
        "<policy>:6: redis.nodes[2]: must be host:port with a port from 1 to 65535, not 'b:70000'",
        "<policy>:7: redis.service: only for `mode: sentinel`",
        "<policy>:8: redis.ca_file: applies only with `tls: true` (or a rediss:// url)",
    ]
    assert problems("redis: {mode: sentinel, nodes: []}") == [
        "<policy>:3: redis.nodes: `mode: sentinel` needs its sentinels as host:port",
        "<policy>:3: redis.service: `mode: sentinel` needs the master's name the sentinels monitor",
    ]
    assert problems("redis: {url: 'http://r:1', nodes: ['a:1']}") == [
        "<policy>:3: redis.nodes: only for `mode: cluster` or `mode: sentinel`",
        "<policy>:3: redis.url: must start with redis://, rediss:// or unix://, not 'http://r:1'",
    ]
    assert problems(
        "cache: {redis_url: 'redis://a:1/0'}\nredis: {url: 'redis://u:p@b:1/0', password: x}"
    ) == [
        "<policy>:4: redis.password: the url carries credentials already: give them once",
        "<policy>:4: redis.url: `cache.redis_url` is its alias: give one of the two",
    ]
    assert problems("redis: {mode: galaxy}")[0].startswith("<policy>:3: redis.mode: must be one of")


# -- credentials and TLS -------------------------------------------------------------------


@pytest.fixture
def guarded() -> Iterator[RedisServer]:
    """A redis-server that asks for a password."""
    if REDIS_BINARY is None:
        pytest.skip("needs a redis-server binary")
    server = RedisServer(args=["--requirepass", "s3cret-pw"])
    server.start()
    try:
        yield server
    finally:
        server.close()


async def test_credentials_from_the_environment_work_and_are_never_shown(
    guarded: RedisServer, start_gateway: Any, serve_app: Any, tmp_path: Path, monkeypatch: Any
) -> None:
    """``password: ${ENV}`` reaches Redis; ``GET /policy`` shows neither it nor the url; a
    wrong password costs misses (Redis is taken for down), never a failed request."""
    from tests.upstreams import Recorder

    backend = await serve_app(Recorder().app())
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret-pw")
    data = {
        "backends": {"main": {"url": backend}},
        "cache": {"store": "redis"},
        "redis": {"url": guarded.url, "password": "${REDIS_PASSWORD}"},
        "routes": [{"match": {"path": "/v1/*"}, "backend": "main", "cache": {"ttl_s": 60}}],
    }
    gw = await start_gateway(policy=write_policy(tmp_path, data))
    body = {**CHAT, "temperature": 0}
    async with httpx.AsyncClient() as client:
        results = []
        for _ in range(3):
            answer = await client.post(gw.url + "/v1/chat/completions", json=body)
            results.append((answer.status_code, answer.headers.get("X-Gateway-Cache")))
        shown = await client.get(gw.admin_url + "/policy")
    assert results[0] == (200, "miss") and (200, "hit") in results[1:]
    assert "s3cret-pw" not in shown.text and guarded.url not in shown.text
    assert shown.json()["policy"]["redis"]["password"] == "***"

    monkeypatch.setenv("REDIS_PASSWORD", "wrong")
    wrong = await start_gateway(policy=write_policy(tmp_path, data, "wrong.yaml"))
    async with httpx.AsyncClient() as client:
        statuses = [
            (await client.post(wrong.url + "/v1/chat/completions", json=body)).status_code
            for _ in range(4)
        ]
    link = wrong.gateway.registry.peek(REDIS_LINK)
    assert statuses == [200] * 4 and link is not None and not link.up
    assert "AuthenticationError" in str(link.last_failure)


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA and a server certificate for 127.0.0.1 it signed (``openssl``)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command")
    d = tmp_path_factory.mktemp("tls")  # no spaces in it: the commands are split on them
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ec = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1"
    for command in (
        f"req -x509 {ec} -keyout {d}/ca.key -out {d}/ca.crt -subj /CN=gateway-test-ca",
        f"req {ec} -keyout {d}/s.key -out {d}/s.csr -subj /CN=redis",
        f"x509 -req -in {d}/s.csr -CA {d}/ca.crt -CAkey {d}/ca.key -CAcreateserial "
        f"-out {d}/s.crt -days 1 -extfile {d}/san.cnf",
    ):
        subprocess.run(["openssl", *command.split()], check=True, capture_output=True)
    files = {name: str(d / name) for name in ("ca.crt", "s.crt", "s.key")}
    return files


@pytest.fixture
def tls_redis(tls_files: dict[str, str]) -> Iterator[RedisServer]:
    """A redis-server that speaks only TLS, on its port."""
    if REDIS_BINARY is None:
        pytest.skip("needs a redis-server binary")
    port = free_port()
    server = RedisServer(
        port,
        args=[
            *("--port", "0", "--tls-port", str(port), "--tls-auth-clients", "no"),
            *("--tls-cert-file", tls_files["s.crt"], "--tls-key-file", tls_files["s.key"]),
            *("--tls-ca-cert-file", tls_files["ca.crt"]),
        ],
    )
    server.start()
    try:
        yield server
    finally:
        server.close()


async def test_rediss_verifies_the_servers_certificate(
    tls_redis: RedisServer, tls_files: dict[str, str]
) -> None:
    """Against the CA that signed it, by ``rediss://`` or ``tls: true``: the store works;
    against the system CAs the certificate is refused, and that is a miss."""
    address = f"127.0.0.1:{tls_redis.port}"
    for settings in (
        Redis(url=f"rediss://{address}/0", ca_file=tls_files["ca.crt"]),
        Redis(url=f"redis://{address}/0", tls=True, ca_file=tls_files["ca.crt"]),
    ):
        store = RedisStore.connect(settings, prefix=f"t{uuid.uuid4().hex[:8]}:", budget_s=1.0)
        try:
            await store.set("k", entry("over TLS"), 60)
            found = await store.get("k")
            assert found is not None and found.body == b"over TLS"
        finally:
            await store.purge()
            await store.close()
    unverified = RedisStore.connect(Redis(url=f"rediss://{address}/0"), budget_s=1.0)
    try:
        with pytest.raises(StoreError, match="certificate verify failed"):
            await unverified.get("k")
    finally:
        await unverified.close()


# -- the Cluster ---------------------------------------------------------------------------


async def test_a_purge_of_everything_scans_every_master(redis_cluster: Cluster) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    store = RedisStore.connect(redis_cluster.settings, prefix=prefix, budget_s=1.0)
    try:
        await store.set_many([(f"k{i}", entry(str(i))) for i in range(30)], 60)
        before = redis_cluster.keys_by_master(prefix + "*")
        assert len(before) == 3 and all(keys for keys in before.values())
        assert await store.purge() == 30
        assert redis_cluster.keys_by_master(prefix + "*") == {port: [] for port in before}
    finally:
        await store.close()


async def test_the_links_state_is_in_its_repr_and_its_figures(redis_cluster: Cluster) -> None:
    store = RedisStore.connect(redis_cluster.settings, budget_s=1.0)
    try:
        assert await store.get("nothing") is None
        link = store.link
        assert repr(link).startswith("<RedisLink cluster 127.0.0.1:")
        assert " up errors=0 late=0>" in repr(link)
        figures = link.figures()
        assert (figures.mode, figures.up, figures.transitions) == ("cluster", True, 0)
        assert dict(figures.failures) == {"budget": 0, "unreached": 0, "answered": 0, "down": 0}
    finally:
        await store.close()


async def test_the_clients_own_fault_is_a_store_error_never_the_requests(
    redis_cluster: Cluster,
) -> None:
    """redis-py's asyncio connection, closed by a failover under a command in flight, raises
    ``AttributeError`` (its writer gone): the link takes it as Redis unreached, a miss for
    the request, as it does a refused connection; the next command goes through."""
    store = RedisStore.connect(redis_cluster.settings, budget_s=1.0)
    try:
        link = store.link

        async def closed_under_it() -> None:
            raise AttributeError("'NoneType' object has no attribute 'writelines'")

        with pytest.raises(StoreError, match="AttributeError"):
            await link.run("get", closed_under_it, 1.0)
        assert link.figures().failures["unreached"] == 1
        assert "AttributeError" in (link.last_failure or "")
        assert await store.get("nothing") is None  # the next command goes through
        assert link.up
    finally:
        await store.close()
