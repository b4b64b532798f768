"""The model servers' own control endpoints kept from clients (``server.control_paths``): a
catch-all route in front of a server that would act on them (sleep, erase a slot, delete a
model, unload one) answers a 403 ``control_path_refused`` before any backend, however the
path is spelled; what only reads passes; ``pass`` forwards them.  A recording server on a
real socket, and llama.cpp's real server, which sets every request's LoRA scales on a POST
to ``/lora-adapters``."""

from __future__ import annotations

import httpx
import pytest
from aiohttp import web

from tests.helpers import metric, write_policy

CONTROL = [  # (method, path, the server kind counted)
    ("GET", "/slots", "llama.cpp"),
    ("POST", "/slots/0?action=erase", "llama.cpp"),
    ("POST", "/props", "llama.cpp"),
    ("POST", "/lora-adapters", "llama.cpp"),
    ("POST", "/models/unload", "llama.cpp"),
    ("POST", "/sleep?level=1", "vllm"),
    ("POST", "/reset_prefix_cache", "vllm"),
    ("POST", "/collective_rpc", "vllm"),
    ("POST", "/v1/load_lora_adapter", "vllm"),
    ("GET", "/server_info", "vllm"),
    ("POST", "/flush_cache", "sglang"),
    ("POST", "/update_weights_from_disk", "sglang"),
    ("POST", "/api/pull", "ollama"),
    ("DELETE", "/api/delete", "ollama"),
    ("POST", "/api/blobs/sha256:00", "ollama"),
    ("POST", "/v2/repository/index", "kserve"),
    ("POST", "/v2/repository/models/m/unload", "kserve"),
    ("POST", "/v2/systemsharedmemory/region/r/register", "kserve"),
    ("POST", "/v2/logging", "kserve"),
    ("POST", "/v2/models/m/trace/setting", "kserve"),
    ("POST", "/sim/config", "sim"),
]
READS = [  # pass whatever control_paths says
    ("GET", "/props"),
    ("GET", "/lora-adapters"),
    ("GET", "/api/tags"),
    ("POST", "/api/show"),
    ("GET", "/is_sleeping"),
    ("GET", "/v2/logging"),
    ("GET", "/v2/models/m"),
    ("POST", "/v2/models/m/infer"),
    ("GET", "/metrics"),
    ("GET", "/slotsmachine"),  # a name that only starts like one
    ("GET", "/sim/state"),
]


class Recorder:
    """Answers every path with 200, noting what it was asked."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.answer)
        return app

    async def answer(self, request: web.Request) -> web.Response:
        self.asked.append((request.method, request.path_qs))
        return web.json_response({"ok": True})


def catch_all(url: str, control: str = "") -> str:
    server = f"server: {{control_paths: {control}}}\n" if control else ""
    return f"{server}backends: {{main: {{url: '{url}'}}}}\nroutes: [{{backend: main}}]\n"


async def test_every_control_endpoint_is_refused_before_any_backend(
    serve_app, start_gateway, tmp_path
):
    recorder = Recorder()
    gw = await start_gateway(
        policy=write_policy(tmp_path, catch_all(await serve_app(recorder.app())))
    )
    async with httpx.AsyncClient() as client:
        for method, path, _ in CONTROL:
            reply = await client.request(method, gw.url + path, json={})
            assert reply.status_code == 403, (method, path)
            error = reply.json()["error"]
            assert error["code"] == "control_path_refused", (method, path)
            assert "server.control_paths" in error["message"]
        for method, path in READS:
            reply = await client.request(method, gw.url + path)
            assert reply.status_code == 200, (method, path)
        text = (await client.get(gw.admin_url + "/metrics")).text
    assert recorder.asked == [(method, path) for method, path in READS]
    counter = "gateway_control_paths_refused_total"
    for kind in ("llama.cpp", "vllm", "sglang", "ollama", "kserve", "sim"):
        expected = sum(1 for *_, each in CONTROL if each == kind)
        assert metric(text, counter, tenant="", server=kind) == expected


async def test_no_spelling_of_a_control_path_reaches_the_server(serve_app, start_gateway, tmp_path):
    recorder = Recorder()
    gw = await start_gateway(
        policy=write_policy(tmp_path, catch_all(await serve_app(recorder.app())))
    )
    spellings = [
        "//slots",
        "/v1/../slots",
        "/slots/",
        "/%73lots",  # an encoded unreserved letter is the same path
        "/sleep/",
        "/./api/delete",
        "/v2//repository/index",
        "/SLOTS",  # Express, ASP.NET Core and Fiber route without regard to case
        "/Api/Delete",
        "/Sleep",
    ]
    async with httpx.AsyncClient() as client:
        for path in spellings:
            # httpx would tidy the path itself: the target goes as written
            request = client.build_request("POST", gw.url, json={})
            request.url = request.url.copy_with(raw_path=path.encode())
            reply = await client.send(request)
            assert reply.status_code == 403, path
    assert recorder.asked == []


async def test_pass_forwards_them_for_an_operator(serve_app, start_gateway, tmp_path):
    recorder = Recorder()
    url = await serve_app(recorder.app())
    gw = await start_gateway(policy=write_policy(tmp_path, catch_all(url, control="pass")))
    async with httpx.AsyncClient() as client:
        for method, path, _ in CONTROL:
            assert (await client.request(method, gw.url + path)).status_code == 200
    assert recorder.asked == [(method, path) for method, path, _ in CONTROL]


@pytest.mark.llm
async def test_llama_cpps_global_lora_scales_and_slots_are_kept_from_clients(
    llama, start_gateway, tmp_path
):
    """llama.cpp's server takes a POST to ``/lora-adapters`` from anyone, with no flag, and
    sets the adapters' scales for every request after it; its ``/slots`` shows what each
    slot runs."""
    gw = await start_gateway(policy=write_policy(tmp_path, catch_all(llama.url)))
    async with httpx.AsyncClient(timeout=60) as client:
        assert (await client.post(llama.url + "/lora-adapters", json=[])).status_code == 200
        set_scales = await client.post(gw.url + "/lora-adapters", json=[])
        assert set_scales.status_code == 403
        assert (await client.get(gw.url + "/slots")).status_code == 403
        assert (await client.get(gw.url + "/lora-adapters")).json() == []
        props = await client.get(gw.url + "/props")
        assert props.status_code == 200 and "default_generation_settings" in props.json()
