"""The architecture of a model directory, parsed once from its `config.json`.

The fields every decoder family shares are read here; what a family changes (biases, norms,
multipliers, windows, its own rope) comes from its declaration in `models.families`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.families import FAMILIES, ConfigReader, Family
from appliance.engine.models.linear_attention_config import LinearAttentionConfig
from appliance.engine.models.moe_config import MoeConfig
from appliance.engine.models.quantization import Fp8Checkpoint
from appliance.engine.models.rope_config import RopeConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "RopeConfig"]

SUPPORTED_ARCHITECTURES = frozenset(FAMILIES)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    # Per layer: how many of the latest tokens it attends to (None: all of them).
    layer_windows: tuple[int | None, ...]
    # The leading part of each head that rope rotates (Phi-4-mini: 96 of 128).
    rotary_dim: int
    # The rope of windowed layers where it differs from `rope` (Gemma 3's local base).
    local_rope: RopeConfig | None = None
    # RMSNorm of each head of q and k before rope (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Gemma's norms scale by (1 + w): the checkpoint holds w, the model 1 + w.
    norm_weight_offset: float = 0.0
    # Gemma 3: a norm after attention and around the MLP (pre and post), four per layer.
    sandwich_norms: bool = False
    activation: str = "silu"  # of the gated MLP: "silu" or "gelu_tanh"
    # None: head_dim ** -0.5; Gemma's query_pre_attn_scalar and Granite's multiplier set it.
    attention_scale: float | None = None
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_divisor: float = 1.0  # Granite's logits_scaling
    final_logit_softcapping: float | None = None
    # An FP8 checkpoint's layout (config.json's quantization_config); None: unquantized.
    fp8: Fp8Checkpoint | None = None
    # A mixture of experts: its router, expert sizes and which layers are sparse (None: dense).
    moe: MoeConfig | None = None
    # A learned logit per query head that joins each softmax's denominator (gpt-oss's sinks).
    attention_sinks: bool = False
    # The checkpoint stores the experts in MXFP4 (gpt-oss as released), dequantized on load.
    mxfp4_experts: bool = False
    # Gemma 4. Per layer where layers differ (empty: every layer has the shared value): head
    # dims and KV heads (its wide global layers), MLP sizes (its double-wide KV-shared layers),
    # whether the values are the keys (attention_k_eq_v: one projection), and the layer whose
    # KV cache each attends over (itself, or for a KV-shared layer an earlier one, which then
    # owns its pages; the sharer writes nothing).
    layer_head_dims: tuple[int, ...] = ()
    layer_num_kv_heads: tuple[int, ...] = ()
    layer_intermediate_sizes: tuple[int, ...] = ()
    layer_values_are_keys: tuple[bool, ...] = ()
    layer_kv_sources: tuple[int, ...] = ()
    # Values RMS-normed per head (no weight) before they are cached (Gemma 4's v_norm).
    value_norm: bool = False
    # Each layer's output, residual included, times its learned scalar (Gemma 4's layer_scalar).
    layer_scalars: bool = False
    # Per-layer input embeddings (Gemma 4's PLE): each layer adds a gated projection of its own
    # `per_layer_input_size`-wide input, from a table of `per_layer_vocab_size` rows and a
    # projection of the main embedding (models.decoder). 0: none.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    # Linear-attention (Gated DeltaNet) layers in place of attention in some layers (the hybrid
    # Qwen3.5): their shapes and which layers they are (None: every layer attends).
    linear_attention: LinearAttentionConfig | None = None
    # The query projection also yields a gate per head; sigmoid(gate) scales the attention
    # output before o_proj (Qwen3.5's full-attention layers).
    attention_output_gate: bool = False

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not Path(model_dir).is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ModelLoadError(
                f"{path} is missing: a model directory needs config.json "
                "(convert a GGUF with `inferno model import-gguf`)"
            ) from exc
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path} is not readable JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{path} must hold a JSON object, got {type(raw).__name__}")
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], *, source: str = "config") -> ModelConfig:
        family = family_of(raw, source)
        text = family.text_config(raw, source)
        read = ConfigReader(text, source)
        num_heads = read.positive("num_attention_heads")
        hidden_size = read.positive("hidden_size")
        head_dim = read.positive("head_dim", hidden_size // num_heads)
        num_kv_heads = read.positive("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        if text.get("mlp_bias"):
            raise ModelLoadError(f"{source}: 'mlp_bias' true is not supported (no family uses it)")
        num_layers = read.positive("num_hidden_layers")
        attention_bias = read.flag("attention_bias")
        fields: dict[str, Any] = {
            "architecture": raw["architectures"][0],
            "vocab_size": read.positive("vocab_size"),
            "hidden_size": hidden_size,
            # Absent where every layer is a mixture of experts (Qwen3.5-MoE): checked below.
            "intermediate_size": read.positive("intermediate_size")
            if "intermediate_size" in text
            else 0,
            "num_layers": num_layers,
            "num_heads": num_heads,
            "num_kv_heads": num_kv_heads,
            "head_dim": head_dim,
            "max_position_embeddings": read.positive("max_position_embeddings"),
            "rms_norm_eps": read.number("rms_norm_eps", 1e-6),
            "rope": read.rope(),
            "tie_word_embeddings": read.flag("tie_word_embeddings", family.tied_by_default),
            "qkv_bias": attention_bias,
            "o_bias": attention_bias,
            "layer_windows": read.windows(num_layers),
            "rotary_dim": read.rotary_dim(head_dim),
            "fp8": _fp8_checkpoint(raw.get("quantization_config"), family, source),
            "mxfp4_experts": _is_mxfp4(raw.get("quantization_config")),
        }
        fields.update(family.configure(read))
        _check_layer_kinds(text, fields, source)
        fp8 = fields["fp8"]
        if fields.get("moe") is not None and fp8 is not None and fp8.static_input:
            raise ModelLoadError(
                f"{source}: quantization_config with static input scales is not supported for "
                "a mixture of experts (its FP8 experts quantize activations per token); use a "
                "dynamic-activation FP8 checkpoint or the bf16 one"
            )
        return cls(**fields)

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    @property
    def max_model_len(self) -> int:
        """The longest context the model serves: its position limit. Windowed layers attend to
        their last W tokens at any length."""
        return self.max_position_embeddings

    def head_dim_of(self, layer: int) -> int:
        return self.layer_head_dims[layer] if self.layer_head_dims else self.head_dim

    def num_kv_heads_of(self, layer: int) -> int:
        return self.layer_num_kv_heads[layer] if self.layer_num_kv_heads else self.num_kv_heads

    def rotary_dim_of(self, layer: int) -> int:
        """The same leading fraction of each layer's head that `rotary_dim` is of head_dim."""
        return self.head_dim_of(layer) * self.rotary_dim // self.head_dim

    def intermediate_size_of(self, layer: int) -> int:
        if self.layer_intermediate_sizes:
            return self.layer_intermediate_sizes[layer]
        return self.intermediate_size

    def values_are_keys(self, layer: int) -> bool:
        return bool(self.layer_values_are_keys) and self.layer_values_are_keys[layer]

    def kv_source_of(self, layer: int) -> int:
        """The layer whose KV cache `layer` attends over: itself unless it shares another's."""
        return self.layer_kv_sources[layer] if self.layer_kv_sources else layer

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that own KV pages, in order: one cache tensor each (engine.kv_cache).
        Not a hybrid's linear layers (they keep a recurrent state: models.recurrent_state),
        nor Gemma 4's KV-shared ones (they read an earlier layer's pages)."""
        return tuple(
            i
            for i in range(self.num_layers)
            if self.kv_source_of(i) == i and not self.is_linear_layer(i)
        )

    def is_linear_layer(self, layer: int) -> bool:
        """A hybrid's linear-attention (Gated DeltaNet) layer, which keeps no KV."""
        return self.linear_attention is not None and self.linear_attention.layers[layer]

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention, with a recurrent state per sequence."""
        return self.linear_attention is not None

    @property
    def window_group(self) -> tuple[int, ...]:
        """The KV-owning layers whose pages live in the window group's pool (docs/ARCHITECTURE.md,
        "KV groups"): when some KV-owning layers have a window and some have none, those whose
        every reader (the layer itself, and the KV-shared layers reading it) has one. Empty
        when the model has one group: every layer windowed (Mistral) or none."""
        readers: dict[int, list[int | None]] = {i: [] for i in self.kv_layers}
        for i in range(self.num_layers):
            if not self.is_linear_layer(i):
                readers[self.kv_source_of(i)].append(self.layer_windows[i])
        windowed = tuple(i for i, windows in readers.items() if None not in windows)
        return windowed if 0 < len(windowed) < len(readers) else ()

    @property
    def window_group_window(self) -> int | None:
        """The window group's window: the largest window of a layer reading its pages."""
        group = set(self.window_group)
        windows = [
            self.layer_windows[i]
            for i in range(self.num_layers)
            if not self.is_linear_layer(i) and self.kv_source_of(i) in group
        ]
        return max((w for w in windows if w is not None), default=None)

    @property
    def kv_window(self) -> int | None:
        """How far back any layer looks: the largest window when every layer has one, else
        None. Blocks wholly older than this are seen by no layer and can be freed."""
        if any(w is None for w in self.layer_windows):
            return None
        return max(w for w in self.layer_windows if w is not None)


