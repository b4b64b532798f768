"""``gateway serve --workers N``: real processes on 127.0.0.1, a supervisor and its workers
sharing the data port.  A killed worker is replaced while the port keeps answering, SIGHUP
and ``POST /reload`` reach every worker, SIGTERM drains them all, readiness waits for every
worker, ``/metrics`` is one view; and how many ``auto`` is, from the cgroup's files."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli import main
from gateway.workers.backoff import Backoff
from gateway.workers.cpus import available_cpus, cpu_quota, parse_workers
from tests.helpers import CHAT, until
from tests.upstreams import Recorder

LIMIT_S = 20.0
"""The most one test of real processes may take."""


@dataclass
class Supervised:
    proc: asyncio.subprocess.Process
    url: str
    admin_url: str


StartSupervisor = Callable[..., Awaitable[Supervised]]


@pytest.fixture
async def supervisor() -> AsyncIterator[StartSupervisor]:
    """``gateway serve --port 0 --admin-port 0 ARGS...`` as a process; SIGTERM (then
    SIGKILL, after which its workers see their pipe close and exit) when the test is over."""
    procs: list[asyncio.subprocess.Process] = []

    async def start(*args: str, log: Path | None = None, **env: str) -> Supervised:
        """``log``: a file for the supervisor's and its workers' stderr; ``env``: more
        environment variables."""
        errors = log.open("wb") if log is not None else None
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--port",
            "0",
            "--admin-port",
            "0",
            *args,
            stdout=asyncio.subprocess.PIPE,
            stderr=errors,
            env={**os.environ, **env},
        )
        if errors is not None:
            errors.close()
        procs.append(proc)
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), LIMIT_S)).decode()
        found = re.search(r"listening on (\S+) \(admin (\S+)\)", line)
        assert found, line
        return Supervised(proc, found.group(1), found.group(2))

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def workers(client: httpx.AsyncClient, gw: Supervised) -> list[dict[str, Any]]:
    answer = await client.get(gw.admin_url + "/workers")
    assert answer.status_code == 200
    found: list[dict[str, Any]] = answer.json()["workers"]
    return found


async def eventually(check: Callable[[], Awaitable[bool]]) -> None:
    """Until ``check`` holds, polling (bounded by the test's own limit)."""
    while not await check():
        await asyncio.sleep(0.02)


async def wait_ready(client: httpx.AsyncClient, gw: Supervised) -> None:
    async def ready() -> bool:
        return (await client.get(gw.admin_url + "/readyz")).status_code == 200

    await eventually(ready)


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@dataclass
class Retrying:
    """A client sending chat requests one after another, each on a new connection.  It
    retries only when the connection was refused, reset, or closed before any byte of an
    answer (the ways a killed process's connections end, and what clients retry); any other
    outcome that is not a 200 is a failure."""

    url: str
    ok: int = 0
    retried: int = 0
    failed: list[str] = field(default_factory=list)
    stopped: bool = False

    async def run(self) -> None:
        limits = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=5, limits=limits) as client:
            while not self.stopped:
                try:
                    answer = await client.post(self.url + "/v1/chat/completions", json=CHAT)
                except (httpx.ConnectError, httpx.ReadError, httpx.WriteError):
                    self.retried += 1
                    continue
                except httpx.RemoteProtocolError as exc:
                    if "without sending a response" in str(exc):
                        self.retried += 1
                        continue
                    self.failed.append(repr(exc))
                    continue
                except httpx.HTTPError as exc:
                    self.failed.append(repr(exc))
                    continue
                if answer.status_code == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{answer.status_code} {answer.text}")


