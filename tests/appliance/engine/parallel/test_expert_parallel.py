"""Expert parallelism on the CPU (gloo): a mixture of experts on two processes, each holding half
of every sparse layer's experts (and half the shared expert's rows), gives the logits one
process gives (float32, within 1e-5) and the same greedy tokens, FP8 experts included; each
rank loads only its own experts (FP8 ones with their scales), from per-expert (Mixtral,
Qwen-MoE, an FP8 block checkpoint) and stacked (gpt-oss, dense and MXFP4) checkpoints;
an expert count the ranks do not divide is refused by name."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import EngineConfigError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.fused_experts import MXFP4_BLOCK
from appliance.engine.models.loader import load_model, parts_of
from appliance.engine.models.sealed_images import _needed_ranges
from appliance.engine.parallel.sharding import ShardPlan
from appliance.engine.sampling_params import SamplingParams
from tests.appliance.engine.models.conftest import build_hf_model, save_checkpoint
from tests.appliance.engine.models.test_fp8_experts import write_fp8_experts_checkpoint
from tests.appliance.engine.parallel.test_tensor_parallel import build_engine, compare, prompt_ids

# The engine tests' tiny mixtures of experts (6 experts, top 2; tests/.../models/conftest.py):
# Mixtral's per-expert tensors under its own names, with a window; Qwen3-MoE with a dense layer
# between sparse ones; Qwen2-MoE with its sigmoid-gated shared expert and q/k/v biases; gpt-oss's
# stacked experts with biases, its clamped SwiGLU, sinks and biased router.
VARIANTS = ["mixtral-window", "qwen3-moe", "qwen2-moe", "gpt-oss"]
# Qwen3-MoE with its experts alone FP8, in the block layout Qwen3-30B-A3B-FP8 ships
# (attention and the dense layer's MLP left in float32, so tensor parallelism splits nothing
# quantized and one process is the reference to 1e-5).
FP8_BLOCK = "qwen3-moe-fp8-block"
# Each rank's three experts of six.
HELD = {0: slice(0, 3), 1: slice(3, 6)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dirs = {v: save_checkpoint(build_hf_model(v), tmp_path_factory.mktemp(v)) for v in VARIANTS}
    dirs["gpt-oss-mxfp4"] = _with_mxfp4_experts(dirs["gpt-oss"], tmp_path_factory.mktemp("mxfp4"))
    dirs[FP8_BLOCK] = tmp_path_factory.mktemp("fp8-block") / "model"
    write_fp8_experts_checkpoint(dirs["qwen3-moe"], dirs[FP8_BLOCK], "block")
    return dirs


def _with_mxfp4_experts(source: Path, model_dir: Path) -> Path:
    """gpt-oss's checkpoint with its expert projections as OpenAI ships them: MXFP4 blocks and
    scales (random codes, scales 2^-4 .. 2^-1), [E, rows, cols / 32, 16] and [E, rows, cols / 32]
    with rows already ours (models.fused_experts)."""
    tensors = load_file(source / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        num_experts, cols, rows = tensors.pop(name).shape  # stored for x @ w: [E, in, out]
        groups = (num_experts, rows, cols // MXFP4_BLOCK)
        blocks = torch.randint(256, (*groups, MXFP4_BLOCK // 2), generator=generator)
        tensors[f"{name}_blocks"] = blocks.to(torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(123, 127, groups, generator=generator).to(
            torch.uint8
        )
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((source / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": []}
    (model_dir / "config.json").write_text(json.dumps(raw))
    return model_dir


# Attention, a dense layer's MLP, the embedding and lm_head: split as in a dense model.
_SPLIT_AS_DENSE = ("embed_tokens", "lm_head", ".self_attn.", ".mlp.gate_up_proj", ".mlp.down_proj")


def _expert_bytes(model: torch.nn.Module) -> int:
    return sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )


@pytest.mark.parametrize("variant", [*VARIANTS, "gpt-oss-mxfp4"])
def test_each_rank_loads_only_its_own_experts(checkpoints: dict[str, Path], variant: str) -> None:
    """Rank r's stacked experts (and gpt-oss's expert biases) are experts 3r .. 3r + 2 of the
    whole model's, exactly; its shared expert is its half of the rows (gate, up) and columns
    (down); router and norms are whole; its expert parameters are half the bytes."""
    model_dir = checkpoints[variant]
    whole = load_model(model_dir)
    whole_params = dict(whole.named_parameters())
    config = ModelConfig.from_model_dir(model_dir)
    for rank, held in HELD.items():
        model = load_model(model_dir, shard=ShardPlan.for_model(config, rank, 2))
        assert 2 * _expert_bytes(model) == _expert_bytes(whole)
        num_checked = 0
        for name, param in model.named_parameters():
            expected = whole_params[name]
            if ".experts." in name:
                expected = expected[held]
            elif ".shared_expert.gate_up_proj" in name:
                gate, up = expected.chunk(2)
                rows = slice(rank * gate.shape[0] // 2, (rank + 1) * gate.shape[0] // 2)
                expected = torch.cat((gate[rows], up[rows]))
            elif ".shared_expert.down_proj" in name:
                expected = expected.chunk(2, dim=1)[rank]
            elif any(part in name for part in _SPLIT_AS_DENSE):
                continue  # split as in a dense model (test_tensor_parallel)
            assert torch.equal(param, expected), name
            num_checked += ".experts." in name
        assert num_checked >= 2 * config.moe.num_moe_layers


@pytest.mark.parametrize("variant", ["mixtral-window", "gpt-oss-mxfp4"])
def test_a_sealed_rank_decrypts_no_byte_of_another_ranks_experts(
    checkpoints: dict[str, Path], variant: str
) -> None:
    """The byte ranges a sealed rank decrypts (SealedShardImages, from the loader's parts_of)
    hold none of rank 0's experts on rank 1, per-expert (Mixtral) or stacked (gpt-oss's MXFP4
    blocks and scales, their rows of experts 3..5 only)."""
    model_dir = checkpoints[variant]
    config = ModelConfig.from_model_dir(model_dir)
    raw = (model_dir / "model.safetensors").read_bytes()
    (header_size,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_size])
    header.pop("__metadata__", None)
    part_of = parts_of(ShardPlan.for_model(config, 1, 2), config.family.layout)
    ranges = _needed_ranges(raw[8 : 8 + header_size], 8 + header_size, part_of)
    wanted = bytearray(len(raw))
    for begin, end in ranges:
        wanted[begin:end] = b"\x01" * (end - begin)
    num_checked = 0
    for name, info in header.items():
        begin, end = (8 + header_size + offset for offset in info["data_offsets"])
        one_expert = re.search(r"\.experts\.(\d+)\.", name)
        if one_expert is not None:  # all of it, or none of it
            expected = b"\x01" if int(one_expert.group(1)) >= 3 else b"\x00"
            assert wanted[begin:end] == expected * (end - begin), name
        elif ".experts." in name:  # stacked: the second half of its experts' rows
            middle = (begin + end) // 2
            assert wanted[begin:middle] == bytes(middle - begin), name
            assert wanted[middle:end] == b"\x01" * (end - middle), name
        else:
            continue
        num_checked += 1
    assert num_checked >= 2 * config.num_layers


@pytest.fixture(scope="module", params=[*VARIANTS, FP8_BLOCK])
def engines(
    request: pytest.FixtureRequest, checkpoints: dict[str, Path]
) -> Iterator[tuple[Engine, Engine]]:
    """(one process, two processes) around the same tiny checkpoint, built once per variant."""
    model_dir = checkpoints[request.param]
    single = build_engine(model_dir, 1)
    parallel = build_engine(model_dir, 2)
    yield single, parallel
    parallel.close()


def test_prompt_logits_and_greedy_tokens_match_one_process(engines) -> None:
    """A 40-token prompt prefilled in chunks of 16 tokens beside a short one, every prompt
    position's logits, then decode steps; routing differs token by token, so both ranks' experts
    are in use."""
    params = SamplingParams(
        temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=1, logprobs=1
    )
    assert compare(engines, [prompt_ids(40), prompt_ids(6, offset=90)], params) >= 8


def test_decode_bursts_match_one_process(engines) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    assert compare(engines, [prompt_ids(5), prompt_ids(7, offset=11)], params) == 9


def test_an_expert_count_the_ranks_do_not_divide_is_refused_by_name(
    checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    shutil.copy(checkpoints["mixtral-window"] / "config.json", tmp_path / "config.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["num_local_experts"] = 5
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(EngineConfigError, match=r"does not divide the model's num_experts \(5\)"):
        EngineConfig(model_dir=tmp_path, tensor_parallel_size=2).start_workers()


@pytest.mark.parametrize(("variant", "quantization"), [(FP8_BLOCK, None), ("gpt-oss-mxfp4", "fp8")])
def test_each_rank_holds_only_its_own_fp8_experts_and_scales(
    checkpoints: dict[str, Path], variant: str, quantization
) -> None:
    """FP8 experts from a block checkpoint, or quantized on load from gpt-oss's MXFP4: rank r's
    FP8 bytes and scales are exactly its experts' of the whole model's, half the bytes."""
    model_dir = checkpoints[variant]
    whole = load_model(model_dir, quantization=quantization)
    whole_params = dict(whole.named_parameters())
    config = ModelConfig.from_model_dir(model_dir)
    for rank, held in HELD.items():
        model = load_model(model_dir, shard=ShardPlan.for_model(config, rank, 2),
                           quantization=quantization)  # fmt: skip
        assert 2 * _expert_bytes(model) == _expert_bytes(whole)
        scales = [(n, p) for n, p in model.named_parameters() if n.endswith("_proj_scale")]
        assert len(scales) == 2 * config.moe.num_moe_layers
        for name, param in model.named_parameters():
            if ".experts." in name:
                expected = whole_params[name][held]
                assert torch.equal(param.view(torch.uint8), expected.view(torch.uint8)), name
