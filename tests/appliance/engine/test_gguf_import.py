"""GGUF → HF directory import, checked against transformers' own GGUF loader.

transformers (a test-only dependency) reads the same GGUF with `gguf.quants.dequantize` and its
`LlamaTensorProcessor`, so every tensor must match bit for bit, not merely closely.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from appliance.engine.errors import EngineError, ModelLoadError
from appliance.engine.models import gguf_import
from appliance.engine.models.gguf_import import _reverse_qk_permutation, import_gguf


@pytest.fixture(scope="module")
def transformers_model(smollm2_gguf: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, torch_dtype=torch.float32
    )


@pytest.fixture(scope="module")
def imported_state_dict(smollm2_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(smollm2_dir / "model.safetensors"))


def _write_tiny_llama_gguf(
    path: Path,
    *,
    architecture: str = "llama",
    tensor_type: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32,
) -> None:
    """A one-layer Llama GGUF with random weights; `tensor_type` applies to attn_q only."""
    hidden, heads, kv_heads, inter, vocab = 32, 4, 2, 64, 8
    head_dim = hidden // heads
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(["<s>", "a", "b", "ab", "Ġ", "c", "d", "e"])
    writer.add_token_types([3, 1, 1, 1, 1, 1, 1, 1])
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (vocab, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (heads * head_dim, hidden),
        "blk.0.attn_k.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_v.weight": (kv_heads * head_dim, hidden),
        "blk.0.attn_output.weight": (hidden, heads * head_dim),
        "blk.0.ffn_gate.weight": (inter, hidden),
        "blk.0.ffn_up.weight": (inter, hidden),
        "blk.0.ffn_down.weight": (hidden, inter),
    }
    for name, shape in shapes.items():
        data = rng.standard_normal(shape).astype(np.float32)
        if name == "blk.0.attn_q.weight" and tensor_type != gguf.GGMLQuantizationType.F32:
            block_size, type_size = gguf.GGML_QUANT_SIZES[tensor_type]
            raw = np.zeros((shape[0], shape[1] // block_size * type_size), dtype=np.uint8)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=tensor_type)
        else:
            writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_import_writes_every_hf_model_file(smollm2_dir: Path) -> None:
    names = {path.name for path in smollm2_dir.iterdir()}

    assert names == {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    }


def test_imported_tensors_have_transformers_names_and_shapes(
    imported_state_dict: dict[str, torch.Tensor], transformers_model: torch.nn.Module
) -> None:
    # transformers' state_dict also lists lm_head.weight, the tied embedding matrix itself.
    expected = {
        name: tuple(tensor.shape)
        for name, tensor in transformers_model.state_dict().items()
        if name != "lm_head.weight"
    }

    assert {name: tuple(t.shape) for name, t in imported_state_dict.items()} == expected


def test_imported_tensors_are_bit_identical_to_transformers_gguf_loader(
    imported_state_dict: dict[str, torch.Tensor], transformers_model: torch.nn.Module
) -> None:
    reference = transformers_model.state_dict()
    mismatched = [
        name
        for name, tensor in imported_state_dict.items()
        if tensor.dtype != torch.float32 or not torch.equal(tensor, reference[name])
    ]

    assert mismatched == []


def test_tied_embeddings_are_stored_once_without_lm_head(
    imported_state_dict: dict[str, torch.Tensor], smollm2_dir: Path
) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())

    assert config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in imported_state_dict


def test_config_matches_transformers_gguf_config(
    smollm2_dir: Path, transformers_model: torch.nn.Module
) -> None:
    ours = json.loads((smollm2_dir / "config.json").read_text())
    theirs = transformers_model.config
    keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]

    assert {key: ours[key] for key in keys} == {key: getattr(theirs, key) for key in keys}
    # transformers 5 moved rope_theta into rope_parameters; older versions keep the attribute.
    rope_parameters = getattr(theirs, "rope_parameters", None) or {}
    assert ours["rope_theta"] == rope_parameters.get("rope_theta", getattr(theirs, "rope_theta", 0))
    assert ours["architectures"] == ["LlamaForCausalLM"]
    assert ours["torch_dtype"] == "float32"
    assert "rope_scaling" not in ours


def test_generation_and_tokenizer_configs_name_gguf_special_tokens(smollm2_dir: Path) -> None:
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())

    assert generation == {"bos_token_id": 1, "eos_token_id": 2}
    assert tokenizer_config["bos_token"] == "<|im_start|>"
    assert tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["unk_token"] == "<|endoftext|>"
    assert tokenizer_config["add_bos_token"] is False
    assert tokenizer_config["chat_template"].startswith("{% for message in messages %}")


def test_reverse_qk_permutation_inverts_llama_cpp_permute() -> None:
    rows, cols, num_heads = 24, 5, 3
    weight = np.arange(rows * cols, dtype=np.float32).reshape(rows, cols)
    # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
    permuted = (
        weight.reshape(num_heads, 2, rows // num_heads // 2, cols)
        .swapaxes(1, 2)
        .reshape(rows, cols)
    )

    np.testing.assert_array_equal(_reverse_qk_permutation(permuted, num_heads), weight)


def test_import_of_truncated_gguf_raises_and_leaves_no_output_dir(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    truncated = tmp_path / "truncated.gguf"
    with smollm2_gguf.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(smollm2_gguf.stat().st_size // 2))
    out_dir = tmp_path / "model"

    with pytest.raises(ModelLoadError, match=r"truncated\.gguf"):
        import_gguf(truncated, out_dir, show_progress=False)

    assert not out_dir.exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["truncated.gguf"]


def test_import_of_file_with_bad_magic_raises_model_load_error(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"NOPE" + bytes(4096))

    with pytest.raises(ModelLoadError, match=r"corrupt\.gguf"):
        import_gguf(corrupt, tmp_path / "model", show_progress=False)

    assert not (tmp_path / "model").exists()


def test_import_of_missing_file_raises_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"does not exist"):
        import_gguf(tmp_path / "absent.gguf", tmp_path / "model", show_progress=False)


def test_import_into_non_empty_dir_refuses_and_keeps_its_files(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    out_dir = tmp_path / "model"
    out_dir.mkdir()
    (out_dir / "keep.txt").write_text("mine")

    with pytest.raises(ModelLoadError, match=r"not an empty directory"):
        import_gguf(smollm2_gguf, out_dir, show_progress=False)

    assert [path.name for path in out_dir.iterdir()] == ["keep.txt"]


def test_import_of_non_llama_architecture_raises_model_load_error(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    _write_tiny_llama_gguf(path, architecture="gpt2")

    with pytest.raises(ModelLoadError, match=r"'gpt2' model"):
        import_gguf(path, tmp_path / "model", show_progress=False)

    assert not (tmp_path / "model").exists()


def test_import_of_unsupported_quant_type_names_tensor_and_type(tmp_path: Path) -> None:
    path = tmp_path / "q4k.gguf"
    _write_tiny_llama_gguf(path, tensor_type=gguf.GGMLQuantizationType.Q5_0)

    with pytest.raises(ModelLoadError, match=r"blk\.0\.attn_q\.weight as Q5_0"):
        import_gguf(path, tmp_path / "model", show_progress=False)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["q4k.gguf"]


def test_import_of_tiny_llama_undoes_qk_permutation_only_on_q_and_k(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(path)
    reader = gguf.GGUFReader(path)
    raw = {tensor.name: np.array(tensor.data) for tensor in reader.tensors}

    out_dir = import_gguf(path, tmp_path / "model", show_progress=False)
    weights = load_file(str(out_dir / "model.safetensors"))

    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.q_proj.weight"].numpy(),
        _reverse_qk_permutation(raw["blk.0.attn_q.weight"], 4),
    )
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.k_proj.weight"].numpy(),
        _reverse_qk_permutation(raw["blk.0.attn_k.weight"], 2),
    )
    np.testing.assert_array_equal(
        weights["model.layers.0.self_attn.v_proj.weight"].numpy(), raw["blk.0.attn_v.weight"]
    )


def test_model_load_error_is_an_engine_error() -> None:
    assert issubclass(ModelLoadError, EngineError)


def test_import_leaves_no_staging_dir_beside_output(smollm2_dir: Path) -> None:
    siblings = [p.name for p in smollm2_dir.parent.iterdir() if p.name != smollm2_dir.name]

    assert not [name for name in siblings if ".importing-" in name]


def test_import_failing_while_writing_removes_staging_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny_llama_gguf(path)

    def fail_to_save(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf_import, "save_file", fail_to_save)

    with pytest.raises(ModelLoadError, match=r"free disk space"):
        import_gguf(path, tmp_path / "model", show_progress=False)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]
