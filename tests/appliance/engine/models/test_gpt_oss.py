"""gpt-oss beyond what test_families compares for every family: its MXFP4 experts against
transformers' own dequantization, an MXFP4 checkpoint end to end, the sinks and the clamp
mattering, and its config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.fused_experts import MXFP4_BLOCK, dequantize_mxfp4
from appliance.engine.models.inspection import inspect_model
from appliance.engine.models.loader import load_model
from kernels.moe_spec import ClampedSwiglu

from .conftest import WINDOW, build_hf_model
from .test_architectures import PagedBatch, _hf_logits, _prompts

ATOL = 1e-4


def _random_mxfp4(shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks [*shape[:-1], shape[-1] / 32, 16] of every FP4 code and scales 2^-4 .. 2^-1."""
    generator = torch.Generator().manual_seed(seed)
    groups = (*shape[:-1], shape[-1] // MXFP4_BLOCK)
    blocks = torch.randint(256, (*groups, MXFP4_BLOCK // 2), generator=generator)
    scales = torch.randint(123, 127, groups, generator=generator)
    return blocks.to(torch.uint8), scales.to(torch.uint8)


def test_mxfp4_dequantization_matches_transformers_on_random_blocks():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_mxfp4((3, 40, 96), seed=0)
    scales[0, 0, 0], scales[1, 2, 1] = 0, 255  # the extremes of the E8M0 exponent
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, cols, rows]
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.dtype == torch.bfloat16 and ours.shape == (3, 40, 96)
    assert torch.equal(ours.transpose(1, 2), theirs)


def test_mxfp4_dequantization_refuses_mismatched_scales():
    blocks, scales = _random_mxfp4((2, 8, 64), seed=1)
    with pytest.raises(ModelLoadError, match="do not match scales"):
        dequantize_mxfp4(blocks, scales[..., :1])


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """The tiny gpt-oss with random MXFP4 experts: transformers' model given transformers'
    dequantization of them, and a directory holding the blocks and scales as OpenAI ships them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf_model = build_hf_model("gpt-oss", seed=1)
    model_dir = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf_model.save_pretrained(model_dir, safe_serialization=True)
    tensors = load_file(model_dir / "model.safetensors")
    config = hf_model.config
    hidden, size, num_experts = config.hidden_size, config.intermediate_size, 6
    for i, layer in enumerate(hf_model.model.layers):
        experts = layer.mlp.experts
        for seed, (projection, rows, cols) in enumerate(
            [("gate_up_proj", 2 * size, hidden), ("down_proj", hidden, size)]
        ):
            blocks, scales = _random_mxfp4((num_experts, rows, cols), seed=10 * i + seed)
            weight = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
            getattr(experts, projection).data.copy_(weight)  # [E, cols, rows]: x @ w
            prefix = f"model.layers.{i}.mlp.experts.{projection}"
            del tensors[prefix]
            tensors[f"{prefix}_blocks"], tensors[f"{prefix}_scales"] = blocks, scales
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir, hf_model


def test_an_mxfp4_checkpoint_loads_and_matches_transformers(mxfp4_checkpoint):
    model_dir, hf_model = mxfp4_checkpoint
    model = load_model(model_dir)
    prompts = _prompts((60, 9))
    logits = PagedBatch(model, prompts).step([(i, 0, len(p)) for i, p in enumerate(prompts)])
    for ours, prompt in zip(logits, prompts, strict=True):
        theirs = _hf_logits(hf_model, prompt)
        diff = (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item()
        assert diff <= ATOL, f"MXFP4 gpt-oss: max |log-prob difference| {diff:.2e}"


def test_inspect_reports_mxfp4_experts_as_served(mxfp4_checkpoint):
    model_dir, hf_model = mxfp4_checkpoint
    report = inspect_model(model_dir)
    assert report.unsupported is None, report.unsupported
    lines = dict(report.lines)
    assert lines["quantization"] == "MXFP4 experts, dequantized to bf16 on load"
    # Parameters as the dequantized model has them (transformers' count): two per byte of
    # the experts' blocks, their scales none; not the packed bytes.
    num_params = sum(p.numel() for p in hf_model.parameters())
    assert f"({num_params:,}) in 1 file(s)" in lines["parameters"]
    assert lines["dtype"].startswith("MXFP4 ")
    assert lines["experts"] == "6 of intermediate size 32 on 3 of 3 layers, 2 active per token"


def test_an_mxfp4_checkpoint_missing_scales_is_refused_by_name(mxfp4_checkpoint, tmp_path):
    source, _ = mxfp4_checkpoint
    model_dir = Path(shutil.copytree(source, tmp_path / "broken"))
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.experts\.down_proj_blocks"):
        load_model(model_dir)


def test_mxfp4_is_refused_for_a_family_without_gpt_oss_experts(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("qwen3-moe")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    with pytest.raises(ModelLoadError, match="mxfp4"):
        ModelConfig.from_dict(raw)


def test_gpt_oss_config_declares_windows_router_sinks_and_clamped_experts(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("gpt-oss")
    config = ModelConfig.from_model_dir(model_dir)
    assert config.layer_windows == (WINDOW, None, WINDOW)
    assert config.attention_sinks and config.qkv_bias and config.o_bias
    assert config.rope.rope_type == "yarn" and not config.rope.truncate
    assert config.moe is not None
    router = config.moe.router
    assert (router.score_after_topk, router.logit_bias, router.renormalize) == (True, True, False)
    assert config.moe.expert_bias
    assert config.moe.clamped_swiglu == ClampedSwiglu(alpha=1.702, limit=2.0)


def test_comparison_would_fail_if_the_sinks_or_the_clamp_were_ignored(tiny_checkpoints):
    model_dir, hf_model = tiny_checkpoints("gpt-oss")
    [prompt] = _prompts((60,))
    reference = _hf_logits(hf_model, prompt)
    model = load_model(model_dir)
    for layer in model.layers:
        layer.self_attn.sinks = None
    no_sinks = PagedBatch(model, [prompt]).step([(0, 0, 60)])[0]
    assert (no_sinks - reference).abs().max() > 1000 * ATOL
    model = load_model(model_dir)
    for layer in model.layers:
        layer.mlp.clamped_swiglu = ClampedSwiglu(alpha=1.702, limit=1000.0)
    no_clamp = PagedBatch(model, [prompt]).step([(0, 0, 60)])[0]
    assert (no_clamp - reference).abs().max() > 1000 * ATOL
