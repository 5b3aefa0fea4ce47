"""The Overview's chart texts (appliance.console.charts): values in each chart's unit, each
chart's summary (its text alternative), and the current values of the traffic and engine
panels."""

from __future__ import annotations

import json
from dataclasses import replace

from appliance.console.charts import (
    CHARTS,
    charts_for,
    current,
    format_value,
    series_json,
    summaries,
    summary,
)
from appliance.console.gpus import GpuReport
from appliance.console.series import SeriesPoint
from appliance.engine.outputs import EngineStats

BY_KEY = {chart.key: chart for chart in CHARTS}
NO_GPU = GpuReport((), "NVML sees no GPU", no_gpu=True)
POINT = SeriesPoint(
    seq=0, time=1_700_000_000.0, requests_per_s=9.8, output_tokens_per_s=2450.0,
    ttft_p50_s=0.0412, ttft_p99_s=0.126, tpot_p50_s=0.0125, tpot_p99_s=0.0152,
    num_running=31, num_waiting=0, kv_cache_usage=0.125, prefix_cache_hit_rate=None,
    num_preemptions=0, gpu_utilization_pct=(87.0, 12.0), gpu_memory_used=(0.5, 0.25),
    gpu_temperature_c=(61.0, 40.0),
)  # fmt: skip


def test_values_are_shown_in_each_charts_unit() -> None:
    assert format_value(BY_KEY["requests"], 9.8) == "9.8 req/s"
    assert format_value(BY_KEY["tokens"], 2450.4) == "2,450 tok/s"
    assert format_value(BY_KEY["ttft"], 0.0412) == "41.2 ms"
    assert format_value(BY_KEY["ttft"], 0.126) == "126 ms"
    assert format_value(BY_KEY["kv"], 0.125) == "12.5 %"
    assert format_value(BY_KEY["load"], 31) == "31"
    assert format_value(BY_KEY["preemptions"], 0) == "0"
    assert format_value(BY_KEY["gpu-temperature"], 61.0) == "61 °C"
    assert format_value(BY_KEY["requests"], None) == "none"


def test_gpu_charts_are_shown_only_with_gpus() -> None:
    assert [c.key for c in charts_for(0)] == [
        "requests", "tokens", "ttft", "tpot", "load", "kv", "prefix", "preemptions",
    ]  # fmt: skip
    assert len(charts_for(2)) == len(CHARTS)


def test_a_summary_names_the_latest_and_the_highest_values() -> None:
    quieter = replace(POINT, seq=1, time=POINT.time + 5, requests_per_s=4.0, ttft_p99_s=None)
    points = [POINT, quieter]
    assert summary(BY_KEY["requests"], points, 0, 5.0) == (
        "Now 4 req/s; highest in the last 1 min 9.8 req/s."
    )
    assert summary(BY_KEY["ttft"], points, 0, 5.0) == (
        "Now p50 41.2 ms; highest in the last 1 min p50 41.2 ms, p99 126 ms."
    )
    idle = replace(quieter, ttft_p50_s=None)
    assert summary(BY_KEY["ttft"], [POINT, idle], 0, 5.0) == (
        "Now none; highest in the last 1 min p50 41.2 ms, p99 126 ms."
    )
    assert summary(BY_KEY["gpu-utilization"], points, 2, 5.0) == (
        "Now GPU 0 87 %, GPU 1 12 %; highest in the last 1 min GPU 0 87 %, GPU 1 12 %."
    )
    assert summary(BY_KEY["prefix"], points, 0, 5.0).endswith("highest in the last 1 min none.")
    hour = [replace(POINT, seq=i) for i in range(720)]
    assert "in the last hour" in summary(BY_KEY["requests"], hour, 0, 5.0)


def test_before_the_first_point_each_summary_says_when_it_comes() -> None:
    texts = summaries([], 0, 5.0)
    assert set(texts) == {c.key for c in charts_for(0)}
    assert texts["requests"] == "No sample yet: the first is taken 5 s after the server starts."


def test_current_values_of_the_traffic_and_engine_panels() -> None:
    stats = EngineStats(31, 2, 0.125, 4, 200, 150)
    assert current(POINT, stats) == {
        "requests": "9.8 req/s",
        "tokens": "2,450 tok/s",
        "ttft": "p50 41.2 ms, p99 126 ms",
        "tpot": "p50 12.5 ms, p99 15.2 ms",
        "running": "31",
        "waiting": "2",
        "kv": "12.5 %",
        "prefix_hit_rate": "75.0 %",
        "preemptions": "4",
    }
    idle = replace(POINT, ttft_p50_s=None, ttft_p99_s=None)
    assert current(idle, None)["ttft"] == "none: no request ended in the interval"
    assert current(None, EngineStats(0, 0, 0.0, 0, 0, 0))["prefix_hit_rate"] == (
        "no prompt looked up yet"
    )


def test_the_series_json_holds_the_new_points_or_all_of_them_with_reset() -> None:
    points = [replace(POINT, seq=i, time=POINT.time + 5 * i) for i in range(4)]
    options = {"series_id": "ab", "interval_s": 5.0, "window_s": 3600.0, "gpus": NO_GPU,
               "claims": None, "engine_device": "cpu", "stats": None}  # fmt: skip
    newer = json.loads(series_json(points, after_seq=1, **options))
    assert (newer["reset"], newer["last_seq"], newer["series"]["seq"]) == (False, 3, [2, 3])
    assert newer["gpu_note"] == "No GPU: the engine runs on the CPU." and newer["gpus"] == []
    assert newer["summaries"]["requests"].startswith("Now 9.8 req/s")  # over all points
    for after_seq in (-1, 4):  # none yet, or a seq this series has not reached
        whole = json.loads(series_json(points, after_seq=after_seq, **options))
        assert whole["reset"] is True and whole["series"]["seq"] == [0, 1, 2, 3]
    empty = json.loads(series_json([], after_seq=-1, **options))
    assert empty["last_seq"] == -1 and empty["series"]["seq"] == []