def _check_layer_kinds(text: Mapping[str, Any], fields: dict[str, Any], source: str) -> None:
    """Linear-attention layers only where the family builds them; a dense MLP only with its
    size."""
    if "linear_attention" in (text.get("layer_types") or []) and not fields.get("linear_attention"):
        raise ModelLoadError(
            f"{source}: layer type 'linear_attention' is supported only by the hybrid Qwen "
            "families (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM)"
        )
    moe = fields.get("moe")
    if fields["intermediate_size"] == 0 and (moe is None or not all(moe.moe_layers)):
        raise ModelLoadError(f"{source}: 'intermediate_size' is missing (a dense MLP needs it)")
    if fields.get("fp8") is not None and fields.get("linear_attention") is not None:
        raise ModelLoadError(
            f"{source}: 'quantization_config' of a hybrid linear-attention model is not "
            "supported (its FP8 checkpoints are not mapped); use its bf16 checkpoint"
        )


def _fp8_checkpoint(quantization: Any, family: Family, source: str) -> Fp8Checkpoint | None:
    """The FP8 layout of `quantization_config`, or None: unquantized, or MXFP4 experts, which
    only a family whose layout stores gpt-oss's fused experts has (dequantized on load,
    models.fused_experts)."""
    if _is_mxfp4(quantization):
        if not family.layout.gpt_oss_experts:
            raise ModelLoadError(
                f"{source}: quantization_config.quant_method 'mxfp4' is supported only for "
                "gpt-oss's experts (GptOssForCausalLM)"
            )
        return None
    return Fp8Checkpoint.from_config(quantization, source)


def _is_mxfp4(quantization: Any) -> bool:
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def family_of(raw: Mapping[str, Any], source: str) -> Family:
    archs = raw.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(arch, str) or arch not in FAMILIES:
        raise ModelLoadError(
            f"{source}: architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[arch]
