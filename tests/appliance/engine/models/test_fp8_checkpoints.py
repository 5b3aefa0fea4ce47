"""FP8 checkpoints in the layouts vLLM serves, written here from a tiny transformers checkpoint,
load into FP8 projections that stand for exactly the weights the checkpoint stands for; an
unquantized checkpoint is quantized on load; unsupported configs are refused by field.

Each layout is written as its producer writes it (llm-compressor's compressed-tensors with
channel or tensor weight scales, dynamic or static activations; the "fp8" block layout of
Qwen3-FP8 / DeepSeek-V3 with `weight_scale_inv`), so the reference is the checkpoint's own
dequantization: q * scale, per row, per tensor or per block.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kernels.reference
from appliance.engine.errors import ModelLoadError
from appliance.engine.models.inspection import inspect_model
from appliance.engine.models.loader import load_model, parts_of
from appliance.engine.models.projections import Fp8Linear
from appliance.engine.models.sealed_images import SealedImages, SealedShardImages
from appliance.engine.parallel.sharding import ShardPlan
from attestation.sealed import SealedModel
from kernels.fp8 import FP8_DTYPE, FP8_MAX, dequantize_blocks, quantize_rows
from tests.attestation.sealed.conftest import seal

from .test_architectures import SEQ_LENS, PagedBatch, _hf_logits, _prompts

_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Blocks that split the tiny model's widths (64, 128) into whole and partial blocks; and
# blocks that two tensor-parallel ranks split on their edges.
BLOCK = (16, 48)
TP_BLOCK = (16, 32)


def _is_projection(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in _MODULES


def _per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = weight.float().abs().max() / FP8_MAX
    return (weight.float() / scale).to(FP8_DTYPE), scale.reshape(1)


def _per_block(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    (bn, bk), (n, k) = block, weight.shape
    scales = torch.empty(-(-n // bn), -(-k // bk))
    q = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = weight[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk].float()
            scales[i, j] = tile.abs().max() / FP8_MAX
            q[i * bn : (i + 1) * bn, j * bk : (j + 1) * bk] = (tile / scales[i, j]).to(FP8_DTYPE)
    return q, scales


def _ct_config(strategy: str, static: bool) -> dict:
    inputs = (
        {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}
        if static
        else {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True}
    )
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"type": "float", "num_bits": 8, "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": inputs,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }  # fmt: skip


def _block_config(block: tuple[int, int]) -> dict:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": list(block),
    }


LAYOUTS = {
    "ct-channel": _ct_config("channel", static=False),
    "ct-tensor": _ct_config("tensor", static=False),
    "ct-tensor-static": _ct_config("tensor", static=True),
    "fp8-block": _block_config(BLOCK),
    "fp8-block-tp": _block_config(TP_BLOCK),
}


def write_fp8_checkpoint(source: Path, out: Path, layout: str) -> dict[str, torch.Tensor]:
    """`source` quantized as `layout` into `out`; returns each projection's dequantized weight
    (the checkpoint's meaning) by checkpoint module name."""
    shutil.copytree(source, out)
    tensors = load_file(source / "model.safetensors")
    written, meaning = {}, {}
    for index, (name, tensor) in enumerate(sorted(tensors.items())):
        if not _is_projection(name):
            written[name] = tensor
            continue
        module = name.removesuffix(".weight")
        if layout == "ct-channel":
            q, scale = quantize_rows(tensor)
            written[f"{module}.weight_scale"] = scale[:, None].to(torch.bfloat16)
            meaning[module] = q.float() * scale.to(torch.bfloat16).float()[:, None]
        elif layout.startswith("fp8-block"):
            block = tuple(LAYOUTS[layout]["weight_block_size"])
            q, scale = _per_block(tensor, block)
            written[f"{module}.weight_scale_inv"] = scale
            meaning[module] = dequantize_blocks(q, scale, block)
        else:
            q, scale = _per_tensor(tensor)
            written[f"{module}.weight_scale"] = scale
            meaning[module] = q.float() * scale
            if layout == "ct-tensor-static":
                # Different in q, k and v, so the fused projection must keep the largest; wide
                # enough (inputs up to ~22) that these models' activations do not saturate.
                written[f"{module}.input_scale"] = torch.tensor([0.05 + 0.01 * (index % 3)])
        written[name] = q
    save_file(written, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = LAYOUTS[layout]
    (out / "config.json").write_text(json.dumps(config))
    return meaning


@pytest.fixture(scope="module")
def fp8_checkpoints(tiny_checkpoints, tmp_path_factory):
    """layout -> (directory, dequantized projections, transformers' model), written once."""
    cache: dict[str, tuple[Path, dict[str, torch.Tensor], torch.nn.Module]] = {}

    def get(layout: str) -> tuple[Path, dict[str, torch.Tensor], torch.nn.Module]:
        if layout not in cache:
            source, hf_model = tiny_checkpoints("qwen2")  # q/k/v biases ride along
            out = tmp_path_factory.mktemp(layout) / "model"
            cache[layout] = (out, write_fp8_checkpoint(source, out, layout), hf_model)
        return cache[layout]

    return get


def _dequantized(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Our FP8 projections' weights as the checkpoint names them (fused ones split back)."""
    out = {}
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        sizes = {"qkv": [attn.q_size, attn.kv_size, attn.kv_size], "gate_up": [mlp_size(mlp)] * 2}
        parts = {
            "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"), sizes["qkv"]),
            "self_attn.o_proj": (("o_proj",), None),
            "mlp.gate_up_proj": (("gate_proj", "up_proj"), sizes["gate_up"]),
            "mlp.down_proj": (("down_proj",), None),
        }
        for ours, (names, split) in parts.items():
            module = model.get_submodule(f"layers.{i}.{ours}")
            assert isinstance(module, Fp8Linear), ours
            weight = module.weight.float() * module.weight_scale[:, None]
            pieces = weight.split(split) if split else [weight]
            prefix = f"model.layers.{i}.{ours.split('.')[0]}"
            out.update({f"{prefix}.{n}": p for n, p in zip(names, pieces, strict=True)})
    return out


def mlp_size(mlp: torch.nn.Module) -> int:
    return mlp.down_proj.in_features


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "ct-tensor-static"])
def test_scaled_layouts_load_exactly_the_weights_the_checkpoint_holds(fp8_checkpoints, layout):
    model_dir, meaning, _ = fp8_checkpoints(layout)
    ours = _dequantized(load_model(model_dir))
    assert ours.keys() == meaning.keys()
    for name, weight in meaning.items():
        assert torch.equal(ours[name], weight), name


