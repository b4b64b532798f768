"""One worker process, as its supervisor sees it: ``python -m gateway ... serve --worker
SOCKET``, which shares the data port (``SO_REUSEPORT``) and serves its admin app on the Unix
socket ``SOCKET`` in the supervisor's private directory (mode 0700: only its user reaches
it, so the worker takes it for a loopback-bound admin port).

Its stdin is a pipe from the supervisor: should the supervisor die, the pipe closes and
the worker drains and exits, so no orphan keeps the port.  Its first line on stdout says
it listens, printed once its signal handlers are in place (a SIGHUP before that would end
it).  The rest of its output (logs, the access log) goes to the supervisor's stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Literal

import aiohttp
from prometheus_client.metrics_core import Metric

from gateway.errors import WorkerError
from gateway.metrics.merged import parse

log = logging.getLogger("gateway.workers")
State = Literal["starting", "running", "exited"]
REQUEST_TIMEOUT_S = 2.0
"""The most a call to a worker's admin socket may take (a scrape, a readiness probe)."""


class Worker:
    """A worker process: its pid, state, admin socket, and what it showed last."""

    def __init__(self, index: int, proc: asyncio.subprocess.Process, socket_path: str) -> None:
        self.index = index
        self.proc = proc
        self.socket_path = socket_path
        self.started_at = time.monotonic()
        self.state: State = "starting"
        self.last: list[Metric] = []
        """Its metric families at the last scrape (kept when it exits: ``Retired``)."""
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._output: asyncio.Task[None] | None = None

    @classmethod
    async def spawn(cls, index: int, args: Sequence[str], socket_path: str) -> Worker:
        """Start ``python -m gateway <args> --worker <socket_path>``."""
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway",
                *args,
                "--worker",
                socket_path,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise WorkerError(f"worker {index} could not be started: {exc}") from exc
        return cls(index, proc, socket_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.state == "running"

    def lived_s(self) -> float:
        return time.monotonic() - self.started_at

    async def listening(self, timeout_s: float) -> None:
        """Wait for its line saying it listens; WorkerError if it exits first or is late
        (then it is killed)."""
        assert self.proc.stdout is not None
        try:
            async with asyncio.timeout(timeout_s):
                line = await self.proc.stdout.readline()
        except TimeoutError:
            self.kill()
            raise WorkerError(
                f"worker {self.index} (pid {self.pid}) did not listen within {timeout_s:g} s"
            ) from None
        if not line:
            code = await self.proc.wait()
            self.state = "exited"
            raise WorkerError(f"worker {self.index} (pid {self.pid}) exited with {code} at start")
        self.state = "running"
        self._output = asyncio.get_running_loop().create_task(self._drain_output())
        log.info("worker %d (pid %d) listening", self.index, self.pid)

    async def _drain_output(self) -> None:
        assert self.proc.stdout is not None
        while await self.proc.stdout.readline():
            pass

    def signal(self, signum: signal.Signals) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signum)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)

    async def wait(self) -> int:
        code = await self.proc.wait()
        self.state = "exited"
        return code

    # -- its admin socket -----------------------------------------------------------------
    async def call(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """One request to its admin app: (status, body)."""
        if self._closed:
            raise WorkerError(f"worker {self.index} (pid {self.pid}) has exited")
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.socket_path),
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            )
        try:
            async with self._session.request(
                method, "http://worker" + path, data=body or None, headers=headers
            ) as answer:
                return answer.status, await answer.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise WorkerError(f"worker {self.index} (pid {self.pid}): {exc!r}") from exc

    async def ready(self) -> bool:
        try:
            status, _ = await self.call("GET", "/readyz")
        except WorkerError:
            return False
        return status == 200

    async def metrics(self) -> list[Metric]:
        """Its metric families now (kept as ``last``)."""
        status, body = await self.call("GET", "/metrics")
        if status != 200:
            raise WorkerError(f"worker {self.index} (pid {self.pid}): /metrics answered {status}")
        self.last = parse(body.decode())
        return self.last

    async def aclose(self) -> None:
        self._closed = True
        if self._output is not None:
            self._output.cancel()
        if self._session is not None:
            await self._session.close()

    def __repr__(self) -> str:
        return (
            f"<Worker {self.index} pid={self.pid} state={self.state} lived={self.lived_s():.1f}s>"
        )
