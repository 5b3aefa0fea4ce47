"""/metrics shows the windowed layers' own KV pool (KV groups) beside the full layers' usage,
and only for a model with such a pool."""

from __future__ import annotations

from appliance.api.metrics import ServerMetrics
from appliance.engine.outputs import EngineStats

GAUGE = "inferno:window_kv_cache_usage_perc"


class _Engine:
    def __init__(self, stats: EngineStats):
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def _gauges(window_kv_cache_usage: float | None) -> dict[str, float]:
    stats = EngineStats(
        num_running=3,
        num_waiting=0,
        kv_cache_usage=0.25,
        num_preemptions=0,
        num_prefix_cache_queries=0,
        num_prefix_cache_hits=0,
        window_kv_cache_usage=window_kv_cache_usage,
    )
    metrics = ServerMetrics("m")
    metrics.watch(_Engine(stats))  # type: ignore[arg-type]  # only stats() is read
    return {m.name: m.samples[0].value for m in metrics.engine_metrics() if m.type == "gauge"}


def test_the_window_pools_usage_is_a_gauge_beside_the_full_pools():
    gauges = _gauges(0.5)
    assert gauges[GAUGE] == 0.5
    assert gauges["vllm:kv_cache_usage_perc"] == 0.25


def test_a_model_with_one_kv_pool_has_no_window_gauge():
    assert GAUGE not in _gauges(None)
