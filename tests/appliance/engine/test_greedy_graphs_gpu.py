"""Greedy decode steps replayed from the graphs that sample inside them (appliance.engine.
cuda_graphs, "Greedy sampling inside the graph") give the tokens the plain graphs give.

A random Llama-shaped model (bf16, Triton kernels): the same requests run once with the greedy
graphs and once with `ModelRunner._greedy_graph_fits` answering no, so every step takes the
plain path (the plain graph, then the LM head and the sampler outside it). Both paths run the
same kernels on the same inputs, so the tokens must be equal, not close. The requests make every
hand-over happen: a batch that shrinks as requests finish (graphs of 16, 8, 4, 2 and 1 rows), a
request admitted between decode steps (a prompt step reading tokens a greedy replay wrote, and
the greedy step after it reading a prompt step's), with and without asynchronous scheduling
(tokens the host does not have yet, read on the device).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.model_runner import ModelRunner
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.random_llama import llama_shape, random_llama

pytestmark = pytest.mark.gpu

_SHAPE = llama_shape(num_hidden_layers=2)


@pytest.fixture(scope="module")
def model():
    return random_llama(_SHAPE, torch.bfloat16)


def _engine(model, async_scheduling: bool, max_decode_burst: int = 1) -> Engine:
    settings = EngineConfig(
        model_dir=Path("random-model"),
        device="cuda",
        max_model_len=1024,
        max_num_seqs=16,
        num_kv_blocks=256,
        async_scheduling=async_scheduling,
        max_decode_burst=max_decode_burst,
    )
    return Engine.build(settings, model, tokenizer=None)


def _run(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    """The first twelve requests at once; the rest admitted one per step after the fourth."""
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(requests))
    for i, (prompt, params) in pending[:12]:
        engine.add_request(f"r{i}", prompt, params)
    later = pending[12:]
    steps = 0
    while engine.has_unfinished() or later:
        if steps >= 4 and later:
            i, (prompt, params) = later.pop(0)
            engine.add_request(f"r{i}", prompt, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    return tokens


def _requests(params: list[SamplingParams]) -> list[tuple[list[int], SamplingParams]]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 40, (len(params),), generator=g).tolist()
    return [
        (torch.randint(0, _SHAPE["vocab_size"], (n,), generator=g).tolist(), p)
        for n, p in zip(lengths, params, strict=True)
    ]


def _count_greedy_replays(engine: Engine, monkeypatch) -> list[int]:
    """The batch of every greedy graph replay `engine` makes from here on."""
    replays: list[int] = []
    run_greedy = engine.runner.graphs.run_greedy

    def counted(batch: int) -> torch.Tensor:
        replays.append(batch)
        return run_greedy(batch)

    monkeypatch.setattr(engine.runner.graphs, "run_greedy", counted)
    return replays


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("burst", [1, 4], ids=["steps", "bursts"])
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_graphs_give_the_plain_paths_tokens(
    model, monkeypatch, async_scheduling, burst
) -> None:
    """With bursts, a burst of greedy rows replays the greedy graph once a step, each replay
    reading the tokens the one before it wrote; the plain path runs the same burst through
    the plain graph, the LM head and the sampler."""
    # Twelve at once finishing at different steps (12 rows in the 16-row graph, then 8, 4, 2,
    # 1), then two admitted later.
    lengths = (3, 5, 7, 9, 9, 17, 17, 25, 25, 25, 33, 40, 12, 20)
    requests = _requests([_greedy(n) for n in lengths])
    engine = _engine(model, async_scheduling, burst)
    replays = _count_greedy_replays(engine, monkeypatch)
    launched_steps: list[int] = []
    launch_greedy = engine.runner._launch_greedy

    def counted_launch(chunks, num_steps, previous):
        launched_steps.append(num_steps)
        return launch_greedy(chunks, num_steps, previous)

    monkeypatch.setattr(engine.runner, "_launch_greedy", counted_launch)
    fast = _run(engine, requests)
    assert engine.runner.graphs.greedy_sizes == [1, 2, 4, 8, 16]
    # Every decode step took a greedy graph, batches from 12 rows down to 1.
    assert max(replays) == 12 and min(replays) == 1, replays
    assert sum(launched_steps) == len(replays)
    # Bursts as long as allowed, each a replay per step.
    assert max(launched_steps) == burst, launched_steps

    monkeypatch.setattr(ModelRunner, "_greedy_graph_fits", lambda self, chunks: False)
    plain = _run(_engine(model, async_scheduling, burst), requests)
    assert fast == plain
    assert [len(fast[f"r{i}"]) for i in range(len(requests))] == [p.max_tokens for _, p in requests]


def test_a_step_with_a_sampled_or_penalized_row_takes_the_plain_path(model, monkeypatch) -> None:
    engine = _engine(model, async_scheduling=True)
    replays = _count_greedy_replays(engine, monkeypatch)
    sampled = SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, seed=3)
    penalized = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.3
    )
    logprobs = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    for other in (sampled, penalized, logprobs):
        _run(engine, _requests([_greedy(6), other]))
        assert replays == [], other
    _run(engine, _requests([_greedy(6), _greedy(6)]))  # the same engine does take them
    assert replays
