"""The Overview's charts as text: which series each chart draws, each chart's summary (its
text alternative, and what a page without script shows), the current values of the traffic
and engine panels, and the JSON the chart script polls (`series_json`). The script
(static/overview.js) draws the lines and puts these texts in place; it formats nothing itself.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from appliance.console.gpus import GpuReport, gpu_note, gpu_rows
from appliance.console.series import SeriesPoint, columns
from appliance.engine.outputs import EngineStats

NONE_YET = "none"


@dataclass(frozen=True, slots=True)
class Chart:
    """One chart: `lines` are (series field, label); a value shown is the field's × `scale`, in
    `unit`. A `per_gpu` chart draws one line per GPU of its one field."""

    key: str
    title: str
    lines: tuple[tuple[str, str], ...]
    unit: str
    scale: float = 1.0
    top: float | None = None  # a fixed top of the scale (percentages), else from the data
    per_gpu: bool = False

    def fields(self) -> str:
        return " ".join(field for field, _ in self.lines)


CHARTS = (
    Chart("requests", "Requests per second", (("requests_per_s", "ended"),), "req/s"),
    Chart("tokens", "Output tokens per second", (("output_tokens_per_s", "output"),), "tok/s"),
    Chart("ttft", "Time to first token", (("ttft_p50_s", "p50"), ("ttft_p99_s", "p99")), "ms",
          scale=1000.0),
    Chart("tpot", "Time per output token", (("tpot_p50_s", "p50"), ("tpot_p99_s", "p99")), "ms",
          scale=1000.0),
    Chart("load", "Requests running and waiting",
          (("num_running", "running"), ("num_waiting", "waiting")), ""),
    Chart("kv", "KV-cache use", (("kv_cache_usage", "used"),), "%", scale=100.0, top=100.0),
    Chart("prefix", "Prefix-cache hit rate", (("prefix_cache_hit_rate", "hit rate"),), "%",
          scale=100.0, top=100.0),
    Chart("preemptions", "Preemptions in each interval", (("num_preemptions", "preemptions"),), ""),
    Chart("gpu-utilization", "GPU utilization", (("gpu_utilization_pct", "GPU"),), "%",
          top=100.0, per_gpu=True),
    Chart("gpu-memory", "GPU memory used", (("gpu_memory_used", "GPU"),), "%", scale=100.0,
          top=100.0, per_gpu=True),
    Chart("gpu-temperature", "GPU temperature", (("gpu_temperature_c", "GPU"),), "°C",
          per_gpu=True),
)  # fmt: skip


def charts_for(num_gpus: int) -> list[Chart]:
    """The charts a page shows: the GPU charts only where there are GPUs."""
    return [chart for chart in CHARTS if num_gpus or not chart.per_gpu]


def summaries(points: Sequence[SeriesPoint], num_gpus: int, interval_s: float) -> dict[str, str]:
    """Each chart's summary over `points` (the last hour): its latest values and its highest."""
    return {
        chart.key: summary(chart, points, num_gpus, interval_s) for chart in charts_for(num_gpus)
    }


def summary(chart: Chart, points: Sequence[SeriesPoint], num_gpus: int, interval_s: float) -> str:
    """`Now p50 120 ms, p99 310 ms; highest in the last hour p50 150 ms, p99 450 ms.`"""
    if not points:
        return f"No sample yet: the first is taken {interval_s:g} s after the server starts."
    now, highest = [], []
    for label, values in _lines(chart, points, num_gpus):
        prefix = f"{label} " if len(chart.lines) > 1 or chart.per_gpu else ""
        shown = [v for v in values if v is not None]
        if values[-1] is not None:
            now.append(prefix + format_value(chart, values[-1]))
        highest.append(prefix + (format_value(chart, max(shown)) if shown else NONE_YET))
    minutes = (len(points) * interval_s) / 60
    span = "the last hour" if minutes >= 59 else f"the last {max(round(minutes), 1)} min"
    return f"Now {', '.join(now) or NONE_YET}; highest in {span} {', '.join(highest)}."


