"""Prometheus metrics under vLLM's names, so existing vLLM dashboards and alerts work unchanged.

Engine state (running and waiting requests, KV-cache usage, preemptions, prefix-cache queries
and hits) is read from the engine at scrape time; request latencies (time to first token, time
per output token, end to end, all as the client sees them: from arrival at the server), the
engine's phases of each request (queued, prefill to the first token, decode: the parts of TTFT
and the rest the engine accounts for) and token counts are recorded as each engine request ends.
`inferno:audit_append_seconds` (Inferno's own) is how long requests wait for their audit
entries, `inferno:limited_requests` counts the requests a per-caller limit refused, by limit,
`inferno:tool_requests` the admitted requests that offered the model tools, by endpoint,
`inferno:structured_output_requests` those whose output follows a grammar, by endpoint and kind,
and `inferno:grammar_compile_seconds` how long the engine took to compile grammars it had not
cached; `inferno:recurrent_state_usage_perc`, for a hybrid model only, the fraction of its
linear layers' recurrent-state slots in use (beside the KV-cache usage of its attention layers).
Each app has its own registry: nothing global. The console's time series reads the same request
counters (`ServerMetrics.counters`): nothing else is counted per request.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from appliance.engine.async_engine import AsyncEngine
from appliance.engine.outputs import GRAMMAR_COMPILE_BUCKETS, EngineStats, RequestTimes

# vLLM's bucket boundaries, in seconds.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# Inferno's own: a durable append is an fsync or a database round trip (group commit).
_AUDIT_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1,
                  0.25, 0.5, 1.0, 2.5)  # fmt: skip


@dataclass(frozen=True, slots=True)
class HistogramCounts:
    """A histogram's cumulative bucket counts (`counts[i]` observations at most `bounds[i]`;
    the last bound is +inf, so the last count is all observations)."""

    bounds: tuple[float, ...]
    counts: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class ServingCounters:
    """The request counters since the server started, read at one moment: what the console's
    time series (appliance.console.series) takes differences of. Counted as each engine request
    ends, like the Prometheus metrics they are read from."""

    num_requests: float
    num_output_tokens: float
    ttft: HistogramCounts
    tpot: HistogramCounts


class ServerMetrics:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self._engine: AsyncEngine | None = None
        labels = ["model_name"]

        def per_model(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(
                name, documentation, labels, buckets=buckets, registry=self.registry
            ).labels(model_name)

        self._ttft = per_model(
            "vllm:time_to_first_token_seconds",
            "Time from a request's arrival to its first output token.",
            _TTFT_BUCKETS,
        )
        self._tpot = per_model(
            "vllm:time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first.",
            _TPOT_BUCKETS,
        )
        self._e2e = per_model(
            "vllm:e2e_request_latency_seconds",
            "Time from a request's arrival to its end.",
            _E2E_BUCKETS,
        )
        # The engine's phases of a request (vLLM's names; finer buckets for the first two,
        # whose tails are what TTFT's is made of).
        self._queue_time = per_model(
            "vllm:request_queue_time_seconds",
            "Time a request waited in the engine before it was first scheduled.",
            _TTFT_BUCKETS,
        )
        self._prefill_time = per_model(
            "vllm:request_prefill_time_seconds",
            "Time from a request's first scheduling to its first token, in the engine.",
            _TTFT_BUCKETS,
        )
        self._decode_time = per_model(
            "vllm:request_decode_time_seconds",
            "Time from a request's first token to its end, in the engine.",
            _E2E_BUCKETS,
        )
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of ended requests.", labels, registry=self.registry
        ).labels(model_name)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Output tokens of ended requests.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self._success = Counter(
            "vllm:request_success",
            "Requests that ended, by why they ended (stop, length, abort).",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._audit_append = Histogram(
            "inferno:audit_append_seconds",
            "Time a request waited for one of its audit entries to be stored, by entry action.",
            ["action"], buckets=_AUDIT_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self._limited = Counter(
            "inferno:limited_requests",
            "Requests refused 429 by a per-caller limit, by limit (appliance.api.limits).",
            ["limit"],
            registry=self.registry,
        )
        self._structured_requests = Counter(
            "inferno:structured_output_requests",
            "Admitted requests whose output follows a grammar, by endpoint and kind "
            "(forced tool calls are json_schema).",
            ["endpoint", "kind"], registry=self.registry,
        )  # fmt: skip
        self._tool_requests = Counter(
            "inferno:tool_requests",
            "Admitted requests that offered the model tools to call, by endpoint.",
            ["endpoint"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(self))

    def watch(self, engine: AsyncEngine) -> None:
        """Report this engine's state from now on."""
        self._engine = engine

    def engine_stats(self) -> EngineStats | None:
        """The watched engine's counts now (None before the model is loaded)."""
        return None if self._engine is None else self._engine.stats()

    def counters(self) -> ServingCounters:
        """The request counters now, read from the metrics themselves (nothing else is counted
        per request); a few dozen values."""
        requests = _histogram_counts(self._e2e)
        return ServingCounters(
            num_requests=requests.counts[-1],
            num_output_tokens=_counter_value(self._generation_tokens),
            ttft=_histogram_counts(self._ttft),
            tpot=_histogram_counts(self._tpot),
        )

    def observe_request(
        self,
        *,
        ttft_s: float | None,
        e2e_s: float,
        num_prompt_tokens: int,
        num_output_tokens: int,
        finish_reason: str | None,
        times: RequestTimes | None = None,
    ) -> None:
        """Record one engine request that ended; `ttft_s` is None if it produced no token,
        `times` (its phases in the engine) None if the engine gave none."""
        self._e2e.observe(e2e_s)
        if times is not None:
            self._queue_time.observe(times.queued_s)
            if times.prefill_s is not None:
                self._prefill_time.observe(times.prefill_s)
            if times.decode_s is not None:
                self._decode_time.observe(times.decode_s)
        if ttft_s is not None:
            self._ttft.observe(ttft_s)
            if num_output_tokens > 1:
                self._tpot.observe((e2e_s - ttft_s) / (num_output_tokens - 1))
        self._prompt_tokens.inc(num_prompt_tokens)
        self._generation_tokens.inc(num_output_tokens)
        if finish_reason is not None:
            self._success.labels(self.model_name, finish_reason).inc()

    def observe_audit_append(self, action: str, seconds: float) -> None:
        self._audit_append.labels(action).observe(seconds)

    def count_limited(self, limit: str) -> None:
        self._limited.labels(limit).inc()

    def count_tool_request(self, endpoint: str) -> None:
        self._tool_requests.labels(endpoint).inc()

    def count_structured_request(self, endpoint: str, kind: str) -> None:
        self._structured_requests.labels(endpoint, kind).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def engine_metrics(self) -> Iterator[Metric]:
        if self._engine is None:
            return
        stats = self._engine.stats()
        labels = [self.model_name]
        gauges = (
            ("vllm:num_requests_running", "Requests running on the engine.", stats.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means full.", stats.kv_cache_usage),
            (
                "inferno:cuda_graphs_pending",
                "CUDA graphs still to capture after start-up, which the engine does while "
                "idle (under load, one every half second): until then the steps they would "
                "replay run eagerly.",
                stats.num_pending_graphs,
            ),
        )
        if stats.window_kv_cache_usage is not None:
            gauges += (
                (
                    "inferno:window_kv_cache_usage_perc",
                    "KV-cache usage of the windowed layers' own pool (KV groups; "
                    "vllm:kv_cache_usage_perc is then the full layers'): 1 means full.",
                    stats.window_kv_cache_usage,
                ),
            )
        if stats.recurrent_state_usage is not None:
            gauges += (
                (
                    "inferno:recurrent_state_usage_perc",
                    "Recurrent-state slots (a hybrid model's linear layers) in use: 1 means "
                    "full. Per GPU: under tensor parallelism each GPU holds the same slots, of "
                    "its share of the heads.",
                    stats.recurrent_state_usage,
                ),
            )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["model_name"])
            gauge.add_metric(labels, value)
            yield gauge
        counters = (
            ("vllm:num_preemptions", "Preemptions by the scheduler.", stats.num_preemptions),
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.num_prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.num_prefix_cache_hits,
            ),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=["model_name"])
            counter.add_metric(labels, value)
            yield counter
        if stats.grammar_compile_counts:
            compiles = HistogramMetricFamily(
                "inferno:grammar_compile_seconds",
                "Time to compile a structured output's grammar (cache misses only).",
                labels=["model_name"],
            )
            bounds = [*map(str, GRAMMAR_COMPILE_BUCKETS), "+Inf"]
            buckets = list(zip(bounds, stats.grammar_compile_counts, strict=True))
            compiles.add_metric(labels, buckets, stats.grammar_compile_seconds)
            yield compiles


def _histogram_counts(histogram: Histogram) -> HistogramCounts:
    """A labelled histogram's cumulative buckets, through prometheus_client's public
    `collect()`."""
    bounds, counts = [], []
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                bounds.append(float(sample.labels["le"]))
                counts.append(sample.value)
    return HistogramCounts(tuple(bounds), tuple(counts))


def _counter_value(counter: Counter) -> float:
    return next(
        sample.value
        for metric in counter.collect()
        for sample in metric.samples
        if sample.name.endswith("_total")
    )


class _EngineCollector(Collector):
    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return self._metrics.engine_metrics()


async def _server_metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


Metrics = Annotated[ServerMetrics, Depends(_server_metrics)]

router = APIRouter()


@router.get("/metrics", include_in_schema=False)
async def metrics(server_metrics: Metrics) -> Response:
    return Response(server_metrics.render(), media_type=CONTENT_TYPE_LATEST)
