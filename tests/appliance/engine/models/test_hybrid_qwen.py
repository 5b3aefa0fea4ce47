"""The hybrid Qwen (Qwen3.5 / Qwen3.6, dense and MoE) equals transformers on tiny random
checkpoints (conftest.HYBRID_VARIANTS: three Gated DeltaNet layers then a gated full-attention
one).

Each checkpoint is built and saved by transformers' own classes, loaded by our loader and driven
as the engine drives it: flat varlen batches, the paged KV cache for the attention layer and a
recurrent-state slot per sequence for the linear ones. The reference runs each sequence alone.

transformers runs a prompt through its chunked form of the delta rule
(`torch_chunk_gated_delta_rule`, a triangular solve per 64-token chunk), and a decode step
through the exact per-token recurrence (`torch_recurrent_gated_delta_rule`), which is what our
reference kernel computes. In float32 the chunked form strays from the recurrence on these
O(1) weights (up to 2e-4 in log-probability on the MoE's 17-token prompt, measured), so the
reference here runs the recurrence for prompts too (`exact_recurrence`): transformers' own code,
without the chunking's rounding. tests/kernels/test_recurrent_reference.py compares the ops with
both forms directly.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5_moe

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import load_model
from appliance.engine.models.recurrent_state import state_bytes_per_slot
from appliance.engine.sampling_params import SamplingParams

from .conftest import HYBRID_VARIANTS
from .test_architectures import PagedBatch, _hf_greedy, _hf_logits, _prompts

ATOL = 1e-4
SEQ_LENS = (40, 17, 3)  # several sequences of different lengths in one batch


@pytest.fixture(scope="module")
def exact_recurrence():
    """transformers' Qwen3.5 models with the per-token recurrence in place of the chunked form."""
    with pytest.MonkeyPatch.context() as patch:
        for module in (qwen3_5, qwen3_5_moe):
            recurrent = module.torch_recurrent_gated_delta_rule

            def unchunked(*args, chunk_size=64, _recurrent=recurrent, **kwargs):
                return _recurrent(*args, **kwargs)

            patch.setattr(module, "torch_chunk_gated_delta_rule", unchunked)
        yield


@pytest.fixture(scope="module", params=sorted(HYBRID_VARIANTS))
def hybrid(request, tiny_checkpoints, exact_recurrence):
    """(name, our model, prompts, transformers' logits per prompt)."""
    model_dir, hf_model = tiny_checkpoints(request.param)
    prompts = _prompts(SEQ_LENS)
    reference = [_hf_logits(hf_model, p) for p in prompts]
    return request.param, load_model(model_dir), prompts, reference


def _assert_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    diff = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item()
    assert diff <= ATOL, f"{what}: max |log-probability difference| {diff:.2e} > {ATOL}"


def test_prompt_log_probabilities_of_a_batch_match_transformers(hybrid):
    name, model, prompts, reference = hybrid
    logits = PagedBatch(model, prompts).step([(i, 0, len(p)) for i, p in enumerate(prompts)])
    for i, (ours, theirs) in enumerate(zip(logits, reference, strict=True)):
        _assert_close(ours, theirs, f"{name}: prompt {i}")
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1)), f"{name}: greedy tokens"


def test_chunked_prefill_carries_the_recurrent_state_then_decodes(hybrid):
    """Prompt 0 over three steps (chunks of 5, 20 and 14 tokens beside prompt 1's), then one
    decode step: every chunk after the first continues from the state its slot holds."""
    name, model, prompts, reference = hybrid
    batch = PagedBatch(model, prompts)
    first = batch.step([(0, 0, 5), (1, 0, 9)])
    second = batch.step([(1, 9, 17), (0, 5, 25)])
    [third] = batch.step([(0, 25, 39)])
    [decode] = batch.step([(0, 39, 40)])
    _assert_close(torch.cat([first[0], second[1], third, decode]), reference[0], f"{name}: chunks")
    _assert_close(torch.cat([first[1], second[0]]), reference[1], f"{name}: beside chunks")


def test_comparison_would_fail_without_the_carried_state(tiny_checkpoints, exact_recurrence):
    """Continuing a chunk from zeros instead of its slot's state changes the logits: the
    chunked test above really depends on the state being carried."""
    model_dir, hf_model = tiny_checkpoints("qwen3.5")
    [prompt] = _prompts((30,))
    batch = PagedBatch(load_model(model_dir), [prompt])
    batch.step([(0, 0, 10)])
    for state in batch.states:
        state.conv.zero_()
        state.delta.zero_()
    [rest] = batch.step([(0, 10, 30)])
    diff = (rest - _hf_logits(hf_model, prompt)[10:]).abs().max().item()
    assert diff > 100 * ATOL