async def test_a_killed_worker_is_replaced_and_the_port_keeps_answering(serve_app, supervisor):
    """SIGKILL to one worker: the supervisor starts another in its slot (counted in
    ``gateway_worker_restarts_total``), ``/readyz`` is 200 again once it is ready, and a
    client sending all along never sees a failed request."""
    async with asyncio.timeout(LIMIT_S):
        url = await serve_app(Recorder().app())
        gw = await supervisor("--upstream", url, "--workers", "2")
        async with httpx.AsyncClient(timeout=5) as admin:
            await wait_ready(admin, gw)
            before = await workers(admin, gw)
            assert [w["state"] for w in before] == ["running", "running"]
            client = Retrying(gw.url)
            sending = asyncio.create_task(client.run())
            await until(lambda: client.ok >= 20, LIMIT_S)
            os.kill(before[0]["pid"], signal.SIGKILL)

            async def replaced() -> bool:
                now = await workers(admin, gw)
                return now[0]["pid"] != before[0]["pid"] and now[0].get("ready") is True

            await eventually(replaced)
            await wait_ready(admin, gw)
            mark = client.ok
            await until(lambda: client.ok >= mark + 20, LIMIT_S)
            client.stopped = True
            await sending
            after = await workers(admin, gw)
            text = (await admin.get(gw.admin_url + "/metrics")).text
    assert client.failed == []
    assert after[0]["restarts"] == 1 and after[1]["restarts"] == 0
    assert after[1]["pid"] == before[1]["pid"] and gone(before[0]["pid"])
    assert samples(text, "gateway_worker_restarts_total") == [({}, 1.0)]
    assert samples(text, "gateway_workers") == [({}, 2.0)]


POLICY = """\
backends: {main: {url: "%s"}}
routes: [{backend: main}]
server: {reload_interval_s: 3600, shutdown_grace_s: 5}
"""


async def test_sighup_and_post_reload_reach_every_worker(serve_app, supervisor, tmp_path: Path):
    """After the policy file is edited, SIGHUP to the supervisor moves every worker to
    generation 2 with the same hash (and requests to the new backend); ``POST /reload`` on
    the supervisor's admin port then moves every worker to 3."""
    async with asyncio.timeout(LIMIT_S):
        a, b = Recorder(), Recorder()
        url_a, url_b = await serve_app(a.app()), await serve_app(b.app())
        path = tmp_path / "policy.yaml"
        path.write_text(POLICY % url_a)
        gw = await supervisor("--policy", str(path), "--workers", "2")
        async with httpx.AsyncClient(timeout=5) as client:
            await wait_ready(client, gw)
            first = await workers(client, gw)
            assert [w["generation"] for w in first] == [1, 1]
            path.write_text(POLICY % url_b)
            gw.proc.send_signal(signal.SIGHUP)

            async def at(generation: int) -> bool:
                return all(w.get("generation") == generation for w in await workers(client, gw))

            await eventually(lambda: at(2))
            second = await workers(client, gw)
            text = (await client.get(gw.admin_url + "/metrics")).text
            fresh = httpx.Limits(max_keepalive_connections=0)
            async with httpx.AsyncClient(timeout=5, limits=fresh) as data:
                for _ in range(10):
                    answer = await data.post(gw.url + "/v1/chat/completions", json=CHAT)
                    assert answer.status_code == 200
            path.write_text(POLICY % url_a)
            reloaded = await client.post(gw.admin_url + "/reload")
            third = await workers(client, gw)
    assert len({w["hash"] for w in second}) == 1 and second[0]["hash"] != first[0]["hash"]
    assert samples(text, "gateway_policy_generation") == [({}, 2.0)]
    assert len(b.seen) == 10 and not a.seen
    assert reloaded.status_code == 200, reloaded.text
    shown = reloaded.json()
    assert shown["reloaded"] is True and shown["generation"] == 3
    assert sorted(w["worker"] for w in shown["workers"]) == [0, 1]
    assert [w["generation"] for w in third] == [3, 3]