def test_static_input_scales_of_a_fused_projection_keep_the_largest(fp8_checkpoints):
    model_dir, _, _ = fp8_checkpoints("ct-tensor-static")
    tensors = load_file(model_dir / "model.safetensors")
    model = load_model(model_dir)
    for i, layer in enumerate(model.layers):
        scales = [tensors[f"model.layers.{i}.self_attn.{m}_proj.input_scale"] for m in "qkv"]
        assert torch.equal(layer.self_attn.qkv_proj.input_scale, torch.stack(scales).amax(0))


def test_block_layout_is_requantized_per_row_within_one_fp8_rounding(fp8_checkpoints):
    model_dir, meaning, _ = fp8_checkpoints("fp8-block")
    ours = _dequantized(load_model(model_dir))
    for name, weight in meaning.items():
        # Requantizing a row against its largest block rounds each value once more: at most
        # half an e4m3 step (2^-4 relative) of the value, or of the smallest subnormal.
        row_scale = weight.abs().amax(1, keepdim=True) / FP8_MAX
        bound = torch.maximum(weight.abs() * 2**-4, row_scale * 2**-10) + 1e-12
        assert ((ours[name] - weight).abs() <= bound).all(), name


def test_the_block_layout_written_here_is_the_one_transformers_reads(fp8_checkpoints):
    """transformers' FineGrainedFP8 integration, dequantizing on the CPU, reads the block
    checkpoint as the reference here does (weight_scale_inv multiplies its block), and our
    load stays within one rounding of it. (transformers needs whole blocks: the 16x32 layout.)"""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model_dir, meaning, _ = fp8_checkpoints("fp8-block-tp")
    theirs = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        quantization_config=FineGrainedFP8Config(dequantize=True, weight_block_size=TP_BLOCK),
    )
    ours = _dequantized(load_model(model_dir))
    for name, weight in meaning.items():
        reference = theirs.get_submodule(name).weight
        assert torch.equal(reference, weight), name
        row_scale = weight.abs().amax(1, keepdim=True) / FP8_MAX
        bound = torch.maximum(weight.abs() * 2**-4, row_scale * 2**-10) + 1e-12
        assert ((ours[name] - reference).abs() <= bound).all(), name


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor", "ct-tensor-static", "fp8-block"])
def test_fp8_logits_follow_transformers_on_the_dequantized_weights(fp8_checkpoints, layout):
    """Our W8A8 forward against transformers' float32 forward of the weights the checkpoint
    stands for. What is left is our FP8 activations, rounded per token as finely as the
    weights were rounded per channel, so their effect is of the size of the weights' own
    quantization (transformers on the original weights vs the dequantized ones): within twice
    it. (These tiny random models amplify rounding: both are ~1 logit; a missing scale or a
    wrong fused slice is tens.) Their forward with the dequantized weights in float32 matches
    transformers' to 1e-5 (checked when this test was written)."""
    model_dir, meaning, hf_model = fp8_checkpoints(layout)
    hf_fp8 = type(hf_model)(hf_model.config).eval()
    hf_fp8.load_state_dict(hf_model.state_dict())
    with torch.no_grad():
        for name, weight in meaning.items():
            hf_fp8.get_submodule(name).weight.copy_(weight)
    prompts = _prompts(SEQ_LENS[1:])
    logits = PagedBatch(load_model(model_dir), prompts).step(
        [(i, 0, len(p)) for i, p in enumerate(prompts)]
    )
    for ours, prompt in zip(logits, prompts, strict=True):
        theirs = _hf_logits(hf_fp8, prompt)
        weights_error = (_hf_logits(hf_model, prompt) - theirs).abs().max().item()
        error = (ours - theirs).abs().max().item()
        assert error < 2 * weights_error, f"max |logit error| {error} vs {weights_error}"


