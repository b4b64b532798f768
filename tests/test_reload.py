"""Hot reload: ConfigMap-style symlink swaps under load with zero failed requests, invalid
policies keep the last good one, and reloads by SIGHUP-equivalent and POST /reload."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import httpx

from gateway.policy.watch import PolicySource, Settling
from gateway.testing import FakeClock
from tests.helpers import CHAT, until, write_policy
from tests.upstreams import Recorder


def policy_for(url: str) -> str:
    return f"""backends: {{main: {{url: "{url}"}}}}
routes: [{{match: {{path: "*"}}, backend: main}}]
server: {{reload_interval_s: 0.05, reload_settle_s: 0}}
"""


class ConfigMapDir:
    """A directory laid out as the kubelet lays out a ConfigMap volume."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.version = 0

    def publish(self, files: dict[str, str]) -> None:
        self.version += 1
        stamp = self.root / f"..2026_11_29_00_00_{self.version:02d}.000000001"
        stamp.mkdir()
        for name, text in files.items():
            (stamp / name).write_text(text)
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(stamp.name)
        os.replace(tmp, self.root / "..data")  # the atomic swap the kubelet does
        for name in files:
            link = self.root / name
            if not link.is_symlink():
                link.symlink_to(f"..data/{name}")


async def test_configmap_symlink_swap_under_load_fails_no_request(
    serve_app, start_gateway, tmp_path
):
    old, new = Recorder(), Recorder()
    url_old, url_new = await serve_app(old.app()), await serve_app(new.app())
    cm = ConfigMapDir(tmp_path)
    cm.publish({"policy.yaml": policy_for(url_old)})
    gw = await start_gateway(policy=tmp_path, watch_interval_s=0.02)
    statuses: list[int] = []
    served_by_new = asyncio.Event()

    async def worker(client: httpx.AsyncClient) -> None:
        while not served_by_new.is_set() or len(statuses) < 400:
            r = await client.post(gw.url + "/v1/chat/completions", json=CHAT)
            statuses.append(r.status_code)
            if len(new.seen) > 50:
                served_by_new.set()
            if len(statuses) > 5000:
                break

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=16)) as client:
        workers = [asyncio.create_task(worker(client)) for _ in range(8)]
        while len(statuses) < 100:
            await asyncio.sleep(0.01)
        cm.publish({"policy.yaml": policy_for(url_new)})
        await asyncio.gather(*workers)
    assert set(statuses) == {200}
    assert old.seen and new.seen
    assert gw.gateway.snapshot.generation == 2


async def test_invalid_policy_keeps_last_good_and_is_counted_once(
    serve_app, start_gateway, tmp_path
):
    rec = Recorder()
    url = await serve_app(rec.app())
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(url))
    gw = await start_gateway(policy=path, watch_interval_s=3600)
    good_hash = gw.gateway.snapshot.digest
    path.write_text(policy_for(url).replace("backend: main", "backend: nope"))
    for _ in range(3):  # polling again must not count the same bad file again
        gw.gateway._poll()
    metrics = gw.gateway.metrics.exposition().decode()
    assert "gateway_policy_reload_failures_total 1.0" in metrics
    assert "gateway_policy_generation 1.0" in metrics
    assert gw.gateway.snapshot.digest == good_hash
    async with httpx.AsyncClient() as client:
        assert (await client.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200
    path.write_text(policy_for(url).replace("reload_interval_s: 0.05", "access_log: false"))
    gw.gateway._poll()
    metrics = gw.gateway.metrics.exposition().decode()
    assert "gateway_policy_generation 2.0" in metrics
    assert f'gateway_policy_info{{hash="{gw.gateway.snapshot.digest}"}} 1.0' in metrics


async def test_watcher_picks_up_an_edited_file_by_itself(serve_app, start_gateway, tmp_path):
    a, b = Recorder(), Recorder()
    url_a, url_b = await serve_app(a.app()), await serve_app(b.app())
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(url_a))
    gw = await start_gateway(policy=path, watch_interval_s=0.02)
    path.write_text(policy_for(url_b))
    for _ in range(200):
        if gw.gateway.snapshot.generation == 2:
            break
        await asyncio.sleep(0.01)
    async with httpx.AsyncClient() as client:
        await client.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert len(b.seen) == 1 and not a.seen


