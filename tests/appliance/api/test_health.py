"""Liveness, readiness and the Prometheus metrics of a running server."""

from __future__ import annotations

from appliance.auth.roles import Role
from tests.appliance.api.conftest import MODEL_NAME, RunningServer

VLLM_METRICS = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
]


def test_ready_server_is_live_and_healthy(server: RunningServer) -> None:
    with server.http(role=None) as http:  # probes carry no token
        assert http.get("/live").json() == {"status": "alive"}
        response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ready"}


def test_metrics_use_vllm_names_and_count_tokens(server: RunningServer) -> None:
    tokenizer = server.engine.tokenizer
    prompt = "A long shared preamble about the weather in the mountains, " * 4
    num_prompt = len(tokenizer.encode(prompt))
    before = {
        name: server.metric(name)
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                     "vllm:time_to_first_token_seconds_count", "vllm:prefix_cache_hits_total",
                     "vllm:request_queue_time_seconds_count",
                     "vllm:request_prefill_time_seconds_count",
                     "vllm:request_decode_time_seconds_count",
                     "vllm:request_prefill_time_seconds_sum",
                     "vllm:time_to_first_token_seconds_sum")
    }  # fmt: skip
    client = server.client()
    for _ in range(2):  # the second run finds the prompt's full blocks cached
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=5, extra_body={"ignore_eos": True}
        )
    with server.http(Role.ADMIN) as http:
        response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    for name in VLLM_METRICS:
        assert f"\n{name}{{" in response.text, name
    delta = {name: server.metric(name) - value for name, value in before.items()}
    assert delta["vllm:prompt_tokens_total"] == 2 * num_prompt
    assert delta["vllm:generation_tokens_total"] == 2 * 5
    assert delta["vllm:time_to_first_token_seconds_count"] == 2
    # The engine's phases of both: queued, prefill to the first token, decode; the engine's
    # part of TTFT within the client's.
    for phase in ("queue", "prefill", "decode"):
        assert delta[f"vllm:request_{phase}_time_seconds_count"] == 2, phase
    assert delta["vllm:request_prefill_time_seconds_sum"] > 0
    assert (
        delta["vllm:request_prefill_time_seconds_sum"]
        < (delta["vllm:time_to_first_token_seconds_sum"])
    )
    assert delta["vllm:prefix_cache_hits_total"] >= num_prompt // 16 * 16


def test_running_stream_shows_in_the_engine_gauges(server: RunningServer) -> None:
    stream = server.client().completions.create(
        model=MODEL_NAME, prompt="Hello", max_tokens=300, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    next(iter(stream))
    assert server.metric("vllm:num_requests_running") == 1
    assert server.metric("vllm:kv_cache_usage_perc") > 0
    stream.close()