@pytest.mark.parametrize("layout", ["ct-channel", "ct-tensor-static"])
def test_the_norms_quantize_for_the_projections_that_read_them(fp8_checkpoints, layout):
    """Every norm with an FP8 projection as its one reader (a layer's qkv, its gate/up) hands
    it rows quantized for that projection (`KernelOps.add_rms_norm`'s `quantize_for`: on the
    GPU no quantization kernel and no row in the model's dtype), the first layer's plain norm
    and the final norm none. The logits are exactly those of rows the projections quantize
    themselves, each with its own static input scale (q, k and v's differ from gate and up's)."""
    model_dir, _, _ = fp8_checkpoints(layout)
    model = load_model(model_dir)
    prompts = _prompts(SEQ_LENS[1:])
    chunks = [(i, 0, len(p)) for i, p in enumerate(prompts)]
    add_rms_norm = kernels.reference.add_rms_norm
    asked = []

    def recording(x, residual, weight, eps, quantize_for=None):
        asked.append(quantize_for)
        return add_rms_norm(x, residual, weight, eps, quantize_for)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels.reference, "add_rms_norm", recording)
        fused = PagedBatch(model, prompts).step(chunks)
    projections = [(layer.self_attn.qkv_proj, layer.mlp.gate_up_proj) for layer in model.layers]
    expected = [projections[0][1], *(p for pair in projections[1:] for p in pair)]
    assert [w.weight for w in asked[:-1]] == [p.weight for p in expected]
    assert [w.input_scale for w in asked[:-1]] == [p.input_scale for p in expected]
    assert asked[-1] is None

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            kernels.reference,
            "add_rms_norm",
            lambda x, residual, weight, eps, quantize_for=None: add_rms_norm(
                x, residual, weight, eps
            ),
        )
        unfused = PagedBatch(model, prompts).step(chunks)
    for ours, theirs in zip(fused, unfused, strict=True):
        assert torch.equal(ours, theirs)


def test_quantize_on_load_holds_each_row_within_one_fp8_rounding(tiny_checkpoints):
    model_dir, _ = tiny_checkpoints("qwen2")
    original = {
        name.removesuffix(".weight"): w
        for name, w in load_file(model_dir / "model.safetensors").items()
        if _is_projection(name)
    }
    model = load_model(model_dir, quantization="fp8")
    assert model.embed_tokens.weight.dtype == torch.float32, "embeddings stay unquantized"
    for name, weight in _dequantized(model).items():
        reference = original[name]
        q, scale = quantize_rows(reference)
        assert torch.equal(weight, q.float() * scale[:, None]), name
        bound = torch.maximum(reference.abs() * 2**-4, scale[:, None] * 2**-10)
        assert ((weight - reference).abs() <= bound + 1e-12).all(), name