async def test_post_reload_needs_the_admin_token_and_reports_errors(
    serve_app, start_gateway, tmp_path, monkeypatch
):
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", "s3cret")
    rec = Recorder()
    url = await serve_app(rec.app())
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(url))
    gw = await start_gateway(policy=path, watch_interval_s=3600)
    async with httpx.AsyncClient() as client:
        denied = await client.post(gw.admin_url + "/reload")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_admin_token"
        path.write_text(policy_for(url) + "bogus: 1\n")
        auth = {"Authorization": "Bearer s3cret"}
        rejected = await client.post(gw.admin_url + "/reload", headers=auth)
        assert rejected.status_code == 422
        assert "bogus: unknown key" in rejected.json()["errors"][0]
        path.write_text(policy_for(url).replace("0.05", "0.5"))
        ok = await client.post(gw.admin_url + "/reload", headers=auth)
        shown = await client.get(gw.admin_url + "/policy", headers=auth)
    assert ok.json()["reloaded"] is True and ok.json()["generation"] == 2
    assert shown.json()["generation"] == 2
    assert shown.json()["policy"]["server"]["reload_interval_s"] == 0.5


def edit_in_place(path: Path, text: str) -> None:
    with path.open("r+") as f:  # the same inode, as `>` or a careless editor leaves it
        f.seek(0)
        f.truncate()
        f.write(text)


def test_an_edit_in_place_applies_only_once_two_polls_agree(tmp_path: Path):
    """A poll that catches a file half-written (its first half a valid policy) must not
    apply it: an edit in place is applied when the next poll reads the same content."""
    path = tmp_path / "policy.yaml"
    full = 'backends: {a: {url: "http://127.0.0.1:1"}}\nroutes: [{backend: a}]\n'
    path.write_text(full)
    source = PolicySource(path)
    settling = Settling(source.read())
    edit_in_place(path, 'backends: {a: {url: "http://127.0.0.1:1"}}\n')  # half of the edit
    assert not settling.ready(source.read())
    edit_in_place(path, full.replace(":1", ":2"))  # the edit completes before the next poll
    assert not settling.ready(source.read())  # new content: wait for it to hold still
    assert settling.ready(source.read())  # two polls agree: apply
    settling.done(source.read())
    assert not settling.ready(source.read())


def test_an_edit_in_place_applies_only_once_it_held_still_for_the_settle_period(
    tmp_path: Path,
):
    """A writer that pauses mid-file for 2 s, then 5 s more: the half never applies; the
    whole file applies once it has held still for ``reload_settle_s`` (10 s)."""
    path = tmp_path / "policy.yaml"
    full = 'backends: {a: {url: "http://127.0.0.1:1"}}\nroutes: [{backend: a}]\n'
    path.write_text(full)
    clock = FakeClock()
    source = PolicySource(path)
    settling = Settling(source.read(), clock)
    edit_in_place(path, 'backends: {a: {url: "http://127.0.0.1:2"}}\n')  # the first half
    for pause_s in (2.0, 5.0):
        for _ in range(int(pause_s)):
            clock.advance(1.0)  # a poll a second
            assert not settling.ready(source.read(), 10.0)
    edit_in_place(path, full.replace(":1", ":2"))  # the writer finishes
    assert not settling.ready(source.read(), 10.0)  # new content: its own 10 s from now
    clock.advance(9.9)
    assert not settling.ready(source.read(), 10.0)
    clock.advance(0.2)
    assert settling.ready(source.read(), 10.0)


