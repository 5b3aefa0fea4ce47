"""bench/server_load.py's rule for the highest rate the server sustains (issue 17's W3: TTFT p99
≤ 1 s and keeping up with the arrivals), and its command line: FP8 projections and KV cache
reach the server's settings, and flags that cannot apply are refused."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from appliance.config import load_settings
from bench.server_load import (
    UniquePrompts,
    highest_sustained_rate,
    histogram_ms,
    keep_up_ratio,
    parse_args,
    pending_graphs,
    sustained_summary,
    why_not_sustained,
    write_server_files,
)


def poisson_arrivals(rate: float, duration_s: float, seed: int = 0) -> list[float]:
    arrivals, now, draw = [], 0.0, random.Random(seed)
    while (now := now + draw.expovariate(rate)) < duration_s:
        arrivals.append(now)
    return arrivals


def test_a_server_that_keeps_up_finishes_as_fast_as_requests_arrive():
    arrivals = poisson_arrivals(20, 20)
    assert keep_up_ratio(arrivals, [t + 5.0 for t in arrivals]) == pytest.approx(1.0)
    # Latencies that vary (decode at 19 ± 2 ms a token, 256 tokens) stay well above the bound.
    draw = random.Random(1)
    ends = [t + 256 * draw.gauss(0.019, 0.002) for t in arrivals]
    assert keep_up_ratio(arrivals, ends) == pytest.approx(1.0, abs=0.05)


def test_a_server_serving_fewer_than_arrive_keeps_up_at_its_share_of_the_rate():
    # One queue served at 15 req/s while 20 req/s arrive: the queue grows the whole run.
    arrivals = poisson_arrivals(20, 20)
    ends: list[float] = []
    for sent in arrivals:
        ends.append(max(sent, ends[-1] if ends else 0.0) + 1 / 15)
    assert keep_up_ratio(arrivals, ends) == pytest.approx(0.75, abs=0.05)


def test_keep_up_needs_ten_requests_and_one_end_per_request():
    assert keep_up_ratio([0.1 * i for i in range(9)], [1 + 0.1 * i for i in range(9)]) is None
    assert keep_up_ratio([0.1 * i for i in range(10)], [1 + 0.1 * i for i in range(10)]) == (
        pytest.approx(1.0)
    )
    with pytest.raises(ValueError, match="one end time per request"):
        keep_up_ratio([0.0, 1.0], [1.0])


def run(rate: float, ttft_p99_ms: float | None, keep_up: float | None) -> dict:
    return {"rate": rate, "ttft_p99_ms": ttft_p99_ms, "keep_up": keep_up}


def test_sustained_means_ttft_p99_at_most_1_s_and_keeping_up_at_0_9():
    assert why_not_sustained(run(20, 1000.0, 0.9)) is None  # both bounds included
    assert why_not_sustained(run(20, 1001.0, 0.99)) == "TTFT p99 1,001 ms"
    assert why_not_sustained(run(20, 300.0, 0.89)) == "finished at 0.89× the rate they arrived"
    assert why_not_sustained(run(20, 300.0, None)) == "too few requests to tell whether it kept up"
    assert why_not_sustained(run(0, None, None)) == "no requests"
    assert why_not_sustained(run(32, 4000.0, 0.8)) == (
        "TTFT p99 4,000 ms, finished at 0.80× the rate they arrived"
    )


def test_highest_sustained_rate_is_the_highest_whose_every_run_passed():
    rows = [
        run(20, 250.0, 0.99),
        run(24, 900.0, 0.95),
        run(28, 1500.0, 0.97),  # TTFT
        run(32, 400.0, 0.80),  # fell behind with a low TTFT: a run too short for its queue
    ]
    assert highest_sustained_rate(rows) == 24
    # A rate counts only if each of its runs (--repeat, --console) passed.
    assert highest_sustained_rate([*rows, run(24, 1200.0, 0.95)]) == 20
    assert highest_sustained_rate([run(0, None, None), run(40, 9000.0, 0.6)]) is None


def test_summary_gives_each_run_and_the_highest_rate_or_none():
    summary = sustained_summary([run(20, 250.0, 0.99), run(28, 1500.0, 0.97)])
    assert "20 req/s (0.99): sustained" in summary
    assert "28 req/s (0.97): not sustained: TTFT p99 1,500 ms" in summary
    assert summary.endswith("highest sustained rate: 20 req/s")
    assert sustained_summary([run(40, 9000.0, 0.6)]).endswith(
        "highest sustained rate: none of these"
    )


def test_fp8_projections_and_kv_cache_reach_the_servers_settings(tmp_path: Path):
    args = parse_args(["--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3"])
    config, model, _ = write_server_files(tmp_path, args)
    engine = load_settings(config).engine
    assert (model, engine.quantization, engine.kv_cache_dtype) == (
        "random-llama-3.1-8b",
        "fp8",
        "fp8_e4m3",
    )
    (tmp_path / "default").mkdir()
    config, _, _ = write_server_files(tmp_path / "default", parse_args([]))
    engine = load_settings(config).engine
    assert (engine.quantization, engine.kv_cache_dtype) == (None, "auto")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--stub-model", "--quantization", "fp8"], "the stub model has no projections"),
        (["--model", "DIR", "--profile-engine"], "a model this script serves itself"),
    ],
)
def test_flags_that_cannot_apply_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def test_profiling_applies_to_the_models_this_script_serves():
    assert parse_args(["--profile-engine"]).profile_engine
    args = parse_args(["--stub-model", "--profile-engine", "--kv-cache-dtype", "fp8_e4m3"])
    assert (args.device, args.kv_cache_dtype) == ("cpu", "fp8_e4m3")


def test_a_histograms_mean_and_p99_bucket_come_from_the_difference_of_two_scrapes():
    """Between the scrapes, 100 observations summing to 5 s: 98 in (0.02, 0.04], 2 in
    (0.04, 0.06]: mean 50 ms, p99 in the bucket that ends at 60 ms. What was there before the
    run does not count; a key that saw nothing gives None."""
    before = {"q": {0.02: 10.0, 0.04: 10.0, 0.06: 10.0, float("inf"): 10.0, -1.0: 1.0}}
    after = {"q": {0.02: 10.0, 0.04: 108.0, 0.06: 110.0, float("inf"): 110.0, -1.0: 6.0}}
    assert histogram_ms(before, after, "q") == pytest.approx((50.0, 60.0))
    assert histogram_ms(before, before, "q") == (None, None)
    assert histogram_ms(before, after, "absent") == (None, None)


def test_the_pending_graphs_gauge_is_read_from_a_metrics_text() -> None:
    text = (
        "# HELP inferno:cuda_graphs_pending CUDA graphs still to capture\n"
        "# TYPE inferno:cuda_graphs_pending gauge\n"
        'inferno:cuda_graphs_pending{model_name="m"} 7.0\n'
        'vllm:num_requests_running{model_name="m"} 0.0\n'
    )
    assert pending_graphs(text) == 7.0
    assert pending_graphs(text.replace(" 7.0", " 0.0")) == 0
    assert pending_graphs("vllm:num_requests_running 0.0\n") is None


def test_every_prompt_is_its_own_from_its_first_cache_block_on():
    """W3's requests are distinct users': no two prompts share their first block (16 tokens),
    so none is a prefix-cache hit, however many pass through a pool of two; past the numbered
    first tokens they are the pool's random ids."""
    prompts = UniquePrompts(vocab_size=50, prompt_tokens=40, seed=3, pool=2)
    served = [prompts.next() for _ in range(300)]
    assert len({tuple(p[:16]) for p in served}) == 300
    assert all(len(p) == 40 and all(0 <= t < 50 for t in p) for p in served)
    assert served[0][3:] == served[2][3:] != served[1][3:]
    assert served[299][:3] == [299 % 50, 299 // 50, 0]


def test_the_gpu_busy_fraction_is_the_mean_of_nvmls_utilization_over_the_window():
    import math
    import time
    import types

    from bench.gpu_busy import BusySampler

    readings = iter([100, 50, 0, 30] + [100] * 1000)
    calls = []
    fake = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetHandleByIndex=lambda index: calls.append(index) or "gpu",
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=next(readings)),
    )
    assert math.isnan(BusySampler(0, nvml=fake).fraction)  # no sample yet
    calls.clear()
    with BusySampler(3, nvml=fake) as busy:
        while len(busy._samples) < 4:
            time.sleep(0.01)
    assert calls == ["init", 3]
    assert busy._samples[:4] == [100, 50, 0, 30]
    assert busy.fraction == sum(busy._samples) / len(busy._samples) / 100
