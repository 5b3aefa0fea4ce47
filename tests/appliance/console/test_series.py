"""The Overview's time series (appliance.console.series): a ring bounded to the last hour,
rates and latency percentiles per interval from the serving counters, the engine's load, and a
sampler driven by a fake clock."""

from __future__ import annotations

import asyncio
import math

import pytest

from appliance.api.metrics import HistogramCounts, ServerMetrics, ServingCounters
from appliance.console.gpus import GpuReading, GpuReport
from appliance.console.series import (
    FIELDS,
    SeriesSampler,
    TimeSeries,
    columns,
    histogram_quantile,
    interval_quantile,
)
from appliance.engine.outputs import EngineStats

NO_GPU = GpuReport((), "NVML sees no GPU", no_gpu=True)
BOUNDS = (0.1, 0.25, 0.5, 1.0, math.inf)


def counters(
    num_requests: float = 0,
    num_output_tokens: float = 0,
    ttft: tuple[float, ...] = (0, 0, 0, 0, 0),
    tpot: tuple[float, ...] = (0, 0, 0, 0, 0),
) -> ServingCounters:
    ttft_counts, tpot_counts = HistogramCounts(BOUNDS, ttft), HistogramCounts(BOUNDS, tpot)
    return ServingCounters(num_requests, num_output_tokens, ttft_counts, tpot_counts)


def stats(
    running: int = 0, waiting: int = 0, kv: float = 0.0, preemptions: int = 0,
    queries: int = 0, hits: int = 0,
) -> EngineStats:  # fmt: skip
    return EngineStats(running, waiting, kv, preemptions, queries, hits)


def test_the_first_sample_only_starts_the_first_interval() -> None:
    series = TimeSeries(interval_s=5)
    assert series.record(1000.0, 0.0, counters(), stats(), NO_GPU) is None
    assert series.points() == [] and series.latest() is None and series.last_seq == -1


def test_rates_are_what_ended_in_the_interval_over_its_measured_length() -> None:
    series = TimeSeries(interval_s=5)
    series.record(1000.0, 10.0, counters(40, 4000), stats(), NO_GPU)
    # The tick came late (6 s, not 5): the rates divide by the time that really passed.
    point = series.record(1006.0, 16.0, counters(52, 4600), stats(), NO_GPU)
    assert point is not None
    assert point.requests_per_s == pytest.approx(12 / 6)
    assert point.output_tokens_per_s == pytest.approx(600 / 6)
    assert (point.seq, point.time) == (0, 1006.0)


def test_percentiles_cover_only_the_requests_that_ended_in_the_interval() -> None:
    series = TimeSeries(interval_s=5)
    # Before: 100 fast requests (all under 0.1 s). In the interval: 10 more, 5 of them slow.
    series.record(0.0, 0.0, counters(100, ttft=(100, 100, 100, 100, 100)), stats(), NO_GPU)
    after = counters(110, ttft=(105, 105, 105, 110, 110))
    point = series.record(5.0, 5.0, after, stats(), NO_GPU)
    assert point is not None
    # Rank 5 of 10 is the 5th fast one: the top of the first bucket.
    assert point.ttft_p50_s == pytest.approx(0.1)
    # Rank 9.9 lies in (0.5, 1.0], which holds ranks 6-10: 0.5 + 0.5 × (9.9 - 5) / 5.
    assert point.ttft_p99_s == pytest.approx(0.5 + 0.5 * 4.9 / 5)
    assert point.tpot_p50_s is None and point.tpot_p99_s is None  # none observed


def test_histogram_quantile_follows_prometheus() -> None:
    assert histogram_quantile(0.5, BOUNDS, (0, 0, 0, 0, 0)) is None
    assert histogram_quantile(0.5, BOUNDS, (0, 4, 4, 4, 4)) == pytest.approx(0.175)
    # In the +inf bucket: the highest finite bound, as Prometheus answers.
    assert histogram_quantile(0.99, BOUNDS, (0, 0, 0, 0, 3)) == 1.0
    assert interval_quantile(
        0.5, HistogramCounts(BOUNDS, (1, 1, 1, 1, 1)), HistogramCounts(BOUNDS, (1, 3, 3, 3, 3))
    ) == pytest.approx(0.175)


def test_engine_load_is_the_latest_and_its_counters_grow_per_interval() -> None:
    series = TimeSeries(interval_s=5)
    series.record(0.0, 0.0, counters(), stats(preemptions=3, queries=100, hits=10), NO_GPU)
    now = stats(running=7, waiting=2, kv=0.25, preemptions=5, queries=300, hits=160)
    point = series.record(5.0, 5.0, counters(), now, NO_GPU)
    assert point is not None
    assert (point.num_running, point.num_waiting, point.kv_cache_usage) == (7, 2, 0.25)
    assert point.num_preemptions == 2
    assert point.prefix_cache_hit_rate == pytest.approx(150 / 200)  # this interval's, not all
    quiet = series.record(10.0, 10.0, counters(), now, NO_GPU)
    assert quiet is not None and quiet.prefix_cache_hit_rate is None  # nothing looked up
    assert quiet.num_preemptions == 0


