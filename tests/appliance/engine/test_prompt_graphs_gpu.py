"""Steps with prompts replayed from the prompt graphs' pieces (appliance.engine.prompt_graphs):
the same hidden states as the eager forward, the same tokens through the engine.

A random Llama-shaped model with the Triton kernels and a step budget of 300 tokens, so the
graphs of 128 and 256 tokens are captured and a step of 257 to 300 tokens replays in two pieces
or, when a sequence brings more than 256 tokens, runs eagerly. The requests make every kind of
step with a prompt: prompts alone, prompt chunks beside decode rows, a prefix-cached prompt's
remainder, steps padded to a size, a step in pieces and one past the largest size.
The pieces run the kernels the eager pass runs, but a projection's matmul over a padded token
count may pick another cuBLAS algorithm, so bf16 hidden states are compared within bf16's
rounding and the tokens on a float32 model, where that rounding is far below any gap between
logits.
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.model_runner import ModelRunner
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.random_llama import llama_shape, random_llama

pytestmark = pytest.mark.gpu

_SHAPE = llama_shape()
_BUDGET = 300


@pytest.fixture(scope="module")
def bf16_model():
    return random_llama(_SHAPE, torch.bfloat16)


def _engine(model, **settings) -> Engine:
    config = EngineConfig(
        model_dir=Path("random-model"),
        device="cuda",
        dtype=str(model.embed_tokens.weight.dtype).removeprefix("torch."),
        max_model_len=1024,
        max_num_seqs=16,
        max_num_batched_tokens=_BUDGET,
        num_kv_blocks=256,
        **settings,
    )
    return Engine.build(config, model, tokenizer=None)


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Prompts of 3 to 280 tokens (two of them sharing a 64-token prefix), decoding 2 to 24;
    the first three (273 tokens) make a step of two pieces."""
    g = torch.Generator().manual_seed(1)
    lengths = [140, 130, 3, 280, 90, 200, 17, 120]
    prompts = [torch.randint(0, _SHAPE["vocab_size"], (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[1][:64] + prompts[2])  # its first 64 tokens cached by then
    steps = [12, 24, 2, 6, 9, 15, 20, 4, 8]
    return [
        (p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for p, n in zip(prompts, steps, strict=True)
    ]


def _run(engine: Engine) -> dict[str, list[int]]:
    """Three requests at once, then one more admitted every second step."""
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(_requests()))
    steps = 0
    while engine.has_unfinished() or pending:
        if pending and (steps < 1 or steps % 2 == 0):
            for i, (prompt, params) in pending[: 3 if steps == 0 else 1]:
                engine.add_request(f"r{i}", prompt, params)
            pending = pending[3 if steps == 0 else 1 :]
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
    return tokens


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_each_step_replayed_in_pieces_gives_the_eager_forwards_hidden_states(
    bf16_model, monkeypatch, kv_cache_dtype
) -> None:
    engine = _engine(bf16_model, kv_cache_dtype=kv_cache_dtype, async_scheduling=True)
    runner = engine.runner
    graphs = runner.prompt_graphs
    assert graphs is not None and graphs.sizes == [128, 256]
    replayed: list[tuple[int, int]] = []  # (tokens, the size replayed), per piece
    num_pieces: list[int] = []
    eager_steps: list[int] = []
    run = graphs.run
    model = runner.model

    def checked(input_ids, positions, meta, pieces):
        hidden = run(input_ids, positions, meta, pieces).clone()
        for _, _, first, end in pieces:
            replayed.append((end - first, min(s for s in graphs.sizes if s >= end - first)))
        num_pieces.append(len(pieces))
        # The eager pass writes the same keys and values again, as the pieces computed them
        # (`forward`, the model's own: not counted below as a step run eagerly).
        eager = forward(input_ids, positions, runner.kv_caches, meta)
        torch.testing.assert_close(hidden, eager, atol=3e-2, rtol=3e-2)
        return hidden

    monkeypatch.setattr(graphs, "run", checked)
    forward = model.forward

    def counted(input_ids, *args, **kwargs):
        if input_ids.shape[0] > graphs.max_tokens:
            eager_steps.append(input_ids.shape[0])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(model, "forward", counted)
    tokens = _run(engine)
    assert [len(tokens[f"r{i}"]) for i in range(9)] == [p.max_tokens for _, p in _requests()]
    sizes = {size for _, size in replayed}
    assert sizes == {128, 256}, replayed
    assert any(n < size for n, size in replayed), "a step padded to its size"
    assert 2 in num_pieces, num_pieces
    assert eager_steps and all(_BUDGET >= n > 256 for n in eager_steps), eager_steps


def test_the_engine_gives_the_same_tokens_with_and_without_the_prompt_graphs(monkeypatch) -> None:
    model = random_llama(_SHAPE, torch.float32)
    engine = _engine(model, async_scheduling=True)
    assert engine.runner.prompt_graphs is not None
    with_graphs = _run(engine)
    monkeypatch.setattr(ModelRunner, "_prompt_graph_sizes", lambda self, tokens: [])
    engine = _engine(model, async_scheduling=True)
    assert engine.runner.prompt_graphs is None
    assert _run(engine) == with_graphs


def test_every_capture_begins_with_the_collector_off(bf16_model, monkeypatch) -> None:
    """A collection during a capture may destroy an unreachable engine's graph, which CUDA
    refuses while a stream captures, failing the capture (seen in this suite before the
    collector was paused: an earlier test's engine collected mid-capture)."""
    states: list[bool] = []
    begin = torch.cuda.CUDAGraph.capture_begin

    def recording(self, *args, **kwargs):
        states.append(gc.isenabled())
        return begin(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", recording)
    gc.enable()
    engine = _engine(bf16_model)
    assert engine.runner.prompt_graphs is not None and engine.runner.graphs is not None
    # The profile's captures, then every prompt piece and decode graph.
    assert len(states) > 2 * len(engine.runner.graphs.sizes) and not any(states)
    assert gc.isenabled()
