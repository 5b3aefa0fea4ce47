"""The Overview's time series: the serving counters (appliance.api.metrics), the engine's load
(`EngineStats`) and the GPUs' readings (appliance.console.gpus), sampled every `interval_s`
into a ring of fixed size that covers the last hour, for the Overview's live charts.

Each point describes one interval, from the sample before it to its own:

    requests_per_s, output_tokens_per_s   engine requests that ended in the interval, and
                                          their output tokens, per second
    ttft_p50_s, ttft_p99_s, tpot_p50_s,   percentiles over the requests that ended in the
    tpot_p99_s                            interval, estimated from the latency histograms'
                                          buckets as Prometheus's histogram_quantile does
                                          (linear within a bucket); None when none ended
    num_running, num_waiting,             the engine's load at the interval's end (None while
    kv_cache_usage                        no engine runs)
    prefix_cache_hit_rate                 prompt tokens found in the prefix cache ÷ those looked
                                          up in the interval (None when none were)
    num_preemptions                       preemptions in the interval
    gpu_utilization_pct, gpu_memory_used, per GPU at the interval's end (empty without GPUs)
    gpu_temperature_c

What it costs: nothing per request (the counters are the Prometheus metrics', kept anyway);
per tick, a few dozen counter reads, one NVML reading in a thread, one point appended. Memory:
`capacity` points whatever the uptime.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from appliance.api.metrics import HistogramCounts, ServerMetrics, ServingCounters
from appliance.console.gpus import NOT_READ, GpuMonitor, GpuReport
from appliance.engine.outputs import EngineStats

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 5.0
WINDOW_S = 3600.0


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """One interval of the series (module docstring); `seq` counts points since start, `time`
    is the interval's end (seconds since the epoch)."""

    seq: int
    time: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tpot_p50_s: float | None
    tpot_p99_s: float | None
    num_running: int | None
    num_waiting: int | None
    kv_cache_usage: float | None
    prefix_cache_hit_rate: float | None
    num_preemptions: int | None
    gpu_utilization_pct: tuple[float | None, ...]
    gpu_memory_used: tuple[float | None, ...]  # fraction of the GPU's memory
    gpu_temperature_c: tuple[float | None, ...]


FIELDS = tuple(field.name for field in fields(SeriesPoint))


@dataclass(frozen=True, slots=True)
class _Sample:
    monotonic_s: float
    counters: ServingCounters
    stats: EngineStats | None


class TimeSeries:
    """The ring of points: `record` a sample every interval; the first only starts the first
    interval. Pure: times are given, nothing is read here."""

    def __init__(self, interval_s: float, window_s: float = WINDOW_S) -> None:
        if interval_s <= 0 or window_s < interval_s:
            raise ValueError("the interval must be positive and at most the window")
        self.interval_s = interval_s
        self.window_s = window_s
        # Names this series among those of other runs of the server: a page that polls after a
        # restart gets the new series whole, not its points above a `seq` of the old one.
        self.id = secrets.token_hex(8)
        self.capacity = math.ceil(window_s / interval_s)
        self._points: deque[SeriesPoint] = deque(maxlen=self.capacity)
        self._previous: _Sample | None = None
        self._next_seq = 0

    def record(
        self,
        wall_s: float,
        monotonic_s: float,
        counters: ServingCounters,
        stats: EngineStats | None,
        gpus: GpuReport,
    ) -> SeriesPoint | None:
        """Close the interval since the previous sample at `monotonic_s` (its end, at `wall_s`
        on the wall clock): the point appended, or None for the first sample."""
        previous, self._previous = self._previous, _Sample(monotonic_s, counters, stats)
        if previous is None:
            return None
        elapsed_s = monotonic_s - previous.monotonic_s
        if elapsed_s <= 0:
            raise ValueError("samples must be recorded in time order")
        before, now = previous.counters, counters
        point = SeriesPoint(
            seq=self._next_seq,
            time=wall_s,
            requests_per_s=max(now.num_requests - before.num_requests, 0.0) / elapsed_s,
            output_tokens_per_s=max(now.num_output_tokens - before.num_output_tokens, 0.0)
            / elapsed_s,
            ttft_p50_s=interval_quantile(0.50, before.ttft, now.ttft),
            ttft_p99_s=interval_quantile(0.99, before.ttft, now.ttft),
            tpot_p50_s=interval_quantile(0.50, before.tpot, now.tpot),
            tpot_p99_s=interval_quantile(0.99, before.tpot, now.tpot),
            num_running=None if stats is None else stats.num_running,
            num_waiting=None if stats is None else stats.num_waiting,
            kv_cache_usage=None if stats is None else stats.kv_cache_usage,
            prefix_cache_hit_rate=_hit_rate(previous.stats, stats),
            num_preemptions=_grown(previous.stats, stats, "num_preemptions"),
            gpu_utilization_pct=tuple(_float(gpu.utilization_pct) for gpu in gpus.gpus),
            gpu_memory_used=tuple(gpu.memory_used_fraction for gpu in gpus.gpus),
            gpu_temperature_c=tuple(_float(gpu.temperature_c) for gpu in gpus.gpus),
        )
        self._points.append(point)
        self._next_seq += 1
        return point

    @property
    def last_seq(self) -> int:
        """The newest point's `seq` (-1 before the first)."""
        return self._next_seq - 1

    def latest(self) -> SeriesPoint | None:
        return self._points[-1] if self._points else None

    def points(self, after_seq: int = -1) -> list[SeriesPoint]:
        """The points kept whose `seq` is above `after_seq`, oldest first."""
        if not self._points:
            return []
        skip = max(after_seq + 1 - self._points[0].seq, 0)
        return [self._points[i] for i in range(skip, len(self._points))]