def _lines(
    chart: Chart, points: Sequence[SeriesPoint], num_gpus: int
) -> Iterator[tuple[str, list[float | None]]]:
    if chart.per_gpu:
        field = chart.lines[0][0]
        for index in range(num_gpus):
            yield f"GPU {index}", [_at(getattr(p, field), index) for p in points]
    else:
        for field, label in chart.lines:
            yield label, [getattr(p, field) for p in points]


def _at(values: tuple[float | None, ...], index: int) -> float | None:
    return values[index] if index < len(values) else None


def format_value(chart: Chart, value: float | None) -> str:
    """A value as the chart's unit shows it: `9.8 req/s`, `120 ms`, `45 %`; `none` for None."""
    if value is None:
        return NONE_YET
    shown = value * chart.scale
    number = f"{shown:,.0f}" if abs(shown) >= 100 or shown == int(shown) else f"{shown:.3g}"
    if not chart.unit:
        return number
    return f"{number} {chart.unit}"


def current(point: SeriesPoint | None, stats: EngineStats | None) -> dict[str, str]:
    """The Overview's current values as text: traffic over the last interval, and the engine's
    load now (its prefix-cache hit rate and preemptions since it started)."""
    by_key = {chart.key: chart for chart in CHARTS}
    texts = {key: NONE_YET for key in ("requests", "tokens", "ttft", "tpot")}
    if point is not None:
        texts |= {
            "requests": format_value(by_key["requests"], point.requests_per_s),
            "tokens": format_value(by_key["tokens"], point.output_tokens_per_s),
            "ttft": _percentiles(by_key["ttft"], point.ttft_p50_s, point.ttft_p99_s),
            "tpot": _percentiles(by_key["tpot"], point.tpot_p50_s, point.tpot_p99_s),
        }
    if stats is None:
        return texts
    hit_rate = "no prompt looked up yet"
    if stats.num_prefix_cache_queries:
        rate = stats.num_prefix_cache_hits / stats.num_prefix_cache_queries
        hit_rate = f"{100 * rate:.1f} %"
    return texts | {
        "running": str(stats.num_running),
        "waiting": str(stats.num_waiting),
        "kv": f"{100 * stats.kv_cache_usage:.1f} %",
        "prefix_hit_rate": hit_rate,
        "preemptions": str(stats.num_preemptions),
    }


def _percentiles(chart: Chart, p50: float | None, p99: float | None) -> str:
    if p50 is None and p99 is None:
        return "none: no request ended in the interval"
    return f"p50 {format_value(chart, p50)}, p99 {format_value(chart, p99)}"


def series_json(
    points: Sequence[SeriesPoint],
    *,
    series_id: str,
    after_seq: int,
    interval_s: float,
    window_s: float,
    gpus: GpuReport,
    claims: Mapping[str, Any] | None,
    engine_device: str,
    stats: EngineStats | None,
) -> bytes:
    """What the chart script polls: the points after `after_seq`, or all of them with `reset`
    when the page holds none of this series (its first poll, or a page older than a restart),
    with every text the page shows."""
    last_seq = points[-1].seq if points else -1
    reset = not 0 <= after_seq <= last_seq
    new = points if reset else [p for p in points if p.seq > after_seq]
    num_gpus = len(gpus.gpus)
    body = {
        "series_id": series_id,
        "interval_s": interval_s,
        "window_s": window_s,
        "last_seq": last_seq,
        "reset": reset,
        "series": columns(new),
        "summaries": summaries(points, num_gpus, interval_s),
        "current": current(points[-1] if points else None, stats),
        "kv_cache_usage": None if stats is None else stats.kv_cache_usage,
        "gpus": [row.to_json() for row in gpu_rows(gpus, claims)],
        "gpu_note": gpu_note(gpus, engine_device),
    }
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
