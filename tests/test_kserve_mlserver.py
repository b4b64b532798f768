"""Batching in front of a real KServe V2 server: MLServer (from PyPI) serving a model that
fails a whole batch holding one malformed row with 500, as MLServer and KServe do.  The
gateway bisects the batch, so only the malformed row's caller gets the 500; the others get
their own rows' answers, with their own ids."""

from __future__ import annotations

import asyncio
import json
import math
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gateway.resilience.stage import GUARDS
from tests.helpers import write_policy

MODEL = Path(__file__).resolve().parent / "kserve_model"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mlserver(tmp_path_factory) -> Iterator[str]:
    """MLServer on 127.0.0.1 with the row-sum model; its base URL."""
    binary = shutil.which("mlserver") or str(Path(sys.executable).parent / "mlserver")
    if not Path(binary).exists():
        pytest.fail("mlserver is not installed: it is in the test extra")
    root = tmp_path_factory.mktemp("mlserver")
    shutil.copytree(MODEL / "rowsum", root / "rowsum")
    http, grpc, metrics = free_port(), free_port(), free_port()
    (root / "settings.json").write_text(
        json.dumps(
            {
                "host": "127.0.0.1",
                "http_port": http,
                "grpc_port": grpc,
                "metrics_port": metrics,
                "parallel_workers": 0,
            }
        )
    )
    log = (root / "mlserver.log").open("w")
    proc = subprocess.Popen([binary, "start", str(root)], stdout=log, stderr=log)
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if httpx.get(url + "/v2/models/rowsum/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError((root / "mlserver.log").read_text()[-2000:])
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def infer(row: list[float], rid: str) -> dict[str, object]:
    return {"id": rid, "inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32", "data": row}]}


async def test_mlserver_answers_500_to_a_malformed_row_alone(mlserver):
    async with httpx.AsyncClient() as client:
        r = await client.post(mlserver + "/v2/models/rowsum/infer", json=infer([1, -2, 3], "x"))
    assert r.status_code == 500


async def test_one_malformed_row_fails_only_its_caller(mlserver, start_gateway, tmp_path):
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{mls: {{url: "{mlserver}"}}}}
        routes:
          - name: infer
            match: {{path: "/v2/models/*"}}
            backend: mls
            batch: {{max_size: 16, max_wait_ms: 50}}
        """,
    )
    gw = await start_gateway(policy=policy)
    url = gw.url + "/v2/models/rowsum/infer"
    size, bad = 12, 5
    async with httpx.AsyncClient(timeout=30) as client:
        busy = asyncio.create_task(client.post(url, json=infer([999, 0, 0], "busy")))
        await asyncio.sleep(0.1)  # the model is busy with it: the next rows pile up
        rows: list[list[float]] = [[-1.0, 1, 1] if i == bad else [i, 1, 2] for i in range(size)]
        answers = await asyncio.gather(
            *(client.post(url, json=infer(row, f"r{i}")) for i, row in enumerate(rows))
        )
        assert (await busy).status_code == 200
    assert [a.status_code for a in answers] == [500 if i == bad else 200 for i in range(size)], [
        a.text for a in answers
    ][:2]
    for i, a in enumerate(answers):
        if i != bad:
            body = a.json()
            assert body["id"] == f"r{i}"
            assert body["outputs"][0]["data"] == [i + 3]
    metrics = gw.gateway.metrics
    assert metrics.batch_splits.labels("infer", "5xx")._value.get() >= 1
    calls = sum(
        s.value
        for m in metrics.batch_size.collect()
        for s in m.samples
        if s.name.endswith("_count")
    )
    # The busy row, the merged batch, and at most 2 ceil(log2 n) calls to isolate the bad row.
    assert calls <= 2 + 2 * math.ceil(math.log2(size))


async def test_one_callers_bad_row_never_opens_the_breaker_for_everyone(
    mlserver, start_gateway, tmp_path
):
    """A default breaker in front of MLServer, four rounds of twelve rows each holding one
    malformed row: every good row is answered in every round, the breaker stays closed,
    and the bad rows' 500s are counted as the callers' inputs, not the backend's health
    (before, the merged call and each half counted: the breaker opened in round two)."""
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{mls: {{url: "{mlserver}", circuit_breaker: {{}}}}}}
        routes:
          - name: infer
            match: {{path: "/v2/models/*"}}
            backend: mls
            batch: {{max_size: 16, max_wait_ms: 50}}
        """,
    )
    gw = await start_gateway(policy=policy)
    url = gw.url + "/v2/models/rowsum/infer"
    size = 12
    async with httpx.AsyncClient(timeout=30) as client:
        for round_ in range(4):
            bad = (round_ * 5) % size
            busy = asyncio.create_task(client.post(url, json=infer([999, 0, 0], "busy")))
            await asyncio.sleep(0.1)  # the model is busy with it: the next rows pile up
            rows: list[list[float]] = [[-1.0, 1, 1] if i == bad else [i, 1, 2] for i in range(size)]
            answers = await asyncio.gather(
                *(client.post(url, json=infer(row, f"r{i}")) for i, row in enumerate(rows))
            )
            assert (await busy).status_code == 200
            statuses = [a.status_code for a in answers]
            assert statuses == [500 if i == bad else 200 for i in range(size)], (round_, statuses)
    guard = gw.gateway.registry.peek(GUARDS, "mls")
    assert guard is not None and guard.breaker is not None
    assert guard.breaker.state == "closed"
    failures = gw.gateway.metrics.backend_failures
    assert failures.labels("mls", "batch_input")._value.get() >= 4
    assert failures.labels("mls", "status_5xx")._value.get() == 0


