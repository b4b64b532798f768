"""Secrets read from files (``${file:/path}`` in any key that takes ``${ENV}``): a Kubernetes
Secret mounted as a volume, which the kubelet updates in place, reloads the policy when it
rotates, as an environment variable never can."""

from __future__ import annotations

import asyncio
import hashlib
import re
from pathlib import Path

import httpx
import pytest

from gateway.errors import PolicyError
from gateway.policy import load_policy, parse_policy_text
from gateway.policy.convert import MAX_SECRET_FILE_BYTES
from gateway.policy.watch import PolicySource, Settling
from tests.helpers import CHAT
from tests.test_reload import ConfigMapDir
from tests.upstreams import Recorder


def tenants_policy(secret: str, url: str = "http://127.0.0.1:9") -> str:
    return f"""backends: {{main: {{url: "{url}"}}}}
routes: [{{match: {{path: "*"}}, backend: main}}]
tenants:
  required: true
  keys: [{{name: acme, sha256: "${{file:{secret}}}"}}]
server: {{reload_interval_s: 0.05, reload_settle_s: 0}}
"""


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def test_a_files_text_is_the_value_without_its_final_line_break(tmp_path: Path):
    secret = tmp_path / "acme-sha256"
    secret.write_text(sha("acme-key") + "\n")  # as `kubectl create secret --from-file` keeps it
    policy = tmp_path / "policy.yaml"
    policy.write_text(tenants_policy(str(secret)))
    loaded = load_policy(policy)
    assert loaded.policy.tenants.keys[0].sha256 == sha("acme-key")
    assert loaded.secret_files == (str(secret),)
    two = tmp_path / "password"
    two.write_bytes(b"p@ss\r\n\r\n")  # only the last line break goes
    text = f'redis: {{password: "${{file:{two}}}"}}'
    assert parse_policy_text(text).redis.password == "p@ss\r\n"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("${file:relative/path}", "tenants.keys[0].sha256: ${file:relative/path}: the path must"),
        ("${file:/no/such/secret}", "file /no/such/secret cannot be read (No such file"),
    ],
)
def test_a_relative_path_or_a_missing_file_is_an_error_at_its_key(value: str, message: str):
    text = f"tenants: {{keys: [{{name: acme, sha256: '{value}'}}]}}"
    with pytest.raises(PolicyError, match=re.escape(message)):
        parse_policy_text(text)


def test_a_check_without_the_secrets_warns_and_a_key_without_env_does_not_expand(
    tmp_path: Path,
):
    policy = tmp_path / "policy.yaml"
    policy.write_text(tenants_policy("/run/secrets/absent"))
    with pytest.raises(PolicyError):
        load_policy(policy)
    lenient = load_policy(policy, lenient_env=True)
    assert [w.message for w in lenient.warnings if w.path.startswith("tenants.keys")] == [
        "file /run/secrets/absent cannot be read (No such file or directory) "
        "(it must be readable where the gateway runs)"
    ]
    with pytest.raises(PolicyError, match=r"\$\{file:/etc/passwd\} is not expanded in this key"):
        parse_policy_text('backends: {main: {url: "${file:/etc/passwd}"}}')


def test_a_file_past_the_bound_is_no_secret(tmp_path: Path):
    big = tmp_path / "big"
    big.write_bytes(b"x" * (MAX_SECRET_FILE_BYTES + 1))
    with pytest.raises(PolicyError, match="holds over 65536 bytes"):
        parse_policy_text(f'redis: {{password: "${{file:{big}}}"}}')


def secret_volume(tmp_path: Path, key: str) -> tuple[ConfigMapDir, Path]:
    """A Secret's volume as the kubelet lays it out, holding ``key``'s sha256."""
    volume = ConfigMapDir(tmp_path / "secrets")
    volume.root.mkdir()
    volume.publish({"acme-sha256": sha(key)})
    return volume, volume.root / "acme-sha256"


def test_a_rotated_secret_is_an_atomic_change_of_the_policy(tmp_path: Path):
    volume, secret = secret_volume(tmp_path, "old-key")
    policy = tmp_path / "policy.yaml"
    policy.write_text(tenants_policy(str(secret)))
    source = PolicySource(policy)
    assert source.load().policy.tenants.keys[0].sha256 == sha("old-key")
    settling = Settling(source.read())
    assert not settling.ready(source.read())  # nothing changed
    volume.publish({"acme-sha256": sha("new-key")})
    assert settling.ready(source.read())  # at once: the kubelet's swap
    assert source.load().policy.tenants.keys[0].sha256 == sha("new-key")


async def test_a_serving_gateway_takes_a_rotated_key_by_itself(
    serve_app, start_gateway, tmp_path: Path
):
    recorder = Recorder()
    url = await serve_app(recorder.app())
    volume, secret = secret_volume(tmp_path, "old-key")
    policy = tmp_path / "policy.yaml"
    policy.write_text(tenants_policy(str(secret), url))
    gw = await start_gateway(policy=policy, watch_interval_s=0.02)

    async def status(key: str) -> int:
        async with httpx.AsyncClient() as client:
            answer = await client.post(
                gw.url + "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {key}"},
            )
            return answer.status_code

    assert (await status("old-key"), await status("new-key")) == (200, 401)
    volume.publish({"acme-sha256": sha("new-key")})
    for _ in range(200):
        if gw.gateway.snapshot.generation == 2:
            break
        await asyncio.sleep(0.01)
    assert gw.gateway.snapshot.generation == 2  # the same policy text, a new secret
    assert (await status("old-key"), await status("new-key")) == (401, 200)
