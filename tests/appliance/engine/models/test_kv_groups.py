"""Two KV groups (issue 21) end to end: the engine keeps the windowed layers' pages of Gemma 3,
gpt-oss and Gemma 4 in a pool of their own, which gives blocks back as they leave the window,
and still equals transformers.

Each engine runs a 100-token prompt (four windows of 24) in 32-token chunks, so chunks cross the
window edge, then greedy decode; then two prompts sharing 48 tokens, the second hitting the
prefix cache. Every sampled token's log-probability and its top 5 are compared with
transformers' full forward; the window group's blocks in use are recorded after every step.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.models.loader import load_model
from appliance.engine.outputs import TokenLogprob
from appliance.engine.sampling_params import SamplingParams

from .conftest import WINDOW
from .test_architectures import _hf_greedy, _hf_logits, _prompts

ATOL = 1e-4
BLOCK = 8
CHUNK = 32
NUM_NEW = 6
NUM_TOP = 5
FULL_BLOCKS = 40


def _engine(model_dir, **settings) -> Engine:
    config = EngineConfig(
        model_dir=model_dir,
        num_kv_blocks=FULL_BLOCKS,
        block_size=BLOCK,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=2,
        **settings,
    )
    return Engine.build(config, load_model(model_dir), None)


def _run(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """Each prompt after the one before finished; its tokens and log-probabilities, and the
    blocks in use in each group after every step."""
    outputs, in_use = [], []
    full, window = engine.block_manager, engine.block_manager.window_group
    assert window is not None
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        tokens: list[int] = []
        logprobs: list[TokenLogprob] = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.token_ids
                logprobs += out.logprobs or []
            in_use.append(
                (full.num_blocks - full.num_free_blocks, window.num_blocks - window.num_free_blocks)
            )
        outputs.append((tokens, logprobs))
    return outputs, in_use


def _assert_matches_transformers(hf_model, prompt, tokens, logprobs, what) -> None:
    assert tokens == _hf_greedy(hf_model, prompt, NUM_NEW), f"{what}: greedy output diverged"
    reference = _hf_logits(hf_model, prompt + tokens[:-1]).log_softmax(-1)
    for step, logprob in enumerate(logprobs):
        row = reference[len(prompt) - 1 + step]
        assert abs(logprob.logprob - row[logprob.token_id].item()) <= ATOL, what
        top_ids = [token_id for token_id, _ in logprob.top]
        assert top_ids == row.topk(NUM_TOP).indices.tolist(), f"{what}: top {step}"
        ours = torch.tensor([value for _, value in logprob.top])
        diff = (ours - row[top_ids]).abs().max().item()
        assert diff <= ATOL, f"{what}: step {step}: max |log-prob difference| {diff:.2e}"


@pytest.mark.parametrize("name", ["gemma3", "gpt-oss", "gemma4"])
def test_window_group_holds_a_window_while_outputs_match_transformers(tiny_checkpoints, name):
    model_dir, hf_model = tiny_checkpoints(name)
    engine = _engine(model_dir)
    window = engine.block_manager.window_group
    assert window is not None and window.kv_window == WINDOW, f"{name}: two KV groups"
    shared = _prompts((48,), seed=3)[0]
    [long] = _prompts((100,), seed=9)
    prompts = [long, shared + _prompts((30,), seed=5)[0], shared + _prompts((9,), seed=6)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=NUM_TOP)
    outputs, in_use = _run(engine, prompts, params)

    for prompt, (tokens, logprobs) in zip(prompts, outputs, strict=True):
        _assert_matches_transformers(hf_model, prompt, tokens, logprobs, name)
    assert engine.stats().num_prefix_cache_hits == 48, f"{name}: the shared prefix is reused"
    # One sequence at a time: a chunk's first query sees W - 1 keys back, so the window group
    # holds at most the blocks of W - 1 + CHUNK positions (one more where they straddle);
    # the full group holds every block of the long prompt and more.
    most_window = max(w for _, w in in_use)
    assert most_window <= -(-(WINDOW - 1 + CHUNK) // BLOCK) + 1, f"{name}: {in_use}"
    assert max(f for f, _ in in_use) >= 100 // BLOCK > most_window
    assert engine.stats().window_kv_cache_usage == 0.0 and engine.block_manager.usage == 0.0


def test_decode_bursts_and_asynchronous_steps_fill_the_window_group_too(tiny_checkpoints):
    """Several decode steps per scheduling (their slots computed on the host for both groups)
    and steps prepared while the one before runs: still transformers' greedy output."""
    model_dir, hf_model = tiny_checkpoints("gemma3")
    engine = _engine(model_dir, max_decode_burst=4, async_scheduling=True)
    prompts = _prompts((70, 33), seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    completions = engine.generate(prompts, params)
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == _hf_greedy(hf_model, prompt, 12)


def test_the_triton_kernels_read_no_window_block_outside_the_window(tiny_checkpoints):
    """The GPU path's attention kernels (Triton's interpreter here) on the window group's
    tables: every window-pool block no sequence holds (released ones, the placeholders of a
    prefix hit) is NaN before each step, and the outputs still equal transformers'. A decode
    beside a prefill chunk runs both kernels in one step."""
    import kernels.reference
    import kernels.triton_ops

    model_dir, hf_model = tiny_checkpoints("gemma3")
    reference = {n: getattr(kernels.reference, n) for n in dir(kernels.reference) if n[0] != "_"}
    ops = reference | {
        "write_kv_cache": kernels.triton_ops.write_kv_cache,
        "rotary_write_kv": kernels.triton_ops.rotary_write_kv,
        "paged_attention": kernels.triton_ops.paged_attention,
    }
    # The reference ops with the Triton kernels that read the block tables (interpreting
    # every projection too would take minutes).
    model = load_model(model_dir, ops=SimpleNamespace(**ops))
    config = EngineConfig(
        model_dir=model_dir,
        num_kv_blocks=16,
        block_size=16,  # the kernels' smallest
        max_num_batched_tokens=64,
        max_num_seqs=2,
    )
    engine = Engine.build(config, model, None)
    window = engine.block_manager.window_group
    assert window is not None
    window_caches = [
        cache
        for index, cache in zip(model.config.kv_layers, engine.runner.kv_caches, strict=True)
        if index in model.config.window_group
    ]
    # 64 shared tokens: the hit's first query, at 64, sees 41 ..= 64, so window blocks 0 and 1
    # are placeholders.
    shared = _prompts((64,), seed=3)[0]
    prompts = [shared + _prompts((12,), seed=5)[0], shared + _prompts((9,), seed=6)[0]]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    tokens: dict[str, list[int]] = {"r0": [], "r1": []}
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
        # The first runs until it decodes; its decode then runs beside the second's chunk.
        while engine.has_unfinished() and (i == 1 or not tokens["r0"]):
            unheld = [b for b in range(window.num_blocks) if window.ref_count(b) == 0]
            for cache in window_caches:
                cache[:, unheld] = float("nan")
            for out in engine.step():
                tokens[out.request_id] += out.token_ids
    assert engine.stats().num_prefix_cache_hits == 64
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == _hf_greedy(hf_model, prompt, 2), f"prompt {i}"