def test_without_an_engine_its_values_are_missing_not_zero() -> None:
    series = TimeSeries(interval_s=5)
    series.record(0.0, 0.0, counters(), None, NO_GPU)
    point = series.record(5.0, 5.0, counters(), stats(running=1), NO_GPU)
    assert point is not None
    assert point.num_running == 1 and point.num_preemptions is None
    assert point.prefix_cache_hit_rate is None
    # Another engine's counters (lower than the last): unknown, not negative.
    series.record(10.0, 10.0, counters(), stats(preemptions=9), NO_GPU)
    point = series.record(15.0, 15.0, counters(), stats(preemptions=1), NO_GPU)
    assert point is not None and point.num_preemptions is None


def test_gpus_are_recorded_one_value_per_gpu() -> None:
    gpus = GpuReport((
        GpuReading(0, "H100", 80, 40 << 30, 80 << 30, 61, "on"),
        GpuReading(1, "H100", None, None, None, None, "on"),
    ))  # fmt: skip
    series = TimeSeries(interval_s=5)
    series.record(0.0, 0.0, counters(), None, gpus)
    point = series.record(5.0, 5.0, counters(), None, gpus)
    assert point is not None
    assert point.gpu_utilization_pct == (80.0, None)
    assert point.gpu_memory_used == (0.5, None)
    assert point.gpu_temperature_c == (61.0, None)


def test_the_ring_keeps_the_last_hour_and_no_more() -> None:
    series = TimeSeries(interval_s=5)
    assert series.capacity == 720
    for tick in range(2000):
        series.record(float(tick * 5), float(tick * 5), counters(tick), None, NO_GPU)
    points = series.points()
    assert len(points) == 720
    assert points[-1].seq == series.last_seq == 1998 and points[0].seq == 1998 - 719
    assert points[-1].time - points[0].time == 5 * 719
    assert [p.seq for p in series.points(after_seq=1995)] == [1996, 1997, 1998]
    assert series.points(after_seq=1998) == []
    assert len(series.points(after_seq=5)) == 720  # fell out of the window: all that is kept


def test_samples_out_of_time_order_are_refused() -> None:
    series = TimeSeries(interval_s=5)
    series.record(0.0, 5.0, counters(), None, NO_GPU)
    with pytest.raises(ValueError, match="time order"):
        series.record(0.0, 5.0, counters(), None, NO_GPU)
    with pytest.raises(ValueError, match="interval"):
        TimeSeries(interval_s=0)


def test_columns_hold_one_rounded_list_per_field() -> None:
    series = TimeSeries(interval_s=5)
    series.record(1_700_000_000.0, 0.0, counters(), None, NO_GPU)
    series.record(1_700_000_005.123456, 3.0, counters(1, 7), None, NO_GPU)
    table = columns(series.points())
    assert list(table) == list(FIELDS)
    assert table["time"] == [1_700_000_005.123]
    assert table["requests_per_s"] == [0.3333] and table["output_tokens_per_s"] == [2.333]
    assert table["num_running"] == [None] and table["gpu_utilization_pct"] == [[]]


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


class FakeMonitor:
    def __init__(self) -> None:
        self.num_reads = 0
        self.closed = False

    async def read(self) -> GpuReport:
        self.num_reads += 1
        return NO_GPU

    def close(self) -> None:
        self.closed = True


def test_the_sampler_reads_the_metrics_each_tick_and_stops_with_the_app() -> None:
    metrics, clock, monitor = ServerMetrics("m"), FakeClock(), FakeMonitor()
    sampler = SeriesSampler(metrics, monitor, 5.0, wall=clock, monotonic=clock)  # type: ignore[arg-type]

    async def run() -> None:
        await sampler.tick()
        metrics.observe_request(
            ttft_s=0.2, e2e_s=1.0, num_prompt_tokens=5, num_output_tokens=21, finish_reason="stop"
        )
        clock.now_s += 5
        await sampler.tick()
        sampler.start()
        await asyncio.sleep(0.01)  # its first tick runs at once
        await sampler.stop()

    asyncio.run(run())
    first = sampler.series.points()[0]
    assert first.requests_per_s == pytest.approx(1 / 5)
    assert first.output_tokens_per_s == pytest.approx(21 / 5)
    assert 0.1 < first.ttft_p50_s <= 0.25  # type: ignore[operator]
    assert first.tpot_p50_s is not None and first.num_running is None  # no engine watched
    assert monitor.num_reads == 3 and monitor.closed
    assert sampler.gpus is NO_GPU


def test_a_failing_tick_does_not_end_the_sampler(caplog: pytest.LogCaptureFixture) -> None:
    clock, monitor = FakeClock(), FakeMonitor()

    class Broken(ServerMetrics):
        def counters(self) -> ServingCounters:
            raise RuntimeError("boom")

    sampler = SeriesSampler(Broken("m"), monitor, 0.01, wall=clock, monotonic=clock)  # type: ignore[arg-type]

    async def run() -> None:
        sampler.start()
        while monitor.num_reads < 3:
            clock.now_s += 0.01
            await asyncio.sleep(0.005)
        await sampler.stop()

    asyncio.run(run())
    assert "sampling the console's time series failed" in caplog.text