async def test_sigterm_drains_every_worker_then_exits(serve_app, supervisor, tmp_path: Path):
    """Slow requests in flight when SIGTERM reaches the supervisor: ``/readyz`` turns 503 at
    once, new connections are refused, every slow request still completes with a 200, then
    the supervisor exits 0 and no worker is left."""
    async with asyncio.timeout(LIMIT_S):
        rec = Recorder()
        url = await serve_app(rec.app())
        path = tmp_path / "policy.yaml"
        path.write_text(POLICY % url)
        gw = await supervisor("--policy", str(path), "--workers", "2")
        async with httpx.AsyncClient(timeout=10) as client:
            await wait_ready(client, gw)
            pids = [w["pid"] for w in await workers(client, gw)]
            slow = [asyncio.create_task(client.get(gw.url + "/slow")) for _ in range(4)]
            await until(lambda: len(rec.seen) == 4, LIMIT_S)
            gw.proc.send_signal(signal.SIGTERM)

            async def unready() -> bool:
                answer = await client.get(gw.admin_url + "/readyz")
                return answer.status_code == 503 and answer.json()["reason"] == "shutting down"

            await eventually(unready)

            async def refused() -> bool:
                try:
                    async with httpx.AsyncClient(timeout=1) as fresh:
                        await fresh.get(gw.url + "/v1/models")
                except httpx.ConnectError:
                    return True
                except httpx.HTTPError:
                    pass
                return False

            await eventually(refused)
            rec.release.set()
            answers = await asyncio.gather(*slow)
        code = await gw.proc.wait()
    assert [a.status_code for a in answers] == [200] * 4
    assert all(a.json() == {"slow": True} for a in answers)
    assert code == 0
    assert all(gone(pid) for pid in pids)


async def test_ready_only_once_every_worker_is_ready(serve_app, supervisor, tmp_path: Path):
    """One worker's warm-up is answered and the other's held: the supervisor's ``/readyz``
    is 503 naming the worker still warming up, and 200 once it is answered too."""
    held = asyncio.Event()
    warmups: list[int] = []

    async def warm(request: web.Request) -> web.Response:
        warmups.append(1)
        if len(warmups) > 1:
            await held.wait()
        return web.json_response({"warm": True})

    app = web.Application()
    app.router.add_post("/warm", warm)
    async with asyncio.timeout(LIMIT_S):
        url = await serve_app(app)
        path = tmp_path / "policy.yaml"
        path.write_text(
            f'backends: {{main: {{url: "{url}", warmup: [{{path: /warm, body: {{}}}}]}}}}\n'
            "routes: [{backend: main}]\n"
        )
        gw = await supervisor("--policy", str(path), "--workers", "2")
        async with httpx.AsyncClient(timeout=5) as client:

            async def one_ready() -> bool:
                ready = [cast(bool, w.get("ready")) for w in await workers(client, gw)]
                return sorted(ready) == [False, True]

            await eventually(one_ready)
            waiting = await client.get(gw.admin_url + "/readyz")
            held.set()
            await wait_ready(client, gw)
    assert waiting.status_code == 503
    assert re.fullmatch(r"worker [01] is not ready \(warming up\)", waiting.json()["reason"])


async def two_workers_answered(
    serve_app: Any, supervisor: StartSupervisor, count: int
) -> tuple[Supervised, str, list[dict[str, Any]]]:
    """``--workers 2`` in front of a recorder, once it has answered ``count`` chat
    requests (each on a new connection): the gateway, its ``/metrics`` and ``/workers``."""
    async with asyncio.timeout(LIMIT_S):
        url = await serve_app(Recorder().app())
        gw = await supervisor("--upstream", url, "--workers", "2")
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=5, limits=fresh) as client:
            await wait_ready(client, gw)
            for _ in range(count):
                answer = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
                assert answer.status_code == 200
            text = (await client.get(gw.admin_url + "/metrics")).text
            return gw, text, await workers(client, gw)