async def test_a_writer_pausing_mid_file_never_loses_a_route(serve_app, start_gateway, tmp_path):
    """On a running gateway at the default settle period: while the file holds only its
    first half (one route of two) for 2 s and then 5 s more, the second route keeps
    answering; the whole file applies 10 s after the last write."""
    rec = Recorder()
    url = await serve_app(rec.app())
    whole = (
        f'backends: {{main: {{url: "{url}"}}}}\n'
        "routes:\n  - {match: {path: /v1/chat/completions}, backend: main}\n"
        "  - {match: {path: /v1/embeddings}, backend: main}\n"
    )
    path = write_policy(tmp_path, whole)
    clock = FakeClock()
    gw = await start_gateway(policy=path, clock=clock, watch_interval_s=0.01)
    embed = {"model": "e", "input": "x"}
    async with httpx.AsyncClient(base_url=gw.url) as client:
        half = whole[: whole.index("  - {match: {path: /v1/embeddings}")]
        edit_in_place(path, half)
        for pause_s in (2.0, 5.0):
            clock.advance(pause_s)
            polls = gw.gateway._settling
            await asyncio.sleep(0.1)  # several polls of the half, at this (fake) time
            assert (await client.post("/v1/embeddings", json=embed)).status_code == 200
            assert polls is gw.gateway._settling and gw.gateway.snapshot.generation == 1
        edit_in_place(path, whole + "server: {access_log: false}\n")  # the writer finishes
        await asyncio.sleep(0.1)
        clock.advance(9.0)
        await asyncio.sleep(0.1)
        assert gw.gateway.snapshot.generation == 1
        clock.advance(1.5)
        await until(lambda: gw.gateway.snapshot.generation == 2)
        assert (await client.post("/v1/embeddings", json=embed)).status_code == 200


def test_a_file_renamed_into_place_applies_at_once(tmp_path: Path):
    path = tmp_path / "policy.yaml"
    path.write_text('backends: {a: {url: "http://127.0.0.1:1"}}\nroutes: [{backend: a}]\n')
    source = PolicySource(path)
    settling = Settling(source.read())
    staged = tmp_path / ".policy.yaml.tmp"
    staged.write_text('backends: {a: {url: "http://127.0.0.1:2"}}\nroutes: [{backend: a}]\n')
    staged.replace(path)
    assert settling.ready(source.read())


def test_a_configmap_swap_applies_at_once(tmp_path: Path):
    """The kubelet writes a new ..<timestamp> directory and renames ..data over to it."""
    volume = tmp_path / "policy"
    volume.mkdir()
    for stamp, port in (("..2026_12_01_a", 1), ("..2026_12_01_b", 2)):
        (volume / stamp).mkdir()
        (volume / stamp / "policy.yaml").write_text(
            f'backends: {{a: {{url: "http://127.0.0.1:{port}"}}}}\nroutes: [{{backend: a}}]\n'
        )
    (volume / "..data").symlink_to("..2026_12_01_a")
    (volume / "policy.yaml").symlink_to("..data/policy.yaml")
    source = PolicySource(volume)
    settling = Settling(source.read())
    (volume / "..data_tmp").symlink_to("..2026_12_01_b")
    (volume / "..data_tmp").replace(volume / "..data")
    assert settling.ready(source.read())


async def test_a_reload_of_a_serving_gateway_starts_the_pollers_it_adds(
    serve_app, start_gateway, tmp_path
):
    from gateway.resilience.gpu import TELEMETRY

    url = await serve_app(Recorder().app())
    path = tmp_path / "policy.yaml"
    path.write_text(policy_for(url))
    gw = await start_gateway(policy=path, watch_interval_s=60)
    assert gw.gateway.registry.peek(TELEMETRY, "main") is None
    path.write_text(
        policy_for(url).replace(
            f'url: "{url}"', f'url: "{url}", telemetry: {{source: prometheus, url: "{url}/m"}}'
        )
    )
    assert gw.gateway.reload(force=True)
    added = gw.gateway.registry.peek(TELEMETRY, "main")
    assert added is not None and added.poller is not None and added.poller.running
