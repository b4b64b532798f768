"""The admin listener: health, readiness gated on warm-up, metrics on their own port, the
effective policy, and the loopback rule for mutating endpoints without a token."""

from __future__ import annotations

import asyncio
import logging

import httpx
from aiohttp import web

from gateway.metrics import Metrics, names
from gateway.metrics.merged import supervisor_names
from tests.helpers import until, write_policy
from tests.upstreams import Recorder


async def test_readyz_waits_for_warmup_requests_to_answer(serve_app, start_gateway, tmp_path):
    answered = asyncio.Event()
    warmed: list[bytes] = []

    async def chat(request: web.Request) -> web.Response:
        warmed.append(await request.read())
        await answered.wait()
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    url = await serve_app(app)
    policy = write_policy(
        tmp_path,
        f"""
        backends:
          main:
            url: "{url}"
            warmup: [{{path: /v1/chat/completions, body: {{model: m, max_tokens: 1}}}}]
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    gw = await start_gateway(policy=policy)
    async with httpx.AsyncClient() as client:
        assert (await client.get(gw.admin_url + "/healthz")).status_code == 200
        not_yet = await client.get(gw.admin_url + "/readyz")
        assert not_yet.status_code == 503 and not_yet.json()["reason"] == "warming up"
        answered.set()
        for _ in range(200):
            if (await client.get(gw.admin_url + "/readyz")).status_code == 200:
                break
            await asyncio.sleep(0.01)
        assert (await client.get(gw.admin_url + "/readyz")).status_code == 200
    assert warmed == [b'{"model": "m", "max_tokens": 1}']


async def test_warmup_retries_a_backend_that_is_still_starting(
    serve_app, start_gateway, tmp_path, unused_tcp_port, caplog
):
    import gateway.transport.warmup

    gateway.transport.warmup.RETRY_DELAY_S = 0.01
    try:
        policy = write_policy(
            tmp_path,
            f"""
            backends:
              main:
                url: "http://127.0.0.1:{unused_tcp_port}"
                warmup: [{{path: /v1/models, method: GET}}]
            routes: [{{match: {{path: "*"}}, backend: main}}]
            """,
        )
        caplog.set_level(logging.INFO, "gateway.transport.warmup")
        gw = await start_gateway(policy=policy)
        await until(lambda: caplog.text.count("retrying") >= 2)
        assert not gw.gateway.ready  # tried twice, refused twice: still warming up
        rec = Recorder()
        runner = web.AppRunner(rec.app())
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
        try:
            await asyncio.wait_for(rec.arrived.wait(), 5)
            for _ in range(100):
                if gw.gateway.ready:
                    break
                await asyncio.sleep(0.01)
            assert gw.gateway.ready
        finally:
            await runner.cleanup()
    finally:
        gateway.transport.warmup.RETRY_DELAY_S = 1.0


async def test_metrics_are_served_on_the_admin_port_only(serve_app, start_gateway):
    rec = Recorder()
    url = await serve_app(rec.app())
    gw = await start_gateway(upstream=url)
    async with httpx.AsyncClient() as client:
        admin = await client.get(gw.admin_url + "/metrics")
        data = await client.get(gw.url + "/metrics")
    assert "gateway_policy_generation 1.0" in admin.text
    assert admin.headers["Content-Type"].startswith("text/plain")
    assert data.json()["path"] == "/metrics"  # proxied to the backend like any path


async def test_const_labels_from_the_policy_label_every_series(serve_app, start_gateway, tmp_path):
    rec = Recorder()
    url = await serve_app(rec.app())
    policy = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        metrics: {{const_labels: {{gpu_type: h200, model_version: v7}}}}
        """,
    )
    gw = await start_gateway(policy=policy)
    text = gw.gateway.metrics.exposition().decode()
    assert 'gateway_policy_generation{gpu_type="h200",model_version="v7"} 1.0' in text


async def test_mutating_admin_endpoints_need_a_token_off_loopback(serve_app, tmp_path, monkeypatch):
    from gateway.app import Gateway
    from gateway.policy.watch import PolicySource

    monkeypatch.delenv("GATEWAY_ADMIN_TOKEN", raising=False)
    rec = Recorder()
    url = await serve_app(rec.app())
    path = write_policy(
        tmp_path,
        f"""
        backends: {{main: {{url: "{url}"}}}}
        routes: [{{match: {{path: "*"}}, backend: main}}]
        """,
    )
    exposed = Gateway(PolicySource(path))
    _, admin = await exposed.start("127.0.0.1", 0, "0.0.0.0", 0)
    local = Gateway(PolicySource(path))
    _, local_admin = await local.start("127.0.0.1", 0, "127.0.0.1", 0)
    try:
        port = admin.rsplit(":", 1)[1]
        async with httpx.AsyncClient() as client:
            refused = await client.post(f"http://127.0.0.1:{port}/reload")
            allowed = await client.post(local_admin + "/reload")
            health = await client.get(f"http://127.0.0.1:{port}/healthz")
        assert refused.status_code == 401
        assert allowed.status_code == 200
        assert health.status_code == 200
    finally:
        await exposed.shutdown(0.1)
        await local.shutdown(0.1)