async def test_metrics_are_one_view_across_the_workers(serve_app, supervisor):
    """Counters summed over the workers, each family once, the supervisor's own series and
    the workers' process figures added up."""
    _, text, _ = await two_workers_answered(serve_app, supervisor, 24)
    answered = [
        v for labels, v in samples(text, "gateway_requests_total") if labels["status"] == "200"
    ]
    assert sum(answered) == 24
    names = [f.name for f in text_string_to_metric_families(text)]
    assert len(names) == len(set(names)) and "gateway_build_info" in names
    assert samples(text, "gateway_workers") == [({}, 2.0)]
    assert samples(text, "gateway_policy_generation") == [({}, 1.0)]
    ((_, memory),) = samples(text, "process_resident_memory_bytes")
    assert memory > 3 * 10 * 2**20  # three processes: the supervisor and two workers


def mapped(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/PID/maps")
async def test_a_pass_through_gateway_loads_no_numpy(serve_app, supervisor):
    """numpy (some 15 MB a process, with its BLAS) serves only the cache's SimHash and
    embedding tiers: neither the supervisor nor a worker of a policy without a caching
    route maps it, even after answering, so RSS per worker stays what it measures."""
    gw, _, listed = await two_workers_answered(serve_app, supervisor, 4)
    pids = [gw.proc.pid, *(w["pid"] for w in listed)]
    assert len(pids) == 3
    for pid in pids:
        assert "numpy" not in mapped(pid), pid


async def test_a_worker_that_cannot_start_is_retried_ever_later_until_it_can(
    serve_app, supervisor, tmp_path: Path
):
    """With the policy file broken, a killed worker's replacements exit at start: each is
    started again after twice the delay of the one before (0.1 s, 0.2 s, 0.4 s...) while the
    other worker serves and ``/readyz`` is 503; once the file is fixed the next start
    listens and the supervisor is ready again."""
    async with asyncio.timeout(LIMIT_S):
        url = await serve_app(Recorder().app())
        path = tmp_path / "policy.yaml"
        path.write_text(POLICY % url)
        log = tmp_path / "stderr.log"
        gw = await supervisor("--policy", str(path), "--workers", "2", log=log)
        async with httpx.AsyncClient(timeout=5) as client:
            await wait_ready(client, gw)
            first = await workers(client, gw)
            path.write_text("routes: [{backend: nowhere}]\n")
            os.kill(first[0]["pid"], signal.SIGKILL)
            await until(lambda: "starting worker 0 again in 0.4 s" in log.read_text(), LIMIT_S)
            unready = await client.get(gw.admin_url + "/readyz")
            answered = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
            path.write_text(POLICY % url)
            await wait_ready(client, gw)
            after = await workers(client, gw)
            text = (await client.get(gw.admin_url + "/metrics")).text
    delays = re.findall(r"starting worker 0 again in (\S+) s", log.read_text())
    assert delays[:3] == ["0.1", "0.2", "0.4"]
    assert [float(d) for d in delays] == sorted(float(d) for d in delays)
    assert unready.status_code == 503
    assert unready.json()["reason"] == "worker 0 is not running"
    assert answered.status_code == 200
    assert after[0]["restarts"] == len(delays) >= 3 and after[1]["pid"] == first[1]["pid"]
    assert samples(text, "gateway_worker_restarts_total") == [({}, float(len(delays)))]


async def test_the_admin_token_guards_the_supervisors_endpoints_and_goes_on_to_the_workers(
    serve_app, supervisor, tmp_path: Path
):
    """With ``GATEWAY_ADMIN_TOKEN`` set, ``/workers``, ``/policy`` and ``POST /reload`` on the
    supervisor need it, as on a single gateway; the caller's token reaches the workers,
    which check it too; ``/readyz`` and ``/metrics`` stay open."""
    async with asyncio.timeout(LIMIT_S):
        url = await serve_app(Recorder().app())
        path = tmp_path / "policy.yaml"
        path.write_text(POLICY % url)
        token = "a-long-random-test-token"
        gw = await supervisor("--policy", str(path), "--workers", "2", GATEWAY_ADMIN_TOKEN=token)
        good = {"Authorization": f"Bearer {token}"}
        bad = {"Authorization": "Bearer wrong"}
        async with httpx.AsyncClient(timeout=5) as client:
            await wait_ready(client, gw)
            refused = [
                (await client.get(gw.admin_url + "/workers", headers=bad)).status_code,
                (await client.get(gw.admin_url + "/policy")).status_code,
                (await client.get(gw.admin_url + "/tenants", headers=bad)).status_code,
                (await client.post(gw.admin_url + "/reload", headers=bad)).status_code,
            ]
            shown = await client.get(gw.admin_url + "/policy", headers=good)
            standings = await client.get(gw.admin_url + "/tenants", headers=good)
            reloaded = await client.post(gw.admin_url + "/reload", headers=good)
            scraped = await client.get(gw.admin_url + "/metrics")
    assert refused == [401, 401, 401, 401]
    assert shown.status_code == 200 and shown.json()["generation"] == 1
    each = standings.json()["workers"]
    assert [w["worker"] for w in each] == [0, 1] and all(w["tenants"] == [] for w in each)
    assert reloaded.status_code == 200, reloaded.text
    assert [w["reloaded"] for w in reloaded.json()["workers"]] == [False, False]  # unchanged
    assert scraped.status_code == 200


async def test_a_data_port_already_taken_is_an_error_at_start(tmp_path: Path):
    """The supervisor binds the port before it starts any worker: taken, it exits 1
    saying so."""
    async with asyncio.timeout(LIMIT_S):
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--upstream",
                "http://127.0.0.1:9",
                "--port",
                str(port),
                "--admin-port",
                "0",
                "--workers",
                "2",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
    assert proc.returncode == 1 and out == b""
    assert b"error:" in err and b"in use" in err


def test_workers_auto_is_the_cgroup_v2_quota_rounded_up_and_capped_by_affinity(
    tmp_path: Path, monkeypatch
):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(3)))
    cpu_max = tmp_path / "cpu.max"
    for contents, expected in (
        ("150000 100000", 2),
        ("200000 100000", 2),
        ("50000 100000", 1),
        ("800000 100000", 3),  # the quota allows 8, the process may run on 3
        ("max 100000", 3),
    ):
        cpu_max.write_text(contents + "\n")
        assert available_cpus(tmp_path) == expected, contents
    assert cpu_quota(tmp_path) is None
    assert parse_workers("auto", tmp_path) == 3


