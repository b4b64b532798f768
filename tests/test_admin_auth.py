"""The admin plane's credentials: with a token set, only /healthz, /readyz and /metrics
answer without it; a missing, wrong or malformed Authorization is a 401, never a 500;
credentials inside URLs are never shown; the example Secret's placeholder is refused."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.admin.access import PLACEHOLDER_TOKEN
from gateway.app import Gateway
from gateway.errors import PolicyError
from gateway.policy.watch import PolicySource
from tests.helpers import write_policy
from tests.upstreams import Recorder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
async def with_token(serve_app, start_gateway, tmp_path):
    url = await serve_app(Recorder().app())
    userinfo_url = url.replace("http://", "http://svc-user:hunter2@")
    policy = write_policy(
        tmp_path,
        f"""
        backends:
          main: {{url: "{url}"}}
          other:
            url: "{userinfo_url}"
            telemetry: {{source: prometheus, url: "{userinfo_url}/metrics"}}
        routes: [{{backend: main}}]
        admin: {{token: s3cret}}
        """,
    )
    return await start_gateway(policy=policy)


async def test_with_a_token_only_health_readiness_and_metrics_are_open(with_token):
    gw = with_token
    async with httpx.AsyncClient() as client:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert (await client.get(gw.admin_url + path)).status_code == 200, path
        denied = await client.get(gw.admin_url + "/policy")
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_admin_token"
        shown = await client.get(
            gw.admin_url + "/policy", headers={"Authorization": "Bearer s3cret"}
        )
        assert shown.status_code == 200


@pytest.mark.parametrize(
    "authorization",
    [
        b"Bearer wrong",
        b"Bearer",
        b"Basic czNjcmV0",
        b"s3cret",
        b"Bearer s3cr\xe9t",
        b"Bearer \xff\xfe",
        b"Bearer " + b"x" * 5000,
    ],
    ids=["wrong", "no credential", "another scheme", "no scheme", "latin-1", "not UTF-8", "long"],
)
async def test_a_missing_wrong_or_malformed_authorization_is_a_401(with_token, authorization):
    gw = with_token
    async with httpx.AsyncClient() as client:
        for method, path in (("GET", "/policy"), ("POST", "/reload"), ("POST", "/cache/purge")):
            r = await client.request(
                method, gw.admin_url + path, headers={"Authorization": authorization}
            )
            assert r.status_code == 401, (method, path)


async def test_the_scheme_is_case_insensitive(with_token):
    gw = with_token
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.admin_url + "/policy", headers={"Authorization": "bearer  s3cret"})
    assert r.status_code == 200


async def test_credentials_inside_urls_are_redacted_where_the_policy_is_shown(with_token):
    gw = with_token
    async with httpx.AsyncClient() as client:
        r = await client.get(gw.admin_url + "/policy", headers={"Authorization": "Bearer s3cret"})
    text = r.text
    assert "hunter2" not in text and "svc-user" not in text
    other = r.json()["policy"]["backends"]["other"]
    assert other["url"].startswith("http://***@127.0.0.1:")
    assert other["telemetry"]["url"].startswith("http://***@127.0.0.1:")


def test_the_placeholder_is_the_one_the_example_secret_ships():
    secret = yaml.safe_load((ROOT / "deploy" / "k8s" / "secret.yaml").read_text())
    assert secret["stringData"]["admin-token"] == PLACEHOLDER_TOKEN


async def test_the_placeholder_token_is_refused_at_start(serve_app, tmp_path, monkeypatch):
    url = await serve_app(Recorder().app())
    policy = write_policy(
        tmp_path, f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
    )
    monkeypatch.setenv("GATEWAY_ADMIN_TOKEN", PLACEHOLDER_TOKEN)
    gateway = Gateway(PolicySource(policy))
    with pytest.raises(PolicyError, match="placeholder"):
        await gateway.start("127.0.0.1", 0, "127.0.0.1", 0)
    await gateway.shutdown(0)


async def test_gateway_serve_exits_with_the_reason_on_the_placeholder(serve_app, tmp_path):
    url = await serve_app(Recorder().app())
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "gateway",
        "serve",
        "--upstream",
        url,
        "--port",
        "0",
        "--admin-port",
        "0",
        env={"GATEWAY_ADMIN_TOKEN": PLACEHOLDER_TOKEN, "PATH": "/usr/bin:/bin"},
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1
    assert b"placeholder of deploy/k8s/secret.yaml" in err


@pytest.mark.parametrize(
    ("token", "env"),
    [('""', {}), ('"   "', {}), ('"${EMPTY_ADMIN_TOKEN}"', {"EMPTY_ADMIN_TOKEN": ""})],
    ids=["empty", "blank", "variable set to nothing"],
)
async def test_an_empty_admin_token_is_refused_at_start(
    serve_app, tmp_path, monkeypatch, token, env
):
    """Else ``Authorization: Bearer`` with nothing after it would match it."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    url = await serve_app(Recorder().app())
    policy = write_policy(
        tmp_path,
        f'backends: {{main: {{url: "{url}"}}}}\nroutes: [{{backend: main}}]\n'
        f"admin: {{token: {token}}}\n",
    )
    with pytest.raises(PolicyError, match=r"admin\.token: is empty"):
        Gateway(PolicySource(policy))


def test_gateway_check_refuses_an_empty_token_but_not_one_from_an_unset_variable(tmp_path):
    from gateway.cli import main

    empty = write_policy(tmp_path, 'backends: {m: {url: "http://m"}}\nadmin: {token: ""}\n')
    assert main(["check", str(empty)]) == 1
    unset = write_policy(
        tmp_path,
        'backends: {m: {url: "http://m"}}\nadmin: {token: "${NOT_SET_HERE_XYZ}"}\n',
        name="unset.yaml",
    )
    assert main(["check", str(unset)]) == 0  # a warning: the Secret is not on this machine


@pytest.mark.parametrize("given", ["Bearer", "bearer", ""])
async def test_an_empty_token_never_authenticates(serve_app, given):
    """Whatever reaches the admin app with an empty token (it is refused at start): no
    credential matches it."""
    from aiohttp import web

    from gateway.admin.access import guarded

    async def secret(request: web.Request) -> web.Response:
        return web.Response(text="secret")

    app = web.Application()
    app.router.add_post("/reload", guarded(secret, lambda: "", loopback=False))
    url = await serve_app(app)
    async with httpx.AsyncClient() as client:
        r = await client.post(url + "/reload", headers={"Authorization": given})
    assert r.status_code == 401
