"""/metrics shows the gauges only some models have, beside the KV-cache usage, and only for
those models: a hybrid model's recurrent-state slots, and the windowed layers' own KV pool (KV
groups); and how many CUDA graphs the engine has still to capture."""

from __future__ import annotations

from appliance.api.metrics import ServerMetrics
from appliance.engine.outputs import EngineStats

STATE_GAUGE = "inferno:recurrent_state_usage_perc"
WINDOW_GAUGE = "inferno:window_kv_cache_usage_perc"


class _Engine:
    def __init__(self, stats: EngineStats):
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def _gauges(**optional: float | None) -> dict[str, float]:
    """The gauges /metrics shows for an engine at 25% KV usage with `optional` stats set."""
    stats = EngineStats(
        num_running=3,
        num_waiting=0,
        kv_cache_usage=0.25,
        num_preemptions=0,
        num_prefix_cache_queries=0,
        num_prefix_cache_hits=0,
        **optional,
    )
    metrics = ServerMetrics("m")
    metrics.watch(_Engine(stats))  # type: ignore[arg-type]  # only stats() is read
    return {m.name: m.samples[0].value for m in metrics.engine_metrics() if m.type == "gauge"}


def test_a_hybrid_models_state_slot_usage_is_a_gauge_beside_the_kv_usage():
    gauges = _gauges(recurrent_state_usage=0.75)
    assert gauges[STATE_GAUGE] == 0.75
    assert gauges["vllm:kv_cache_usage_perc"] == 0.25


def test_other_models_have_no_recurrent_state_gauge():
    assert STATE_GAUGE not in _gauges(recurrent_state_usage=None)


def test_the_window_pools_usage_is_a_gauge_beside_the_full_pools():
    gauges = _gauges(window_kv_cache_usage=0.5)
    assert gauges[WINDOW_GAUGE] == 0.5
    assert gauges["vllm:kv_cache_usage_perc"] == 0.25


def test_a_model_with_one_kv_pool_has_no_window_gauge():
    assert WINDOW_GAUGE not in _gauges(window_kv_cache_usage=None)


def test_the_cuda_graphs_still_to_capture_are_a_gauge():
    """The server's engine captures its graphs while idle after start-up: operators see how
    many are left (0 once all are captured, and on the CPU)."""
    assert _gauges(num_pending_graphs=7)["inferno:cuda_graphs_pending"] == 7
    assert _gauges()["inferno:cuda_graphs_pending"] == 0