def test_workers_auto_reads_cgroup_v1_where_there_is_no_v2(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert available_cpus(tmp_path) == 8  # no cgroup files: the affinity
    controller = tmp_path / "cpu,cpuacct"
    controller.mkdir()
    (controller / "cpu.cfs_period_us").write_text("100000\n")
    (controller / "cpu.cfs_quota_us").write_text("250000\n")
    assert cpu_quota(tmp_path) == 2.5 and available_cpus(tmp_path) == 3
    (controller / "cpu.cfs_quota_us").write_text("-1\n")
    assert available_cpus(tmp_path) == 8


def test_the_workers_flag_takes_a_count_of_at_least_one_or_auto(capsys):
    assert parse_workers("4") == 4
    for wrong in ("0", "-2", "many"):
        with pytest.raises(ValueError):
            parse_workers(wrong)
        with pytest.raises(SystemExit) as exited:
            main(["serve", "--upstream", "http://127.0.0.1:9", "--workers", wrong])
        assert exited.value.code == 2
    assert "--workers" in capsys.readouterr().err


def test_a_worker_that_keeps_dying_is_started_again_ever_later_up_to_a_cap():
    """Exits in a row after short lives double the delay up to the cap, so a worker that
    crashes at start is started at most once per 30 s; one that lived long starts afresh."""
    backoff = Backoff()
    delays = [backoff.delay_s(lived_s=0.5) for _ in range(12)]
    assert delays[:4] == [0.1, 0.2, 0.4, 0.8]
    assert delays == sorted(delays) and max(delays) == 30.0 and delays[-3:] == [30.0] * 3
    assert repr(backoff) == "<Backoff exits=12 next=30s>"
    assert backoff.delay_s(lived_s=60.0) == 0.1
