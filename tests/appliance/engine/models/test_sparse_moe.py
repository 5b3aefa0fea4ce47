"""Mixtures of experts beyond what test_families compares: routing ties decided as transformers
decides them, the router's options mattering, the layers a config makes sparse, checkpoints
that store experts stacked, sharded or sealed, what `inferno model inspect` says, and what is
refused by name. The checkpoints are conftest's (transformers' own classes, saved by them)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from appliance.__main__ import main
from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import load_model
from appliance.engine.models.sparse_moe import SparseMoeBlock
from kernels import reference
from kernels.moe_spec import Router

from .conftest import build_hf_model, save_checkpoint
from .test_architectures import PagedBatch, _hf_logits, _prompts

ATOL = 1e-4


def _max_log_prob_difference(model, hf_model, prompt: list[int]) -> float:
    ours = PagedBatch(model, [prompt]).step([(0, 0, len(prompt))])[0]
    theirs = _hf_logits(hf_model, prompt)
    return (ours.log_softmax(-1) - theirs.log_softmax(-1)).abs().max().item()


@pytest.fixture(scope="module")
def tied_mixtral(tmp_path_factory):
    """Mixtral whose router gives experts 1 and 2 the same row in every layer: their scores tie
    exactly for every token, so wherever they straddle the top 2 the tie decides the output."""
    hf_model = build_hf_model("mixtral-window")
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.mlp.gate.weight[2] = layer.mlp.gate.weight[1]
    return save_checkpoint(hf_model, tmp_path_factory.mktemp("tied")), hf_model


def test_routing_ties_are_decided_as_transformers_decides_them(tied_mixtral):
    model_dir, hf_model = tied_mixtral
    [prompt] = _prompts((60,), seed=4)
    assert _max_log_prob_difference(load_model(model_dir), hf_model, prompt) <= ATOL


def test_the_tie_comparison_would_fail_if_ties_went_to_the_higher_expert(tied_mixtral, monkeypatch):
    model_dir, hf_model = tied_mixtral

    route_experts = reference.route_experts  # the CPU path's (load_model's default ops)

    def higher_expert_first(logits, router, selection_bias=None, expert_scale=None):
        weights, ids = route_experts(logits.flip(-1), router, selection_bias, expert_scale)
        return weights, router.num_experts - 1 - ids

    monkeypatch.setattr(reference, "route_experts", higher_expert_first)
    [prompt] = _prompts((60,), seed=4)
    assert _max_log_prob_difference(load_model(model_dir), hf_model, prompt) > 100 * ATOL


def test_the_comparison_would_fail_if_norm_topk_prob_were_ignored(tiny_checkpoints):
    model_dir, hf_model = tiny_checkpoints("qwen3-moe")
    model = load_model(model_dir)
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.router = dataclasses.replace(layer.mlp.router, renormalize=False)
    [prompt] = _prompts((40,))
    assert _max_log_prob_difference(model, hf_model, prompt) > 100 * ATOL


@pytest.mark.parametrize(
    ("name", "sparse", "router"),
    [
        ("mixtral-window", (True, True), Router(6, 2, renormalize=True)),
        ("qwen3-moe", (True, False, True), Router(6, 2, renormalize=True)),
        ("qwen2-moe", (False, True, False), Router(6, 2)),
    ],
)
def test_the_config_declares_the_router_and_which_layers_are_sparse(
    tiny_checkpoints, name, sparse, router
):
    model_dir, _ = tiny_checkpoints(name)
    moe = ModelConfig.from_model_dir(model_dir).moe
    assert moe is not None and moe.moe_layers == sparse and moe.router == router
    model = load_model(model_dir)
    assert tuple(isinstance(layer.mlp, SparseMoeBlock) for layer in model.layers) == sparse


def test_experts_stored_stacked_load_the_same_model_as_experts_stored_one_by_one(
    tiny_checkpoints, tmp_path
):
    """transformers holds experts stacked in memory (mlp.experts.gate_up_proj [E, 2I, H]);
    a checkpoint saved from that state dict, under Qwen's names, loads the same weights."""
    model_dir, hf_model = tiny_checkpoints("qwen3-moe")
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, tmp_path / "model.safetensors")
    stacked = dict(load_model(tmp_path).named_parameters())
    for name, param in load_model(model_dir).named_parameters():
        assert torch.equal(param, stacked[name]), name


