"""The demo's thermal scene, shortened: the GPU alone passes the limit, the gateway's
reroute rule keeps it cooler while the spare takes the overflow, and nobody sees an error."""

from __future__ import annotations

from gateway.demo.thermal import ThermalOptions, format_thermal, run_thermal


async def test_the_thermal_scene_reroutes_the_overflow_and_keeps_the_gpu_cooler():
    # Thermal time constant 1 s: the lone GPU passes 85 C after about 2 s.
    options = ThermalOptions(duration_s=3.0, time_scale=60.0)
    result = await run_thermal(options)
    assert result["peak_without_c"] > options.limit_c
    assert result["peak_with_c"] < result["peak_without_c"]
    assert result["spare_share"] > 0
    assert result["errors_without"] == result["errors_with"] == 0
    assert [row["t_s"] for row in result["series"]] == [1, 2, 3]
    table = format_thermal(result)
    assert "reroute to the spare above 83 C" in table
    assert len(table.splitlines()) == 2 + 1 + 3 + 2