def interval_quantile(q: float, before: HistogramCounts, after: HistogramCounts) -> float | None:
    """The `q` quantile of what a histogram observed between two readings of it, or None if it
    observed nothing."""
    counts = [b - a for a, b in zip(before.counts, after.counts, strict=True)]
    return histogram_quantile(q, after.bounds, counts)


def histogram_quantile(
    q: float, bounds: Sequence[float], cumulative: Sequence[float]
) -> float | None:
    """Prometheus's histogram_quantile over cumulative bucket counts (`cumulative[i]`
    observations at most `bounds[i]`, the last bound +inf): linear within the bucket that holds
    the rank, from the bucket below's bound (0 for the first); in the +inf bucket, the highest
    finite bound. None for no observation."""
    total = cumulative[-1]
    if total <= 0:
        return None
    rank = q * total
    i = next(i for i, count in enumerate(cumulative) if count >= rank)  # the last is `total`
    count = cumulative[i]
    if math.isinf(bounds[i]):
        return bounds[i - 1] if i > 0 else None
    lower = bounds[i - 1] if i > 0 else 0.0
    below = cumulative[i - 1] if i > 0 else 0.0
    in_bucket = count - below
    if in_bucket <= 0:
        return bounds[i]
    return lower + (bounds[i] - lower) * (rank - below) / in_bucket


def _hit_rate(before: EngineStats | None, now: EngineStats | None) -> float | None:
    queries = _grown(before, now, "num_prefix_cache_queries")
    hits = _grown(before, now, "num_prefix_cache_hits")
    if not queries or hits is None:
        return None
    return hits / queries


def _grown(before: EngineStats | None, now: EngineStats | None, name: str) -> int | None:
    """How much an engine counter grew; None without both readings, or if it went back (another
    engine)."""
    if before is None or now is None:
        return None
    grown = getattr(now, name) - getattr(before, name)
    return grown if grown >= 0 else None


def _float(value: int | None) -> float | None:
    return None if value is None else float(value)


class SeriesSampler:
    """Samples `metrics` and `gpus` into `series` every `interval_s` on the event loop, from
    `start` until `stop` (the app's lifespan)."""

    def __init__(
        self,
        metrics: ServerMetrics,
        gpus: GpuMonitor,
        interval_s: float = SAMPLE_INTERVAL_S,
        *,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.series = TimeSeries(interval_s)
        self.gpus: GpuReport = NOT_READ  # the latest reading
        self._metrics = metrics
        self._monitor = gpus
        self._wall = wall
        self._monotonic = monotonic
        self._task: asyncio.Task[None] | None = None

    @property
    def interval_s(self) -> float:
        return self.series.interval_s

    async def tick(self) -> None:
        """Take one sample."""
        self.gpus = await self._monitor.read()
        self.series.record(
            self._wall(),
            self._monotonic(),
            self._metrics.counters(),
            self._metrics.engine_stats(),
            self.gpus,
        )

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="inferno-series")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._monitor.close()

    async def _run(self) -> None:
        due_s = self._monotonic()
        while True:
            try:
                await self.tick()
            except Exception:  # a sample that fails must not end the charts for good
                logger.exception("sampling the console's time series failed")
            due_s += self.interval_s
            now_s = self._monotonic()
            if due_s < now_s:  # the loop was held up: skip the missed ticks
                due_s = now_s + self.interval_s
            await asyncio.sleep(due_s - now_s)


def columns(points: Sequence[SeriesPoint]) -> dict[str, list[Any]]:
    """The points as one list per field (the chart script's form): times to the millisecond,
    other numbers to 4 significant digits (the charts show 2 or 3)."""
    table = {name: [_rounded(getattr(p, name)) for p in points] for name in FIELDS}
    table["time"] = [round(p.time, 3) for p in points]
    return table


def _rounded(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_rounded(v) for v in value]
    if isinstance(value, float) and math.isfinite(value):
        return float(f"{value:.4g}")
    return value
