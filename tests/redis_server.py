"""A real Redis for the store contract suite.

``RedisServer`` starts ``redis-server --port <free> --save '' --appendonly no`` in a temp
directory and can be stopped and restarted on the same port (to kill Redis mid-test).
Fixtures: ``redis_url`` (one server per session, or ``REDIS_URL``; skipped when neither)
and ``redis_server`` (a private server per test, for tests that kill it; skipped without the
binary).  Servers are always stopped afterwards.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence

import pytest

REDIS_BINARY = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A throwaway redis-server process on a fixed port."""

    def __init__(self, port: int | None = None, args: Sequence[str] = ()) -> None:
        if REDIS_BINARY is None:
            raise RuntimeError("no redis-server binary")
        self.port = port or free_port()
        self.args = tuple(args)
        """More options (``--cluster-enabled yes``, ``--replicaof ...``); a first argument
        that is a file is the config file, as for ``redis-server FILE --sentinel``."""
        self.dir = tempfile.mkdtemp(prefix="gw-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS_BINARY is not None
        config = [self.args[0]] if self.args and not self.args[0].startswith("--") else []
        self._proc = subprocess.Popen(
            [
                REDIS_BINARY,
                *config,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                self.dir,
                *self.args[len(config) :],
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    return
            except OSError:
                time.sleep(0.01)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=5)
            self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self._proc is not None else "stopped"
        return f"<RedisServer port={self.port} {state}>"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis URL for the session: a private server when the binary exists, else
    ``REDIS_URL``; the test is skipped when there is neither."""
    if REDIS_BINARY is not None:
        with RedisServer() as server:
            yield server.url
    elif os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
    else:
        pytest.skip("needs a redis-server binary or REDIS_URL")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private redis-server this test may stop and start again."""
    if REDIS_BINARY is None:
        pytest.skip("needs a redis-server binary (an external REDIS_URL cannot be killed)")
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.close()