async def test_a_real_kserve_servers_answers_are_cached_under_its_model_version(
    mlserver, start_gateway, tmp_path
):
    """MLServer's answers through a route that caches and batches: an identical inference is
    answered from the cache, byte for byte; with another ``id`` (KServe's client sends a
    fresh one each call) too, with its own id in the answer; another row is not, and a new
    ``model_version`` (a reload) misses at once."""
    text = """
        backends: {{mls: {{url: "{url}", model_version: "{version}"}}}}
        routes:
          - name: infer
            match: {{path: "/v2/models/*"}}
            backend: mls
            cache: {{ttl_s: 60}}
            batch: {{max_size: 16, max_wait_ms: 5}}
        """
    policy = write_policy(tmp_path, text.format(url=mlserver, version="rowsum@1"))
    gw = await start_gateway(policy=policy)
    url = gw.url + "/v2/models/rowsum/infer"
    async with httpx.AsyncClient(timeout=30) as client:
        first = await client.post(url, json=infer([1, 2, 3], "a"))
        again = await client.post(url, json=infer([1, 2, 3], "a"))
        other_id = await client.post(url, json=infer([1, 2, 3], "b"))
        other_row = await client.post(url, json=infer([1, 2, 4], "a"))
        assert [r.headers["X-Gateway-Cache"] for r in (first, again, other_id, other_row)] == [
            "miss",
            "hit",
            "hit",
            "miss",
        ]
        assert again.content == first.content
        assert other_id.json() == {**first.json(), "id": "b"}
        assert first.json()["outputs"][0]["data"] == [6]
        assert other_row.json()["outputs"][0]["data"] == [7]
        write_policy(tmp_path, text.format(url=mlserver, version="rowsum@2"))
        gw.gateway.reload(force=True)
        after = await client.post(url, json=infer([1, 2, 3], "a"))
        assert after.headers["X-Gateway-Cache"] == "miss"
        assert after.json()["outputs"][0]["data"] == [6]


async def test_identical_inferences_in_flight_with_fresh_ids_share_one_call(
    mlserver, start_gateway, tmp_path
):
    """Five callers ask MLServer the same row at once, each with its own ``id`` as KServe's
    client sends: one inference (the row keeps the model busy half a second), and each
    caller gets the answer with its own id."""
    text = f"""
        backends: {{mls: {{url: "{mlserver}"}}}}
        routes:
          - name: infer
            match: {{path: "/v2/models/*"}}
            backend: mls
            cache: {{ttl_s: 60}}
        """
    gw = await start_gateway(policy=write_policy(tmp_path, text))
    url = gw.url + "/v2/models/rowsum/infer"
    async with httpx.AsyncClient(timeout=30) as client:
        answers = await asyncio.gather(
            *(client.post(url, json=infer([999, 1, 1], f"c{i}")) for i in range(5))
        )
    assert [a.status_code for a in answers] == [200] * 5
    assert [a.json()["id"] for a in answers] == [f"c{i}" for i in range(5)]
    assert all(a.json()["outputs"] == answers[0].json()["outputs"] for a in answers)
    assert answers[0].json()["outputs"][0]["data"] == [1001]
    joined = [a for a in answers if a.headers.get("X-Gateway-Coalesced") == "1"]
    assert len(joined) == 4