def test_fp8_checkpoint_under_tensor_parallelism_splits_weights_and_scales(fp8_checkpoints):
    """Each rank's FP8 rows and scales are exactly its rows of the whole model's (per-channel
    scales follow rows; a row-parallel weight's are whole; block grids follow blocks)."""
    for layout in ("ct-channel", "fp8-block-tp"):
        model_dir, _, _ = fp8_checkpoints(layout)
        whole = load_model(model_dir)
        for rank in range(2):
            part = load_model(model_dir, shard=ShardPlan(rank, 2))
            attn, whole_attn = part.layers[0].self_attn, whole.layers[0].self_attn
            q_rows = slice(rank * attn.q_size, (rank + 1) * attn.q_size)
            if layout == "ct-channel":  # block requantization sees fewer columns per rank
                assert torch.equal(attn.qkv_proj.weight_scale[: attn.q_size],
                                   whole_attn.qkv_proj.weight_scale[q_rows])  # fmt: skip
            ours = attn.o_proj.weight.float() * attn.o_proj.weight_scale[:, None]
            theirs = whole_attn.o_proj.weight.float() * whole_attn.o_proj.weight_scale[:, None]
            columns = slice(rank * attn.q_size, (rank + 1) * attn.q_size)
            assert torch.allclose(ours, theirs[:, columns], rtol=2**-3, atol=1e-3)


def test_block_layout_refuses_a_tensor_parallel_split_inside_a_block(fp8_checkpoints):
    model_dir, _, _ = fp8_checkpoints("fp8-block")
    # Rank 1's down_proj columns start at column 64, inside the second 48-wide block.
    with pytest.raises(ModelLoadError, match=r"down_proj: .* column 64, inside a 16x48 block"):
        load_model(model_dir, shard=ShardPlan(1, 2))


Edit = Callable[[dict], None]


