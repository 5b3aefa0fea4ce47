"""/metrics shows a hybrid model's recurrent-state slots beside the KV-cache usage, and only for
such a model."""

from __future__ import annotations

from appliance.api.metrics import ServerMetrics
from appliance.engine.outputs import EngineStats

GAUGE = "inferno:recurrent_state_usage_perc"


class _Engine:
    def __init__(self, stats: EngineStats):
        self._stats = stats

    def stats(self) -> EngineStats:
        return self._stats


def _gauges(recurrent_state_usage: float | None) -> dict[str, float]:
    stats = EngineStats(
        num_running=3,
        num_waiting=0,
        kv_cache_usage=0.25,
        num_preemptions=0,
        num_prefix_cache_queries=0,
        num_prefix_cache_hits=0,
        recurrent_state_usage=recurrent_state_usage,
    )
    metrics = ServerMetrics("m")
    metrics.watch(_Engine(stats))  # type: ignore[arg-type]  # only stats() is read
    return {m.name: m.samples[0].value for m in metrics.engine_metrics() if m.type == "gauge"}


def test_a_hybrid_models_state_slot_usage_is_a_gauge_beside_the_kv_usage():
    gauges = _gauges(0.75)
    assert gauges[GAUGE] == 0.75
    assert gauges["vllm:kv_cache_usage_perc"] == 0.25


def test_other_models_have_no_recurrent_state_gauge():
    assert GAUGE not in _gauges(None)
