"""CUDA graphs captured while the engine is idle (EngineConfig.capture_graphs_when_idle, as the
server's start builds its engine): steps before a graph is captured run eagerly, steps after
replay it, and the tokens are those of an engine that captured everything at build. A capture
after replays leaves the KV cache as it was: its warm-up runs over padding rows, not over the
slots a replay left in the static buffers, which belong to finished requests the prefix cache
may still serve.

A random float32 Llama-shaped model (tokens compared exactly: float32 rounding is far below any
gap between logits) with a step budget of 300 tokens: prompt graphs of 128 and 256 tokens, a
decode ladder up to 16 rows and greedy graphs up to 8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.random_llama import VOCAB_SIZE, llama_shape, random_llama

pytestmark = pytest.mark.gpu

# The prompt sizes 256 and 128, the decode ladder 16, 8, 4, 2, 1, the greedy 16, 8, 4, 2, 1.
_NUM_GRAPHS = 2 + 5 + 5


@pytest.fixture(scope="module")
def model():
    return random_llama(llama_shape(), torch.float32)


def _engine(model, *, when_idle: bool) -> Engine:
    config = EngineConfig(
        model_dir=Path("random-model"),
        device="cuda",
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=300,
        num_kv_blocks=256,
        async_scheduling=True,
        capture_graphs_when_idle=when_idle,
    )
    return Engine.build(config, model, tokenizer=None)


def _rounds() -> list[list[tuple[list[int], SamplingParams]]]:
    """One round of requests per graph and one more: prompts of 3 to 280 tokens, each round's
    first one starting with the previous round's first 64 tokens (a prefix-cache hit), decoding
    greedily (batches of 1 to 3 rows) and, in every other round, one request sampling (the
    plain graphs and the sampler)."""
    g = torch.Generator().manual_seed(3)
    shapes = [[40, 130, 3], [280], [90, 200], [17], [120, 5, 60], [250, 8]]
    rounds = []
    first: list[int] = []
    for r in range(_NUM_GRAPHS + 1):
        lengths = shapes[r % len(shapes)]
        prompts = [torch.randint(0, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]
        prompts[0] = first[:64] + prompts[0]
        first = prompts[0]
        params = [SamplingParams(temperature=0.0, max_tokens=6 + r, ignore_eos=True)] * len(prompts)
        if r % 2:
            params[-1] = SamplingParams(temperature=0.8, seed=r, max_tokens=5, ignore_eos=True)
        rounds.append(list(zip(prompts, params, strict=True)))
    return rounds


def _run_round(engine: Engine, name: str, requests) -> dict[str, list[int]]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"{name}-{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
    return tokens


def test_graphs_captured_between_requests_give_the_tokens_of_graphs_captured_at_build(
    model,
) -> None:
    reference = _engine(model, when_idle=False)
    assert reference.num_pending_graphs == 0
    expected: dict[str, list[int]] = {}
    for r, requests in enumerate(_rounds()):
        expected |= _run_round(reference, f"round{r}", requests)
    del reference

    engine = _engine(model, when_idle=True)
    runner = engine.runner
    assert engine.num_pending_graphs == _NUM_GRAPHS
    assert engine.stats().num_pending_graphs == _NUM_GRAPHS
    assert runner.graphs is not None and runner.graphs.sizes == []
    assert runner.prompt_graphs is not None and runner.prompt_graphs.sizes == []
    got: dict[str, list[int]] = {}
    for r, requests in enumerate(_rounds()):
        got |= _run_round(engine, f"round{r}", requests)
        if not engine.num_pending_graphs:
            break
        caches = [cache.clone() for cache in runner.kv_caches]
        engine.capture_pending_graph()
        # Nothing a finished request left in the cache was written by the capture's warm-up.
        for before, after in zip(caches, runner.kv_caches, strict=True):
            assert torch.equal(before, after)
    assert engine.num_pending_graphs == 0
    assert runner.prompt_graphs.sizes == [128, 256]
    assert runner.graphs.sizes == [1, 2, 4, 8, 16]
    assert runner.graphs.greedy_sizes == [1, 2, 4, 8, 16]
    assert got == expected


def test_a_capture_waits_for_the_step_still_in_flight(model) -> None:
    """Under asynchronous scheduling a request that stops on a token runs one step more before
    its stop is seen, which may still be in flight when the engine goes idle: the capture
    processes it first (nothing of it is delivered)."""
    engine = _engine(model, when_idle=True)
    prompt = list(range(1, 40))
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    tokens = _run_round(engine, "first", [(prompt, greedy)])["first-0"]
    stop = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=(tokens[1],))
    again = _run_round(engine, "again", [(prompt, stop)])["again-0"]
    assert again == tokens[: tokens.index(tokens[1]) + 1]  # up to the stop token
    assert engine._in_flight is not None  # the step launched before the stop was seen
    engine.capture_pending_graph()
    assert engine._in_flight is None
    assert engine.num_pending_graphs == _NUM_GRAPHS - 1


def test_graphs_captured_between_steps_of_running_requests_change_no_token(model) -> None:
    """Under load the server captures between two steps (AsyncEngine, every
    BUSY_CAPTURE_INTERVAL_S): the step in flight is processed first, its outputs returned, and
    the running requests go on through the graphs captured so far with the tokens of an engine
    that captured everything at build."""
    requests = [r for round_ in _rounds()[:6] for r in round_]
    expected = _run_round(_engine(model, when_idle=False), "all", requests)
    engine = _engine(model, when_idle=True)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"all-{i}", prompt, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        outputs = engine.step()
        if engine.num_pending_graphs:
            outputs += engine.capture_pending_graph()
        for out in outputs:
            got.setdefault(out.request_id, []).extend(out.token_ids)
    assert engine.num_pending_graphs == 0, "a capture after every step: all in before the end"
    assert got == expected