def _set(path: tuple[str, ...], value: object) -> Edit:
    def edit(config: dict) -> None:
        section = config
        for key in path[:-1]:
            section = section[key]
        section[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("layout", "edit", "named"),
    [
        ("ct-channel", _set(("quant_method",), "awq"), "quant_method 'awq'"),
        ("ct-channel", _set(("format",), "pack-quantized"), "format 'pack-quantized'"),
        ("ct-channel", _set(("config_groups", "group_0", "weights", "num_bits"), 4), "num_bits 4"),
        ("ct-channel", _set(("config_groups", "group_0", "weights", "type"), "int"), "type 'int'"),
        ("ct-channel", _set(("config_groups", "group_0", "weights", "strategy"), "group"),
         "strategy 'group'"),
        ("ct-channel", _set(("config_groups", "group_0", "input_activations"), None),
         "weight-only FP8"),
        ("ct-channel", _set(("config_groups", "group_0", "targets"), ["re:.*q_proj"]), "targets"),
        ("ct-channel", _set(("kv_cache_scheme",), {"num_bits": 8}), "kv_cache_scheme"),
        ("ct-channel", _set(("ignore",), ["model.layers.0.self_attn.q_proj"]),
         "only some of layer 0's"),
        ("fp8-block", _set(("fmt",), "e5m2"), "fmt 'e5m2'"),
        ("fp8-block", _set(("weight_block_size",), [128]), "weight_block_size [128]"),
        ("fp8-block", _set(("activation_scheme",), "static"), "activation_scheme 'static'"),
    ],
)  # fmt: skip
def test_unsupported_quantization_configs_are_refused_by_field(
    fp8_checkpoints, tmp_path, layout, edit, named
):
    source, _, _ = fp8_checkpoints(layout)
    model_dir = Path(shutil.copytree(source, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    edit(config["quantization_config"])
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="quantization_config") as info:
        load_model(model_dir)
    assert named in str(info.value)


def test_a_checkpoint_whose_weights_disagree_with_its_config_is_refused(tiny_checkpoints, tmp_path):
    source, _ = tiny_checkpoints("qwen2")
    model_dir = Path(shutil.copytree(source, tmp_path / "model"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = LAYOUTS["ct-channel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"does not match its config\.json"):
        load_model(model_dir)


@pytest.mark.parametrize(
    ("layout", "described"),
    [
        ("ct-tensor-static", "FP8 e4m3 projections, tensor weight scales, static input scales"),
        ("fp8-block", "FP8 e4m3 projections, block weight scales in 16x48 blocks, per-token"),
    ],
)
def test_inspect_serves_an_fp8_checkpoint_and_names_its_layout(fp8_checkpoints, layout, described):
    """The dry run (headers only, on the meta device) passes the FP8 checks of the real load."""
    model_dir, _, _ = fp8_checkpoints(layout)
    report = inspect_model(model_dir)
    fields = dict(report.lines)
    assert report.unsupported is None, report.unsupported
    assert fields["quantization"].startswith(described)
    assert "F8_E4M3" in fields["dtype"]


@pytest.mark.parametrize("layout", ["ct-channel", "fp8-block-tp"])
def test_a_sealed_fp8_checkpoint_loads_as_its_files_do(fp8_checkpoints, tmp_path, layout):
    """F8_E4M3 tensors seal, and decrypt into the same model, whole or one rank's part."""
    model_dir, _, _ = fp8_checkpoints(layout)
    fixture = seal(model_dir, tmp_path / "sealed")
    sealed = SealedModel.open(fixture.sealed, manifest_key=fixture.public_key)
    with SealedImages(sealed, fixture.data_key, torch.device("cpu"), workers=2) as images:
        _assert_same_bytes(load_model(fixture.sealed, weights=images), load_model(model_dir))
    plan = ShardPlan(1, 2)
    with SealedShardImages(sealed, fixture.data_key, parts_of(plan), workers=2) as images:
        _assert_same_bytes(
            load_model(fixture.sealed, weights=images, shard=plan),
            load_model(model_dir, shard=plan),
        )


def _assert_same_bytes(a: torch.nn.Module, b: torch.nn.Module) -> None:
    params_b = dict(b.named_parameters())
    assert params_b.keys() == dict(a.named_parameters()).keys()
    for name, param in a.named_parameters():
        assert torch.equal(param.view(torch.uint8), params_b[name].view(torch.uint8)), name


def test_the_cpu_engine_decodes_an_fp8_checkpoint_as_a_fresh_prefill_reads_it(fp8_checkpoints):
    """Continuous batching, the paged KV cache and sampling over FP8 projections: each greedy
    token is the argmax of a one-pass prefill of everything before it (activations are
    quantized per token, so batching changes nothing but float32 summation order)."""
    from appliance.engine.engine import Engine
    from appliance.engine.engine_config import EngineConfig
    from appliance.engine.sampling_params import SamplingParams

    model_dir, _, _ = fp8_checkpoints("ct-channel")
    model = load_model(model_dir)
    config = EngineConfig(model_dir=model_dir, num_kv_blocks=64, num_cpu_threads=1)
    engine = Engine.build(config, model, tokenizer=None)
    prompts = _prompts((23, 9))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    completions = engine.generate(prompts, greedy)
    full = [p + c.token_ids for p, c in zip(prompts, completions, strict=True)]
    logits = PagedBatch(model, full).step([(i, 0, len(t)) for i, t in enumerate(full)])
    for prompt, tokens, lg in zip(prompts, full, logits, strict=True):
        assert lg[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens[len(prompt) :]


def test_random_weights_are_fp8_when_asked_or_when_the_checkpoint_is(fp8_checkpoints, tmp_path):
    """Warm-up and benchmarks draw random weights: FP8 ones for an FP8 model, so the kernels
    they compile are those it will run."""
    from appliance.engine.models.loader import random_model
    from kernels import reference

    model_dir, _, _ = fp8_checkpoints("ct-channel")
    config = json.loads((model_dir / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    for directory, quantization in [(model_dir, None), (tmp_path, "fp8")]:
        model = random_model(
            directory, dtype=torch.float32, device="cpu", ops=reference, quantization=quantization
        )
        assert isinstance(model.layers[0].mlp.down_proj, Fp8Linear)
        assert model.embed_tokens.weight.dtype == torch.float32
    plain = random_model(tmp_path, dtype=torch.float32, device="cpu", ops=reference)
    assert isinstance(plain.layers[0].mlp.down_proj, torch.nn.Linear)
