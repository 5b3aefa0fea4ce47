"""The loader reads what transformers writes and refuses everything else with a ModelLoadError
that names the problem.

Each hostile directory is a copy of a good transformers-written checkpoint with one deliberate
defect, named by its test.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.loader import load_model, load_state_dict

from .conftest import build_hf_model, save_checkpoint


@pytest.fixture
def model_dir(tiny_checkpoints, tmp_path: Path) -> Path:
    """A private, writable copy of the Llama 2 style checkpoint."""
    source, _ = tiny_checkpoints("llama2")
    return Path(shutil.copytree(source, tmp_path / "model"))


def _rewrite_config(model_dir: Path, **changes) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


def _rewrite_weights(model_dir: Path, edit) -> None:
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _load_error(model_dir: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(model_dir)
    return str(info.value)


def test_load_rejects_a_model_dir_that_does_not_exist(tmp_path):
    message = _load_error(tmp_path / "nowhere")
    assert "nowhere" in message and "does not exist" in message


def test_load_rejects_a_dir_without_config_json(model_dir):
    (model_dir / "config.json").unlink()
    message = _load_error(model_dir)
    assert "config.json" in message and "missing" in message


def test_load_rejects_a_config_json_that_is_not_json(model_dir):
    (model_dir / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    message = _load_error(model_dir)
    assert "config.json" in message and "JSON" in message


@pytest.mark.parametrize("text", ["[1, 2]", '"LlamaForCausalLM"', "null"])
def test_load_rejects_a_config_json_that_is_json_but_not_an_object(model_dir, text):
    # Regression: this used to escape as AttributeError ('list' object has no attribute 'get').
    (model_dir / "config.json").write_text(text)
    message = _load_error(model_dir)
    assert "config.json" in message and "object" in message


def test_load_rejects_an_unsupported_architecture(model_dir):
    _rewrite_config(model_dir, architectures=["GPT2LMHeadModel"])
    message = _load_error(model_dir)
    assert "GPT2LMHeadModel" in message and "not supported" in message
    assert "LlamaForCausalLM" in message, "the message should list what is supported"


@pytest.mark.parametrize(
    ("changes", "rope_type"),
    [
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "mrope"),
        ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ],
)
def test_load_rejects_an_unsupported_rope_type(model_dir, changes, rope_type):
    _rewrite_config(model_dir, **changes)
    message = _load_error(model_dir)
    assert repr(rope_type) in message and "not supported" in message


def test_load_rejects_a_safetensors_file_of_garbage(model_dir):
    (model_dir / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    message = _load_error(model_dir)
    assert "model.safetensors" in message and "not a valid safetensors file" in message


def test_load_rejects_a_truncated_safetensors_file(model_dir):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    message = _load_error(model_dir)
    assert "model.safetensors" in message and "not a valid safetensors file" in message


def test_load_rejects_a_dir_without_weights(model_dir):
    (model_dir / "model.safetensors").unlink()
    message = _load_error(model_dir)
    assert "no model.safetensors" in message


@pytest.mark.parametrize(
    ("tensor", "reported"),
    [
        ("model.layers.1.self_attn.k_proj.weight", r"layers\.1\.self_attn\.(k|qkv)_proj"),
        ("model.layers.0.mlp.up_proj.weight", r"layers\.0\.mlp\.(up|gate_up)_proj"),
        ("model.norm.weight", r"norm\.weight"),
        ("lm_head.weight", r"lm_head"),
    ],
)
def test_load_rejects_a_checkpoint_missing_a_tensor(model_dir, tensor, reported):
    _rewrite_weights(model_dir, lambda tensors: tensors.pop(tensor))
    with pytest.raises(ModelLoadError, match=reported) as info:
        load_model(model_dir)
    assert "lacks" in str(info.value)


@pytest.mark.parametrize(
    ("tensor", "shape"),
    [
        ("model.layers.0.mlp.down_proj.weight", (64, 100)),
        ("model.layers.1.self_attn.v_proj.weight", (64, 64)),  # 4 KV heads, not 2
        ("model.embed_tokens.weight", (300, 64)),
    ],
)
def test_load_rejects_a_tensor_with_the_wrong_shape(model_dir, tensor, shape):
    _rewrite_weights(model_dir, lambda tensors: tensors.update({tensor: torch.zeros(shape)}))
    message = _load_error(model_dir)
    assert repr(tensor) in message and str(shape) in message


@pytest.mark.parametrize(
    "tensor", ["model.layers.0.mlp.extra_proj.weight", "model.layers.7.input_layernorm.weight"]
)
def test_load_rejects_an_unexpected_extra_tensor(model_dir, tensor):
    _rewrite_weights(model_dir, lambda tensors: tensors.update({tensor: torch.zeros(64)}))
    message = _load_error(model_dir)
    assert repr(tensor) in message and "unexpected" in message


def test_load_ignores_a_stored_rotary_inv_freq_buffer(model_dir):
    """Older checkpoints carry `rotary_emb.inv_freq`; it is recomputed, never an error."""
    name = "model.layers.0.self_attn.rotary_emb.inv_freq"
    _rewrite_weights(model_dir, lambda tensors: tensors.update({name: torch.ones(8)}))
    load_model(model_dir)


def _expected_parameters(checkpoint: dict[str, torch.Tensor], num_layers: int) -> dict:
    """Our parameter names and values, written out by hand from the checkpoint's names."""
    expected = {
        "embed_tokens.weight": checkpoint["model.embed_tokens.weight"],
        "norm.weight": checkpoint["model.norm.weight"],
        "lm_head": checkpoint["lm_head.weight"],
    }
    for i in range(num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        expected[ours + "self_attn.qkv_proj.weight"] = torch.cat(
            [checkpoint[attn + f"{p}_proj.weight"] for p in "qkv"]
        )
        expected[ours + "self_attn.o_proj.weight"] = checkpoint[attn + "o_proj.weight"]
        expected[ours + "mlp.gate_up_proj.weight"] = torch.cat(
            [checkpoint[mlp + "gate_proj.weight"], checkpoint[mlp + "up_proj.weight"]]
        )
        expected[ours + "mlp.down_proj.weight"] = checkpoint[mlp + "down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            expected[ours + f"{norm}.weight"] = checkpoint[theirs + f"{norm}.weight"]
    return expected


def test_load_converts_float32_checkpoint_to_bfloat16_with_round_to_nearest(model_dir):
    checkpoint = load_file(model_dir / "model.safetensors")
    assert all(t.dtype == torch.float32 for t in checkpoint.values())
    model = load_model(model_dir, dtype=torch.bfloat16)
    ours = dict(model.named_parameters())
    expected = _expected_parameters(checkpoint, model.config.num_layers)
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert ours[name].dtype == torch.bfloat16, name
        assert torch.equal(ours[name], value.to(torch.bfloat16)), name
    # The conversion really rounds: bf16 cannot hold these float32 weights exactly.
    assert not torch.equal(ours["embed_tokens.weight"].float(), expected["embed_tokens.weight"])


def test_a_load_imports_no_sympy(model_dir):
    """Torch's `empty_like` of a meta tensor imports sympy (up to 0.3 s of the sealed start, W5):
    the loader allocates without it. A fresh interpreter, since this one has imported it
    already."""
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "import torch\n"
        "from appliance.engine.models.loader import load_model\n"
        f"model = load_model(Path({str(model_dir)!r}), dtype=torch.bfloat16)\n"
        "assert model.embed_tokens.weight.abs().sum() > 0\n"
        "print('sympy' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[4],
    )
    assert out.stdout.strip() == "False"


def test_load_reads_a_sharded_checkpoint_like_the_single_file_one(model_dir, tmp_path):
    hf_model = build_hf_model("llama2")  # same seed, same weights as `model_dir`
    sharded_dir = save_checkpoint(hf_model, tmp_path / "sharded", max_shard_size="100KB")
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert not (sharded_dir / "model.safetensors").exists()
    sharded = dict(load_model(sharded_dir).named_parameters())
    single = dict(load_model(model_dir).named_parameters())
    assert sharded.keys() == single.keys()
    for name, value in single.items():
        assert torch.equal(sharded[name], value), name


def test_load_rejects_a_sharded_checkpoint_with_a_missing_shard(tmp_path):
    sharded_dir = save_checkpoint(
        build_hf_model("llama2"), tmp_path / "sharded", max_shard_size="100KB"
    )
    shard = sorted(sharded_dir.glob("model-*.safetensors"))[-1]
    shard.unlink()
    message = _load_error(sharded_dir)
    assert shard.name in message


def test_load_rejects_a_shard_index_that_is_not_json(model_dir):
    (model_dir / "model.safetensors.index.json").write_text("{not json")
    message = _load_error(model_dir)
    assert "model.safetensors.index.json" in message and "index" in message


def _sharded(tmp_path) -> Path:
    return save_checkpoint(build_hf_model("llama2"), tmp_path / "sharded", max_shard_size="100KB")


def _point_index_at(model_dir: Path, file_name: str) -> None:
    path = model_dir / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = file_name
    path.write_text(json.dumps(index))


@pytest.mark.parametrize("file_name", ["../outside.safetensors", "/etc/passwd", "."])
def test_load_refuses_a_shard_index_naming_a_file_outside_the_model_dir(tmp_path, file_name):
    sharded_dir = _sharded(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes(
        (sorted(sharded_dir.glob("model-*.safetensors"))[0]).read_bytes()
    )
    _point_index_at(sharded_dir, file_name)
    message = _load_error(sharded_dir)
    assert repr(file_name) in message and "outside the model directory" in message


def test_load_refuses_a_shard_that_is_a_symlink_out_of_the_model_dir(tmp_path):
    sharded_dir = _sharded(tmp_path)
    shard = sorted(sharded_dir.glob("model-*.safetensors"))[0]
    outside = tmp_path / "elsewhere.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    message = _load_error(sharded_dir)
    assert shard.name in message and "outside the model directory" in message


def test_load_refuses_an_oversized_shard_index_before_reading_it(tmp_path):
    sharded_dir = _sharded(tmp_path)
    with open(sharded_dir / "model.safetensors.index.json", "r+b") as f:
        f.truncate(65 << 20)  # sparse: no 65 MiB written
    message = _load_error(sharded_dir)
    assert "model.safetensors.index.json" in message and "MiB" in message


# The FP8 KV-cache scales of FP8 checkpoints, by each name their tools write: the checkpoint
# name inside layer 1, and which of (k_scale, v_scale) it sets.
KV_SCALE_NAMES = [
    ("self_attn.k_scale", (0.25, 1.0)),
    ("self_attn.v_scale", (1.0, 0.25)),
    ("self_attn.k_proj.output_scale", (0.25, 1.0)),
    ("self_attn.v_proj.output_scale", (1.0, 0.25)),
    ("self_attn.k_proj.k_scale", (0.25, 1.0)),
    ("self_attn.v_proj.v_scale", (1.0, 0.25)),
    ("self_attn.kv_scale", (0.25, 0.25)),
]


@pytest.mark.parametrize(("name", "expected"), KV_SCALE_NAMES, ids=[n for n, _ in KV_SCALE_NAMES])
def test_load_reads_a_kv_cache_scale_by_each_name_fp8_checkpoints_use(model_dir, name, expected):
    tensor = f"model.layers.1.{name}"
    _rewrite_weights(model_dir, lambda tensors: tensors.update({tensor: torch.tensor(0.25)}))
    model = load_model(model_dir, dtype=torch.bfloat16)
    for index, layer in enumerate(model.layers):
        attn = layer.self_attn
        # float32 whatever the weights' dtype; other layers keep the default of 1.
        assert attn.k_scale.dtype == attn.v_scale.dtype == torch.float32
        scales = (attn.k_scale.item(), attn.v_scale.item())
        assert scales == (expected if index == 1 else (1.0, 1.0))


@pytest.mark.parametrize(
    ("value", "reported"),
    [
        (torch.tensor(0.0), "must be positive and finite"),
        (torch.tensor(float("nan")), "must be positive and finite"),
        (torch.tensor([0.5, 0.25]), "only one scale per tensor"),
    ],
    ids=["zero", "nan", "per-head"],
)
def test_load_rejects_a_kv_cache_scale_it_cannot_use(model_dir, value, reported):
    tensor = "model.layers.0.self_attn.k_scale"
    _rewrite_weights(model_dir, lambda tensors: tensors.update({tensor: value}))
    message = _load_error(model_dir)
    assert repr(tensor) in message and reported in message


def _config_of(hf_model) -> ModelConfig:
    raw = hf_model.config.to_dict()
    raw["architectures"] = [type(hf_model).__name__]
    return ModelConfig.from_dict(raw)


def test_load_state_dict_of_a_transformers_moe_equals_loading_its_saved_checkpoint(
    tiny_checkpoints,
):
    """transformers 5 holds Qwen3-MoE's experts stacked in memory and saves them per expert:
    both name the same weights, and the loader maps both onto the same parameters."""
    model_dir, hf_model = tiny_checkpoints("qwen3-moe")
    from_files = dict(load_model(model_dir).named_parameters())
    from_memory = dict(
        load_state_dict(_config_of(hf_model), hf_model.state_dict()).named_parameters()
    )
    assert from_memory.keys() == from_files.keys()
    for name, value in from_files.items():
        assert torch.equal(from_memory[name], value), name


def test_load_state_dict_refuses_a_missing_tensor_naming_it(tiny_checkpoints):
    _, hf_model = tiny_checkpoints("llama2")
    state = dict(hf_model.state_dict())
    del state["model.layers.1.mlp.down_proj.weight"]
    with pytest.raises(ModelLoadError, match=r"the state dict: .*layers\.1\.mlp\.down_proj"):
        load_state_dict(_config_of(hf_model), state)


def test_load_state_dict_refuses_an_unexpected_tensor_naming_it(tiny_checkpoints):
    _, hf_model = tiny_checkpoints("llama2")
    state = {**hf_model.state_dict(), "model.layers.0.mlp.extra.weight": torch.ones(2)}
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra"):
        load_state_dict(_config_of(hf_model), state)


@pytest.mark.parametrize("name", ["gemma3", "qwen3.5"])
def test_zero_centred_norms_keep_one_plus_w_in_float32_in_a_bf16_model(tiny_checkpoints, name):
    """Gemma's and Qwen3.5's `1 + w`: float32, exactly the checkpoint's w plus one, so the
    kernels scale as transformers does (kernels.reference.rms_norm); the rest is bf16, and
    Qwen3.5's gated norm (a plain w) too."""
    model_dir, _ = tiny_checkpoints(name)
    stored = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    model = load_model(model_dir, dtype=torch.bfloat16)
    norms = {n: p for n, p in model.named_parameters() if n.endswith("norm.weight")}
    offset = {n: p for n, p in norms.items() if not n.endswith("linear_attn.norm.weight")}
    assert offset and all(p.dtype == torch.float32 for p in offset.values())
    final = stored["model.norm.weight"].float()
    assert torch.equal(offset["norm.weight"], final + 1.0)
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.bfloat16
    gated = [p for n, p in norms.items() if n.endswith("linear_attn.norm.weight")]
    assert all(p.dtype == torch.bfloat16 for p in gated)
    assert bool(gated) == (name == "qwen3.5")
