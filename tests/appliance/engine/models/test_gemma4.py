"""Gemma 4's own parts, checked against transformers beyond the logits every family is compared
on (test_families.py: prompts past the window, a batch of three lengths, chunks and decode, and
the greedy run through the Scheduler and ModelRunner): which layers own KV pages and what the
pool holds for them, the head shapes of its global layers in either config spelling, the
proportional rope, what it refuses, and how `inferno model inspect` shows the multimodal
checkpoint's towers.
"""

from __future__ import annotations

import json

import pytest
import torch

import kernels.reference
from appliance.engine.errors import ModelLoadError
from appliance.engine.kv_cache import KVCacheSpec, KVPools
from appliance.engine.models.config import ModelConfig, RopeConfig
from appliance.engine.models.inspection import inspect_model
from appliance.engine.models.loader import load_model
from appliance.engine.models.rotary import cos_sin_table, inverse_frequencies

from .test_architectures import PagedBatch, _hf_logits, _prompts

ATOL = 1e-4
BLOCK_SIZE = 16


def test_kv_shared_layers_own_no_pages_and_the_pool_holds_the_owners_shapes(tiny_checkpoints):
    model_dir, hf_model = tiny_checkpoints("gemma4")
    config = ModelConfig.from_model_dir(model_dir)
    # transformers' rule: the last two layers reuse the KV of the last earlier layer of their
    # type, which it marks "store".
    modes = hf_model.config.kv_sharing_modes
    assert modes == [None, None, "store", "store", "reuse", "reuse"]
    assert config.layer_kv_sources == (0, 1, 2, 3, 2, 3)
    assert config.kv_layers == (0, 1, 2, 3)
    spec = KVCacheSpec.for_model(config, BLOCK_SIZE, torch.float32)
    # Windowed layers: 2 KV heads of 16; global layers: 1 KV head of 32.
    assert spec.layer_shapes == ((2, 16), (1, 32), (2, 16), (1, 32))
    assert spec.bytes_per_block == 2 * BLOCK_SIZE * (32 + 32 + 32 + 32) * 4
    caches = spec.allocate(KVPools(3), "cpu")
    assert [tuple(c.shape) for c in caches] == [
        (2, 3, BLOCK_SIZE, 2, 16),
        (2, 3, BLOCK_SIZE, 1, 32),
        (2, 3, BLOCK_SIZE, 2, 16),
        (2, 3, BLOCK_SIZE, 1, 32),
    ]


def test_kv_shared_layers_project_only_queries_and_write_nothing(tiny_checkpoints, monkeypatch):
    model_dir, _ = tiny_checkpoints("gemma4")
    model = load_model(model_dir)
    q_rows = [layer.self_attn.qkv_proj.weight.shape[0] for layer in model.layers]
    # q of 4 heads; then k and v (16 wide, 2 heads), or k alone (global: its values are its
    # keys); layers 4 and 5 nothing but q.
    assert q_rows == [64 + 64, 128 + 32, 64 + 64, 128 + 32, 64, 128]
    written: list[int] = []
    write = kernels.reference.write_kv_cache

    def recording_write(k, v, k_cache, *args):
        written.append(k_cache.data_ptr())
        return write(k, v, k_cache, *args)

    monkeypatch.setattr(kernels.reference, "write_kv_cache", recording_write)
    batch = PagedBatch(model, _prompts((30,)))
    batch.step([(0, 0, 30)])
    assert written == [cache[0].data_ptr() for cache in batch.kv_caches]


