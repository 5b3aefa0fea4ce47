"""Every family beyond Llama's equals transformers on tiny random checkpoints, windows included.

Each checkpoint is built and saved by transformers' own classes (conftest.FAMILY_VARIANTS),
loaded by our normal loader, and driven as the engine drives it (paged KV cache, flat varlen
batches). Prompts are longer than the 24-token windows, chunks cross the window edge, and the
greedy run goes through the real Scheduler and ModelRunner with chunked prefill and a
prefix-cache hit. The reference runs each sequence alone, unpadded, with no cache.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from appliance.engine.block_manager import BlockManager
from appliance.engine.errors import ModelLoadError
from appliance.engine.kv_cache import KVCacheSpec, KVPools
from appliance.engine.model_runner import ModelRunner
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import load_model
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import Scheduler, SchedulerConfig
from appliance.engine.sequence import RequestId, Sequence, SequenceStatus

from .conftest import FAMILY_VARIANTS, WINDOW
from .test_architectures import BLOCK_SIZE, PagedBatch, _hf_greedy, _hf_logits, _prompts

ATOL = 1e-4
SEQ_LENS = (100, 45, 7)  # 45 = 2 blocks + 13; all but the last longer than the window


@pytest.fixture(scope="module", params=sorted(FAMILY_VARIANTS))
def family(request, tiny_checkpoints):
    """(name, our model, transformers' model, prompts, transformers' logits per prompt)."""
    model_dir, hf_model = tiny_checkpoints(request.param)
    prompts = _prompts(SEQ_LENS)
    reference = [_hf_logits(hf_model, p) for p in prompts]
    return request.param, load_model(model_dir), hf_model, prompts, reference


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    diff = (ours - theirs).abs().max().item()
    assert diff <= ATOL, f"{what}: max |logit difference| {diff:.2e} > {ATOL}"


def _log_probs(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().log_softmax(-1)


def test_prompt_log_probabilities_match_transformers_past_the_window(family):
    name, model, _, prompts, reference = family
    logits = PagedBatch(model, prompts).step([(i, 0, len(p)) for i, p in enumerate(prompts)])
    for i, (ours, theirs) in enumerate(zip(logits, reference, strict=True)):
        _assert_close(_log_probs(ours), _log_probs(theirs), f"{name}: prompt {i}")


def test_chunks_across_the_window_edge_then_decode_match_transformers(family):
    name, model, _, prompts, reference = family
    batch = PagedBatch(model, prompts)
    # Chunks end at 20 (inside the first window), 45 and 50 (past it) and 95, beside each other
    # in one batch; then five decode steps.
    first = batch.step([(0, 0, 20), (1, 0, 20)])
    second = batch.step([(1, 20, 45), (0, 20, 50)])
    [third] = batch.step([(0, 50, 95)])
    _assert_close(torch.cat([first[0], second[1], third]), reference[0][:95], f"{name}: chunks")
    _assert_close(torch.cat([first[1], second[0]]), reference[1], f"{name}: beside chunks")
    for step in range(5):
        pos = 95 + step
        [ours] = batch.step([(0, pos, pos + 1)])
        _assert_close(ours[0], reference[0][pos], f"{name}: decode at {pos}")


def test_greedy_with_chunked_prefill_and_a_prefix_cache_hit_matches_transformers(
    tiny_checkpoints,
):
    """The real Scheduler and ModelRunner, a 32-token budget (chunks cross the window edge),
    and two prompts sharing 48 tokens (two windows) so the second hits the prefix cache."""
    for name in ("gemma3", "mistral-window", "mixtral-window", "qwen3-moe", "gpt-oss", "gemma4"):
        model_dir, hf_model = tiny_checkpoints(name)
        shared = _prompts((48,), seed=3)[0]
        prompts = [shared + _prompts((30,), seed=5)[0], shared + _prompts((9,), seed=6)[0]]
        seqs, scheduler = _run_greedy(load_model(model_dir), prompts, num_new_tokens=8)
        assert scheduler.num_prefix_hit_tokens == 48, f"{name}: the prefix should be reused"
        for prompt, seq in zip(prompts, seqs, strict=True):
            assert seq.output_token_ids == _hf_greedy(hf_model, prompt, 8), (
                f"{name}: greedy output for a prompt of {len(prompt)} tokens diverged"
            )


def _run_greedy(model, prompts: list[list[int]], num_new_tokens: int):
    spec = KVCacheSpec.for_model(model.config, BLOCK_SIZE, torch.float32)
    runner = ModelRunner(model, BLOCK_SIZE, "cpu", max_model_len=512)
    runner.set_kv_caches(spec.allocate(KVPools(32), "cpu"))
    scheduler = Scheduler(
        SchedulerConfig(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=32),
        BlockManager(32, BLOCK_SIZE),
    )
    params = SamplingParams(temperature=0.0, max_tokens=num_new_tokens, ignore_eos=True)
    seqs = [
        Sequence(request_id=RequestId(f"r{i}"), token_ids=list(p), params=params, arrival=i)
        for i, p in enumerate(prompts)
    ]
    for seq in seqs:
        # One at a time, so the second finds the first's blocks published.
        scheduler.add(seq)
        while seq.status is not SequenceStatus.FINISHED_LENGTH:
            chunks = scheduler.schedule().chunks
            for chunk, result in zip(chunks, runner.execute(chunks, [None]), strict=True):
                if result.token_ids:
                    chunk.seq.append_token(*result.token_ids)
                    if chunk.seq.num_output_tokens == num_new_tokens:
                        scheduler.finish(chunk.seq, SequenceStatus.FINISHED_LENGTH)
    return seqs, scheduler


def test_engine_serves_a_prompt_four_windows_long_in_a_pool_too_small_to_keep_it_all(
    tiny_checkpoints,
):
    """Issue 21's Mistral: a prompt longer than the window was refused (the window was taken as
    the context). Six 16-token blocks hold 96 tokens; the sequence reaches 110, so it fits only
    because blocks no window reaches are given back as it goes."""
    from appliance.engine.engine import Engine
    from appliance.engine.engine_config import EngineConfig

    model_dir, hf_model = tiny_checkpoints("mistral-window")
    settings = EngineConfig(
        model_dir=model_dir, num_kv_blocks=6, block_size=16, max_num_batched_tokens=32
    )
    engine = Engine.build(settings, load_model(model_dir), None)
    assert engine.max_model_len == 512
    [prompt] = _prompts((100,), seed=9)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    [completion] = engine.generate([prompt], params)
    assert completion.token_ids == _hf_greedy(hf_model, prompt, 10)
    assert engine.block_manager.num_free_blocks == 6


@pytest.mark.parametrize("name", ["gemma3", "mistral-window"])
def test_comparison_would_fail_if_the_windows_were_ignored(tiny_checkpoints, name):
    model_dir, hf_model = tiny_checkpoints(name)
    model = load_model(model_dir)
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    [prompt] = _prompts((100,))
    ours = PagedBatch(model, [prompt]).step([(0, 0, 100)])[0]
    assert (ours - _hf_logits(hf_model, prompt)).abs().max() > 1000 * ATOL


def test_gemma3_config_maps_local_and_global_layers(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("gemma3")
    config = ModelConfig.from_model_dir(model_dir)
    assert config.layer_windows == (WINDOW, None, WINDOW)
    assert config.local_rope is not None and config.local_rope.theta == 10_000.0
    assert config.rope.theta == 1_000_000.0
    assert config.max_model_len == 512, "the context is the position limit, not the window"
    assert config.kv_window is None, "global layers see every block"


def test_a_multimodal_gemma3_checkpoint_loads_its_text_model_and_skips_the_vision_tower(
    tiny_checkpoints, caplog
):
    model_dir, _ = tiny_checkpoints("gemma3-multimodal")
    with caplog.at_level(logging.INFO, logger="appliance.engine.models.loader"):
        load_model(model_dir)
    assert "vision tower" in caplog.text and "image inputs are refused" in caplog.text


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"hidden_activation": "relu"}, "hidden_activation"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
         "chunked_attention"),
        ({"layer_types": ["full_attention"]}, "layer_types"),
    ],
)  # fmt: skip
def test_an_unsupported_gemma3_setting_is_refused_by_name(tiny_checkpoints, changes, named):
    model_dir, _ = tiny_checkpoints("gemma3")
    raw = {**json.loads((model_dir / "config.json").read_text()), **changes}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict(raw)