def test_hybrid_config_maps_linear_and_full_attention_layers(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("qwen3.5-moe")
    config = ModelConfig.from_model_dir(model_dir)
    assert config.linear_attention is not None
    assert config.linear_attention.layers == (True, True, True, False)
    assert config.kv_layers == (3,)
    assert config.attention_output_gate and config.qk_norm
    assert config.rotary_dim == 4  # partial_rotary_factor 0.25 of 16
    assert config.moe is not None and config.moe.shared_expert_gated
    assert config.moe.moe_layers == (True,) * 4


def test_the_multimodal_checkpoint_loads_its_text_model_and_skips_the_vision_tower(
    tiny_checkpoints, caplog
):
    """Its decoder under model.language_model., beside model.visual.* tensors (compared with
    transformers above, as the "qwen3.5-multimodal" variant)."""
    model_dir, _ = tiny_checkpoints("qwen3.5-multimodal")
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        assert any(name.startswith("model.visual.") for name in f.keys())  # noqa: SIM118
    with caplog.at_level(logging.INFO):
        load_model(model_dir, device="meta")
    assert "the vision tower" in caplog.text


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        (
            {"layer_types": ["linear_attention", "sliding_attention"] * 2, "sliding_window": 8},
            "sliding_attention",
        ),
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_conv_kernel_dim": None}, "linear_conv_kernel_dim"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_a_bad_hybrid_setting_is_refused_by_name(tiny_checkpoints, changes, named):
    model_dir, _ = tiny_checkpoints("qwen3.5")
    raw = json.loads((model_dir / "config.json").read_text())
    raw.update(changes)
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict(raw)


def test_linear_attention_layers_are_refused_outside_the_hybrid_families(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("qwen3")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["layer_types"] = ["linear_attention", "full_attention"]
    with pytest.raises(ModelLoadError, match="linear_attention"):
        ModelConfig.from_dict(raw)


def _engine(model_dir, **settings):
    from appliance.engine.engine import Engine
    from appliance.engine.engine_config import EngineConfig

    config = EngineConfig(model_dir=model_dir, block_size=16, max_num_seqs=3, **settings)
    return Engine.build(config, load_model(model_dir), None)


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("name", ["qwen3.5", "qwen3.5-moe"])
def test_engine_greedy_with_chunked_prefill_and_preemption_matches_transformers(
    tiny_checkpoints, exact_recurrence, name
):
    """Three prompts through the real engine in 16-token chunks, in a pool of 5 blocks that
    cannot hold all three: sequences are preempted with their state live, and recomputed
    (their state rebuilt from prompt and generated tokens) when they run again."""
    model_dir, hf_model = tiny_checkpoints(name)
    engine = _engine(model_dir, num_kv_blocks=5, max_num_batched_tokens=16)
    assert not engine.block_manager.enable_prefix_caching
    prompts = _prompts((30, 21, 12), seed=7)
    completions = engine.generate(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0, "the pool is meant to force preemption"
    for prompt, completion in zip(prompts, completions, strict=True):
        assert completion.token_ids == _hf_greedy(hf_model, prompt, 8), (
            f"{name}: greedy output for a prompt of {len(prompt)} tokens diverged"
        )
    assert engine.scheduler.state_slots.num_free == 3
    assert engine.stats().recurrent_state_usage == 0.0


def test_decode_bursts_under_asynchronous_scheduling_carry_the_state(
    tiny_checkpoints, exact_recurrence
):
    """Decode bursts of 4 steps on the device, each step continuing the state the one before
    left, and the next step scheduled while one is in flight."""
    model_dir, hf_model = tiny_checkpoints("qwen3.5")
    engine = _engine(
        model_dir,
        num_kv_blocks=16,
        max_num_batched_tokens=64,
        max_decode_burst=4,
        async_scheduling=True,
    )
    prompts = _prompts((19, 6), seed=9)
    for prompt, completion in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        assert completion.token_ids == _hf_greedy(hf_model, prompt, 8)
    assert engine.scheduler.state_slots.num_free == 3


def test_cancelling_a_running_sequence_frees_its_state_slot(tiny_checkpoints, caplog):
    model_dir, _ = tiny_checkpoints("qwen3.5")
    with caplog.at_level(logging.INFO):
        engine = _engine(model_dir, num_kv_blocks=16, max_num_batched_tokens=64)
    assert "prefix caching is off for this hybrid model" in caplog.text
    slots = engine.scheduler.state_slots
    for i, prompt in enumerate(_prompts((20, 9), seed=8)):
        engine.add_request(f"r{i}", prompt, GREEDY)
    engine.step()
    assert slots.num_free == 1 and engine.stats().recurrent_state_usage == pytest.approx(2 / 3)
    engine.abort("r0")
    assert slots.num_free == 2
    while engine.has_unfinished():
        engine.step()
    assert slots.num_free == 3


def test_the_state_and_the_kv_pool_share_one_memory_budget(tiny_checkpoints):
    """On the CPU the KV pool gets what kv_cache_memory_bytes leaves after the state's slots;
    only the full-attention layer has pages."""
    model_dir, _ = tiny_checkpoints("qwen3.5")
    config = ModelConfig.from_model_dir(model_dir)
    assert config.linear_attention is not None
    state_bytes = 3 * state_bytes_per_slot(config.linear_attention, torch.float32)
    block_bytes = 2 * 1 * 16 * config.num_kv_heads * config.head_dim * 4  # one attention layer
    engine = _engine(model_dir, kv_cache_memory_bytes=state_bytes + 10 * block_bytes)
    assert engine.block_manager.num_blocks == 10
    assert len(engine.runner.kv_caches) == 1
    assert [s.delta.dtype for s in engine.runner.recurrent_states] == [torch.float32] * 3


def test_inspect_says_prefix_caching_is_off_and_the_vision_tower_is_ignored(tiny_checkpoints):
    from appliance.engine.models.inspection import inspect_model

    model_dir, _ = tiny_checkpoints("qwen3.5-multimodal")
    report = inspect_model(model_dir)
    assert report.unsupported is None
    lines = dict(report.lines)
    assert lines["prefix caching"].startswith("off")
    assert "recurrent state" in lines["prefix caching"]
    assert lines["not served"].endswith(
        "the vision tower and the multi-token-prediction head (this appliance serves "
        "Qwen3.5's text model; image inputs are refused)"
    )
    assert lines["KV bytes/token"].startswith(f"{2 * 1 * 2 * 16 * 2:,} ")  # one attention layer
    assert lines["linear attention"].startswith("Gated DeltaNet on 3 of 4 layers")