def test_kv_shared_layers_read_their_owners_fp8_kv_scales(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("gemma4")
    model = load_model(model_dir)
    owner, sharer = model.layers[3].self_attn, model.layers[5].self_attn
    owner.k_scale.fill_(2.0)  # as models.loader sets a checkpoint's scale: in place
    assert sharer.k_scale is owner.k_scale and sharer.v_scale is owner.v_scale
    assert model.layers[4].self_attn.k_scale is model.layers[2].self_attn.k_scale


def test_global_head_shapes_read_alike_from_googles_config_and_transformers_per_layer_config(
    tiny_checkpoints,
):
    model_dir, _ = tiny_checkpoints("gemma4")
    saved = json.loads((model_dir / "config.json").read_text())
    assert saved["per_layer_config"]["1"] == {"head_dim": 32, "num_key_value_heads": 1}
    google = {k: v for k, v in saved.items() if k != "per_layer_config"}
    google |= {"global_head_dim": 32, "num_global_key_value_heads": 1}
    config = ModelConfig.from_dict(saved)
    assert ModelConfig.from_dict(google) == config
    assert config.layer_head_dims == (16, 32) * 3
    assert config.layer_num_kv_heads == (2, 1) * 3
    assert config.layer_values_are_keys == (False, True) * 3
    assert config.layer_intermediate_sizes == (128,) * 4 + (256,) * 2  # double-wide sharers


def test_proportional_rope_equals_transformers_and_the_comparison_needs_it(tiny_checkpoints):
    model_dir, hf_model = tiny_checkpoints("gemma4")
    model = load_model(model_dir)
    rope = model.config.rope
    assert rope.rope_type == "proportional" and rope.proportion == 0.25
    theirs = hf_model.model.rotary_emb.full_attention_inv_freq
    assert torch.equal(inverse_frequencies(rope, 32), theirs)
    # Rotating every dim of the wide heads (default rope) instead changes the logits.
    [prompt] = _prompts((60,))
    model.rope_tables[(rope, 32)] = cos_sin_table(RopeConfig(theta=rope.theta), 32, 512)
    ours = PagedBatch(model, [prompt]).step([(0, 0, 60)])[0]
    assert (ours - _hf_logits(hf_model, prompt)).abs().max() > 100 * ATOL


def test_comparison_would_fail_if_the_layer_scalars_were_ignored(tiny_checkpoints):
    model_dir, hf_model = tiny_checkpoints("gemma4")
    model = load_model(model_dir)
    with torch.no_grad():
        for layer in model.layers:
            layer.layer_scalar.fill_(1.0)
    [prompt] = _prompts((40,))
    ours = PagedBatch(model, [prompt]).step([(0, 0, 40)])[0]
    assert (ours - _hf_logits(hf_model, prompt)).abs().max() > 100 * ATOL


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"num_kv_shared_layers": 5}, "num_kv_shared_layers"),
        ({"per_layer_config": {"1": {"sliding_window": 8}}}, "sliding_window"),
        ({"layer_types": ["full_attention", "sliding_attention"] * 3}, "layer_types"),
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "sliding_attention"),
        ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 5,
          "moe_intermediate_size": 8}, "top_k_experts"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ],
)  # fmt: skip
def test_an_unsupported_gemma4_setting_is_refused_by_name(tiny_checkpoints, changes, named):
    model_dir, _ = tiny_checkpoints("gemma4")
    raw = {**json.loads((model_dir / "config.json").read_text()), **changes}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict(raw)


def test_inspect_names_the_towers_of_a_multimodal_gemma4_as_not_served(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("gemma4-multimodal")
    report = inspect_model(model_dir)
    assert report.unsupported is None
    lines = dict(report.lines)
    assert lines["not served"].endswith(
        "the vision and audio towers (this appliance serves Gemma 4's text model; image and "
        "audio inputs are refused)"
    )
    # Layers 2 and 3 reuse the KV of layers 0 and 1.
    assert lines["KV bytes/token"].endswith("in bf16, 2 layers own KV)")


def test_the_triton_kernels_run_gemma4_as_the_reference_does(tiny_checkpoints):
    """The GPU path's kernels (in Triton's interpreter here, so one variant: its GELU-tanh
    experts are checked in tests/kernels/test_moe.py): KV-shared layers, whose q the in-place
    rotary must rotate once, 32-wide global heads with one KV head, a chunk after cached
    context beside a whole prompt."""
    import kernels.triton_ops

    model_dir, hf_model = tiny_checkpoints("gemma4")
    model = load_model(model_dir, ops=kernels.triton_ops)
    prompts = _prompts((40, 7))
    batch = PagedBatch(model, prompts)
    first, short = batch.step([(0, 0, 30), (1, 0, 7)])
    [rest] = batch.step([(0, 30, 40)])
    theirs = _hf_logits(hf_model, prompts[0])
    assert (torch.cat([first, rest]) - theirs).abs().max() <= ATOL
    assert (short - _hf_logits(hf_model, prompts[1])).abs().max() <= ATOL
