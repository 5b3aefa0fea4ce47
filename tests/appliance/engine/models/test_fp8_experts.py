"""FP8 experts: every mixture family quantized on load (`quantization="fp8"`), and a
Qwen3-MoE FP8 checkpoint in the block layout Qwen3-30B-A3B-FP8 ships (`weight_scale_inv` per
expert projection), written here from the tiny transformers checkpoint.

The reference is transformers' float32 forward on the weights our FP8 model stands for: the
same projections and experts quantized per output channel and dequantized. What is left is our
FP8 activations (W8A8, rounded per token as finely as the weights per channel), so, as in
test_fp8_checkpoints, the logit error is of the size of the weights' own quantization
(transformers on the original weights against the dequantized ones): within twice it. A
missing scale or a wrong expert slice is several times that. Greedy agreement is not tested on
these tiny random models: their logits are nearly flat, so quantizing the weights alone
changes transformers' own argmax at a quarter of the positions.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.inspection import inspect_model
from appliance.engine.models.loader import load_model
from appliance.engine.models.sealed_images import SealedImages
from appliance.engine.models.sparse_moe import Experts
from attestation.sealed import SealedModel
from kernels.fp8 import FP8_MAX, dequantize_blocks, quantize_rows
from tests.attestation.sealed.conftest import seal

from .test_architectures import PagedBatch, _hf_logits, _prompts
from .test_fp8_checkpoints import _assert_same_bytes, _ct_config, _per_block

MOE_FAMILIES = ["mixtral-window", "qwen3-moe", "qwen2-moe", "gpt-oss", "gemma4-moe", "qwen3.5-moe"]
# What our FP8 model quantizes, by transformers' names: attention and MLP projections (a shared
# expert's too) and the stacked experts; never routers, embeddings, norms or the LM head.
_QUANTIZED_2D = ("_proj.weight",)
_SKIPPED = ("linear_attn.", "router.", "mlp.gate.", "shared_expert_gate", "per_layer")
# Blocks that cut the tiny experts (I 48, H 64) into whole and partial blocks.
BLOCK = (32, 48)


def _dequantized_per_channel(weight: torch.Tensor, out_dim: int) -> torch.Tensor:
    """`weight` quantized per output channel (its dimension `out_dim`) and dequantized."""
    moved = weight.movedim(out_dim, -2)
    rows = moved.reshape(-1, moved.shape[-1])
    q, scale = quantize_rows(rows)
    return (q.float() * scale[:, None]).view(moved.shape).movedim(-2, out_dim)


def fp8_reference(hf_model: torch.nn.Module, *, transposed_experts: bool) -> torch.nn.Module:
    """A copy of `hf_model` whose weights are those our FP8 model stands for."""
    reference = type(hf_model)(hf_model.config).eval()
    reference.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if any(part in name for part in _SKIPPED) or not name.startswith("model.layers."):
                continue
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                # transformers' gpt-oss stores x @ w ([E, in, out]), the others nn.Linear's rows.
                param.copy_(_dequantized_per_channel(param, 2 if transposed_experts else 1))
            elif name.endswith(_QUANTIZED_2D):
                param.copy_(_dequantized_per_channel(param, 0))
    return reference


def _logit_errors(model, hf_model, reference, prompts) -> list[tuple[float, float]]:
    logits = PagedBatch(model, prompts).step([(i, 0, len(p)) for i, p in enumerate(prompts)])
    errors = []
    for ours, prompt in zip(logits, prompts, strict=True):
        theirs = _hf_logits(reference, prompt)
        weights_error = (_hf_logits(hf_model, prompt) - theirs).abs().max().item()
        errors.append(((ours - theirs).abs().max().item(), weights_error))
    return errors


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_fp8_experts_quantized_on_load_follow_transformers_on_their_weights(
    tiny_checkpoints, family
):
    model_dir, hf_model = tiny_checkpoints(family)
    model = load_model(model_dir, quantization="fp8")
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(e.gate_up_proj.dtype == torch.float8_e4m3fn for e in experts)
    reference = fp8_reference(hf_model, transposed_experts=family == "gpt-oss")
    for error, weights_error in _logit_errors(model, hf_model, reference, _prompts((37, 20))):
        assert error < 2 * weights_error, f"max |logit error| {error} vs {weights_error}"


def test_the_logit_bound_would_fail_if_an_experts_scales_were_lost(tiny_checkpoints):
    model_dir, hf_model = tiny_checkpoints("qwen3-moe")
    model = load_model(model_dir, quantization="fp8")
    next(m for m in model.modules() if isinstance(m, Experts)).down_proj_scale.data.fill_(1.0)
    reference = fp8_reference(hf_model, transposed_experts=False)
    [(error, weights_error)] = _logit_errors(model, hf_model, reference, _prompts((37,)))
    assert error > 2 * weights_error


def write_fp8_experts_checkpoint(source: Path, out: Path, layout: str) -> dict[str, torch.Tensor]:
    """`source` (a tiny Qwen3-MoE) with every expert projection FP8 as Qwen3-30B-A3B-FP8 ships
    them ("block": the "fp8" layout, `weight_scale_inv` per BLOCK) or as llm-compressor writes
    them ("channel": compressed-tensors, `weight_scale` [out, 1] in bf16); everything else
    left as it was (each layout's list of unquantized modules). Returns each expert
    projection's dequantized weight (the checkpoint's meaning) by name."""
    shutil.copytree(source, out)
    tensors = load_file(source / "model.safetensors")
    meaning = {}
    for name in sorted(tensors):
        if ".mlp.experts." in name and name.endswith("_proj.weight"):
            module = name.removesuffix(".weight")
            if layout == "block":
                q, scales = _per_block(tensors[name], BLOCK)
                tensors[f"{module}.weight_scale_inv"] = scales
                meaning[name] = dequantize_blocks(q, scales, BLOCK)
            else:
                q, scale = quantize_rows(tensors[name])
                tensors[f"{module}.weight_scale"] = scale[:, None].to(torch.bfloat16)
                meaning[name] = q.float() * scale.to(torch.bfloat16).float()[:, None]
            tensors[name] = q
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = _LAYOUTS[layout]
    (out / "config.json").write_text(json.dumps(config))
    return meaning


_LAYOUTS = {
    "block": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(BLOCK),
        "modules_to_not_convert": ["self_attn", "mlp.gate", "lm_head", "layers.1.mlp"],
    },
    "channel": {
        **_ct_config("channel", static=False),
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*mlp.gate$", "re:model.layers.1.mlp.*"],
    },
}


@pytest.fixture(scope="module")
def fp8_experts_checkpoints(tiny_checkpoints, tmp_path_factory):
    """layout -> (directory, dequantized experts, transformers' model), written once."""
    cache = {}

    def get(layout: str):
        if layout not in cache:
            source, hf_model = tiny_checkpoints("qwen3-moe")
            out = tmp_path_factory.mktemp(f"qwen3-moe-fp8-{layout}") / "model"
            cache[layout] = (out, write_fp8_experts_checkpoint(source, out, layout), hf_model)
        return cache[layout]

    return get


@pytest.fixture
def block_checkpoint(fp8_experts_checkpoints):
    return fp8_experts_checkpoints("block")


def test_channel_checkpoint_experts_load_exactly_the_weights_it_holds(fp8_experts_checkpoints):
    model_dir, meaning, _ = fp8_experts_checkpoints("channel")
    ours = _experts_by_name(load_model(model_dir))
    assert ours.keys() == meaning.keys()
    for name, weight in meaning.items():
        assert torch.equal(ours[name], weight), name


def _experts_by_name(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our FP8 experts' dequantized weights under the checkpoint's per-expert names."""
    out = {}
    for name, module in model.named_modules():
        if not isinstance(module, Experts):
            continue
        prefix = f"model.{name}"
        for e in range(len(module.held)):
            gate_up = module.gate_up_proj[e].float() * module.gate_up_proj_scale[e]
            gate, up = gate_up.chunk(2)
            down = module.down_proj[e].float() * module.down_proj_scale[e]
            for projection, weight in (("gate", gate), ("up", up), ("down", down)):
                out[f"{prefix}.{module.held[e]}.{projection}_proj.weight"] = weight
    return out


def test_block_checkpoint_experts_are_requantized_per_channel_within_one_rounding(
    block_checkpoint,
):
    model_dir, meaning, _ = block_checkpoint
    ours = _experts_by_name(load_model(model_dir))
    assert ours.keys() == meaning.keys()
    for name, weight in meaning.items():
        # As test_fp8_checkpoints: requantizing a row against its largest block rounds each
        # value once more, by at most half an e4m3 step (2^-4) or the smallest subnormal.
        row_scale = weight.abs().amax(1, keepdim=True) / FP8_MAX
        bound = torch.maximum(weight.abs() * 2**-4, row_scale * 2**-10) + 1e-12
        assert ((ours[name] - weight).abs() <= bound).all(), name


def test_block_checkpoint_follows_transformers_on_the_weights_it_stands_for(block_checkpoint):
    """transformers with the checkpoint's dequantized experts (its other weights as they
    were), against our FP8 model of it, within twice the error the quantization itself makes."""
    model_dir, meaning, hf_model = block_checkpoint
    reference = type(hf_model)(hf_model.config).eval()
    reference.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for name, module in reference.named_modules():
            if name.endswith("mlp.experts"):
                prefix, num_experts = f"{name}.", module.gate_up_proj.shape[0]
                for e in range(num_experts):
                    gate = _per_channel(meaning[f"{prefix}{e}.gate_proj.weight"])
                    up = _per_channel(meaning[f"{prefix}{e}.up_proj.weight"])
                    module.gate_up_proj[e].copy_(torch.cat((gate, up)))
                    module.down_proj[e].copy_(
                        _per_channel(meaning[f"{prefix}{e}.down_proj.weight"])
                    )
    model = load_model(model_dir)
    for error, weights_error in _logit_errors(model, hf_model, reference, _prompts((37, 20))):
        assert error < 2 * weights_error, f"max |logit error| {error} vs {weights_error}"


def _per_channel(weight: torch.Tensor) -> torch.Tensor:
    """A block-dequantized weight requantized per row, as the loader does."""
    return _dequantized_per_channel(weight, 0)


def test_inspect_serves_an_fp8_mixture_and_states_its_fp8_experts(block_checkpoint):
    model_dir, _, _ = block_checkpoint
    report = inspect_model(model_dir)
    assert report.unsupported is None
    assert "FP8 e4m3 experts" in dict(report.lines)["quantization"]


def test_an_fp8_checkpoint_with_stacked_experts_is_refused_by_name(block_checkpoint, tmp_path):
    model_dir, _, _ = block_checkpoint
    out = Path(shutil.copytree(model_dir, tmp_path / "stacked"))
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.0.mlp.experts.gate_up_proj"] = torch.zeros(6, 96, 64).to(
        torch.float8_e4m3fn
    )
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(ModelLoadError, match="stacked"):
        load_model(out)


def test_a_sealed_fp8_mixture_loads_as_its_files_do(block_checkpoint, tmp_path):
    """The FP8 experts and their block scales seal, and decrypt into the same model."""
    model_dir, _, _ = block_checkpoint
    fixture = seal(model_dir, tmp_path / "sealed")
    sealed = SealedModel.open(fixture.sealed, manifest_key=fixture.public_key)
    with SealedImages(sealed, fixture.data_key, torch.device("cpu"), workers=2) as images:
        _assert_same_bytes(load_model(fixture.sealed, weights=images), load_model(model_dir))