def test_metric_names_are_the_public_contract():
    """Dashboards and alerts depend on these names: changing one is a breaking change."""
    assert names(Metrics()) == [
        "gateway_backend_failures",
        "gateway_backend_model_identity",
        "gateway_batch_limit",
        "gateway_batch_oom_backoffs",
        "gateway_batch_size",
        "gateway_batch_splits",
        "gateway_batch_wait_seconds",
        "gateway_breaker_state",
        "gateway_breaker_transitions",
        "gateway_build_info",
        "gateway_cache_bytes",
        "gateway_cache_embedding_entries",
        "gateway_cache_embedding_refused",
        "gateway_cache_embedding_shared",
        "gateway_cache_entries",
        "gateway_cache_feedback",
        "gateway_cache_feedback_limited",
        "gateway_cache_judge",
        "gateway_cache_judge_aliases",
        "gateway_cache_lookup_seconds",
        "gateway_cache_lookups",
        "gateway_cache_not_stored",
        "gateway_cache_store_errors",
        "gateway_cache_store_transitions",
        "gateway_cache_store_up",
        "gateway_client_concurrency_limited",
        "gateway_client_in_flight",
        "gateway_client_timeouts",
        "gateway_coalesced_own_calls",
        "gateway_coalesced_requests",
        "gateway_concurrency_decisions",
        "gateway_connections",
        "gateway_control_paths_refused",
        "gateway_desired_endpoints",
        "gateway_endpoint_adapter_picks",
        "gateway_endpoint_inflight",
        "gateway_endpoint_pins",
        "gateway_endpoint_requests",
        "gateway_endpoint_retries",
        "gateway_endpoint_signal",
        "gateway_endpoint_state",
        "gateway_endpoint_warmups",
        "gateway_event_loop_lag_seconds",
        "gateway_fallbacks",
        "gateway_forecast_requests_per_second",
        "gateway_gc_pause_seconds",
        "gateway_generation_bounds",
        "gateway_gpu_memory_used_ratio",
        "gateway_gpu_power_ratio",
        "gateway_gpu_slowdown_temperature_celsius",
        "gateway_gpu_temperature_celsius",
        "gateway_gpu_thermal_throttling",
        "gateway_gpu_utilization_ratio",
        "gateway_hedge_delay_seconds",
        "gateway_hedges",
        "gateway_inflight_requests",
        "gateway_kv_cache_usage_ratio",
        "gateway_mirror_comparisons",
        "gateway_mirror_duration_seconds",
        "gateway_mirror_in_flight",
        "gateway_mirror_requests",
        "gateway_model_list_missing",
        "gateway_policy_generation",
        "gateway_policy_info",
        "gateway_policy_reload_failures",
        "gateway_pool_active_endpoints",
        "gateway_queue_depth",
        "gateway_queue_wait_seconds",
        "gateway_rate_limit_decisions",
        "gateway_rate_limit_store_up",
        "gateway_rate_limited",
        "gateway_redis_command_failures",
        "gateway_redis_timeouts_forgiven",
        "gateway_redis_transitions",
        "gateway_redis_up",
        "gateway_refused_connections",
        "gateway_request_duration_seconds",
        "gateway_requests",
        "gateway_response_ids_refused",
        "gateway_shed",
        "gateway_spend_refused",
        "gateway_stream_first_byte_seconds",
        "gateway_target_model_requests",
        "gateway_telemetry_age_seconds",
        "gateway_tenant_concurrency_limited",
        "gateway_tenant_cost",
        "gateway_tenant_in_flight",
        "gateway_tenant_queue_wait_seconds",
        "gateway_tenant_requests",
        "gateway_tenant_tokens",
        "gateway_throttle_active",
        "gateway_throttle_signal_seen",
        "gateway_throttle_threshold",
        "gateway_throttle_transitions",
        "gateway_tokens",
        "gateway_upstream_connections",
        "gateway_upstream_duration_seconds",
        "gateway_upstream_stale_retries",
        "process_cpu_seconds",
        "process_max_fds",
        "process_open_fds",
        "process_resident_memory_bytes",
        "process_start_time_seconds",
        "process_virtual_memory_bytes",
        "python_gc_collections",
        "python_gc_objects_collected",
        "python_gc_objects_uncollectable",
        "python_info",
    ]


def test_the_supervisors_own_metric_names_are_public_contract_too():
    """``gateway serve --workers N``: the supervisor's admin port adds these to the workers'
    merged names."""
    assert supervisor_names() == ["gateway_worker_restarts", "gateway_workers"]