def test_a_sharded_sealed_mixtral_loads_the_same_model_as_its_files(tmp_path):
    from appliance.engine.models.sealed_images import SealedImages
    from attestation.sealed import SealedModel
    from tests.attestation.sealed.conftest import seal

    source = save_checkpoint(
        build_hf_model("mixtral-window"), tmp_path / "m", max_shard_size="100KB"
    )
    assert len(json.loads((source / "model.safetensors.index.json").read_text())["weight_map"])
    fixture = seal(source, tmp_path / "sealed")
    sealed = SealedModel.open(fixture.sealed, manifest_key=fixture.public_key)
    images = SealedImages(sealed, fixture.data_key, torch.device("cpu"), workers=2, staging=True)
    from_sealed = dict(load_model(fixture.sealed, weights=images).named_parameters())
    for name, param in load_model(source).named_parameters():
        assert torch.equal(param, from_sealed[name]), name


def _edited_checkpoint(tiny_checkpoints, name: str, tmp_path: Path, edit) -> Path:
    from safetensors.torch import load_file

    source, _ = tiny_checkpoints(name)
    model_dir = Path(shutil.copytree(source, tmp_path / name))
    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")
    return model_dir


def test_a_checkpoint_missing_one_experts_projection_is_refused_naming_its_parameter(
    tiny_checkpoints, tmp_path
):
    def drop(tensors):
        del tensors["model.layers.1.block_sparse_moe.experts.4.w3.weight"]

    model_dir = _edited_checkpoint(tiny_checkpoints, "mixtral-window", tmp_path, drop)
    with pytest.raises(ModelLoadError, match=r"lacks tensors for layers\.1\.mlp\.experts\.gate_up"):
        load_model(model_dir)


def test_an_expert_the_config_lacks_is_refused_by_name(tiny_checkpoints, tmp_path):
    def add(tensors):
        extra = tensors["model.layers.0.mlp.experts.0.down_proj.weight"]
        tensors["model.layers.0.mlp.experts.6.down_proj.weight"] = extra.clone()

    model_dir = _edited_checkpoint(tiny_checkpoints, "qwen3-moe", tmp_path, add)
    with pytest.raises(ModelLoadError, match=r"unexpected tensor .*experts\.6\.down_proj"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("name", "changes", "named"),
    [
        ("mixtral-window", {"num_experts_per_tok": 7}, "num_experts_per_tok"),
        ("mixtral-window", {"hidden_act": "gelu"}, "hidden_act"),
        ("qwen3-moe", {"mlp_only_layers": [3]}, "mlp_only_layers"),
        ("qwen3-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ("qwen2-moe", {"shared_expert_intermediate_size": None}, "shared_expert_intermediate"),
        (
            "qwen3-moe",
            {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}},
            "static input scales",
        ),
    ],
)
def test_an_unsupported_moe_setting_is_refused_by_name(tiny_checkpoints, name, changes, named):
    model_dir, _ = tiny_checkpoints(name)
    raw = {**json.loads((model_dir / "config.json").read_text()), **changes}
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_dict(raw)


def test_inspect_reports_the_experts_and_the_parameters_a_token_reads(tiny_checkpoints, capsys):
    model_dir, hf_model = tiny_checkpoints("qwen2-moe")
    assert main(["model", "inspect", str(model_dir)]) == 0
    out = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in capsys.readouterr().out.split("\n")
               if line)  # fmt: skip
    assert out["served"] == "yes"
    assert out["experts"] == (
        "6 of intermediate size 48 on 1 of 3 layers, 2 active per token, a shared expert of "
        "intermediate size 96"
    )
    total = sum(p.numel() for p in hf_model.parameters())
    # One sparse layer: 4 of its 6 experts (gate, up, down: 3 x 64 x 48 each) are not read.
    active = total - 4 * 3 * 64 * 48
    assert (
        out["active parameters"]
        == f"{active / 1e6:.2f} M ({active:,}) of {total / 1e6:.2f} M per token"
    )


def test_fp8_quantization_of_a_moe_makes_its_experts_fp8_and_leaves_its_router(
    tiny_checkpoints,
):
    model_dir, _ = tiny_checkpoints("qwen2-moe")
    model = load_model(model_dir, quantization="fp8")
    dense, sparse = model.layers[0].mlp, model.layers[1].mlp
    assert isinstance(sparse, SparseMoeBlock) and not isinstance(dense, SparseMoeBlock)
    assert dense.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert sparse.experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert sparse.experts.down_proj_scale.shape == (6, 64, 1)  # [E, H, 1]
    assert sparse.gate.weight.dtype == torch.float32
    assert sparse.shared_expert is not None
    assert sparse.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    [prompt] = _prompts((20,))
    assert PagedBatch(model, [prompt]).step([(0, 0, 20)])[0].isfinite().all()
