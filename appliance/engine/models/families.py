"""The supported architectures, each a short declaration of how it differs from Llama.

A family is its `config.json` mapping (`configure`: the ModelConfig fields it changes) and its
checkpoint layout (`models.checkpoint_layout`); the decoder in `models.decoder` reads those
fields and has no per-family branches. To add a family, see docs/ARCHITECTURE.md ("Model
families").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.checkpoint_layout import (
    FUSED_PROJECTIONS,
    GEMMA3_MULTIMODAL,
    GEMMA4_LAYOUT,
    GEMMA4_MULTIMODAL,
    GPT_OSS_LAYOUT,
    LLAMA_LAYOUT,
    MIXTRAL_LAYOUT,
    QWEN3_5_LAYOUT,
    QWEN3_5_MULTIMODAL,
    CheckpointLayout,
)
from appliance.engine.models.linear_attention_config import LinearAttentionConfig
from appliance.engine.models.moe_config import MoeConfig
from appliance.engine.models.rope_config import RopeConfig
from kernels.moe_spec import ClampedSwiglu, Router

# "linear_attention" layers attend through a recurrent state, not a window: models.config
# accepts them only where the family builds them (the hybrid Qwen).
_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention")


class ConfigReader:
    """Typed reads from one config.json object (the text model's), each failing with the key."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw = raw
        self.source = source

    def positive(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelLoadError(
                f"{self.source}: {key!r} must be a positive integer, got {value!r}"
            )
        return value

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelLoadError(f"{self.source}: {key!r} must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise ModelLoadError(f"{self.source}: {key!r} must be true or false, got {value!r}")
        return value

    def rope_parameters(self) -> dict[str, Any]:
        # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta`
        # plus an optional `rope_scaling` dict whose type key was once called "type".
        params = self.raw.get("rope_parameters") or self.raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ModelLoadError(f"{self.source}: 'rope_parameters' must be an object")
        return dict(params)

    def rope(self, params: Mapping[str, Any] | None = None) -> RopeConfig:
        params = self.rope_parameters() if params is None else params
        if isinstance(params.get("full_attention"), dict):  # nested by layer type
            params = params["full_attention"]
        return RopeConfig.parse(params, self.raw, source=self.source)

    def rotary_dim(self, head_dim: int) -> int:
        params = self.rope_parameters()
        factor = params.get("partial_rotary_factor", self.raw.get("partial_rotary_factor", 1.0))
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor <= 1:
            raise ModelLoadError(
                f"{self.source}: 'partial_rotary_factor' must be in (0, 1], got {factor!r}"
            )
        rotary_dim = int(head_dim * factor)
        if rotary_dim < 2 or rotary_dim % 2:
            raise ModelLoadError(
                f"{self.source}: partial_rotary_factor {factor} rotates {rotary_dim} of "
                f"{head_dim} dims; rope needs an even number"
            )
        return rotary_dim

    def windows(
        self, num_layers: int, default_types: list[str] | None = None
    ) -> tuple[int | None, ...]:
        """Each layer's window from `layer_types` (transformers 5), else `default_types`, else
        `sliding_window` on every layer (Mistral). A window at least the position limit is no
        window (Phi-3.5's 262144)."""
        layer_types = self.raw.get("layer_types") or default_types
        window = self.raw.get("sliding_window")
        if layer_types is None:
            layer_types = ["sliding_attention" if window is not None else "full_attention"]
            layer_types *= num_layers
        if not isinstance(layer_types, list) or len(layer_types) != num_layers:
            raise ModelLoadError(
                f"{self.source}: 'layer_types' must list one type per layer ({num_layers})"
            )
        unknown = sorted({str(t) for t in layer_types} - set(_LAYER_TYPES))
        if unknown:
            raise ModelLoadError(
                f"{self.source}: layer type {unknown[0]!r} is not supported; "
                f"supported: {', '.join(_LAYER_TYPES)}"
            )
        if "sliding_attention" not in layer_types:
            return (None,) * num_layers
        window = self.positive("sliding_window")
        if window >= self.positive("max_position_embeddings"):
            return (None,) * num_layers
        return tuple(window if t == "sliding_attention" else None for t in layer_types)

    def layer_indices(self, key: str, num_layers: int) -> frozenset[int]:
        """A list of layer indices (absent: none), each inside 0..num_layers - 1."""
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in value
        ):
            raise ModelLoadError(
                f"{self.source}: {key!r} must list layer indices in 0..{num_layers - 1}, "
                f"got {value!r}"
            )
        return frozenset(value)

    def refuse_unless(self, key: str, allowed: tuple[Any, ...], default: Any = None) -> None:
        value = self.raw.get(key, default)
        if value not in allowed:
            raise ModelLoadError(
                f"{self.source}: {key!r} = {value!r} is not supported; supported: "
                f"{', '.join(repr(a) for a in allowed)}"
            )


@dataclass(frozen=True, slots=True)
class Family:
    """What one architecture changes. `configure` returns the ModelConfig fields it sets beyond
    the shared ones (models.config); `text_config_key` names where a multimodal config keeps
    its text model's."""

    configure: Callable[[ConfigReader], dict[str, Any]]
    layout: CheckpointLayout = LLAMA_LAYOUT
    text_config_key: str | None = None
    tied_by_default: bool = False

    def text_config(self, raw: Mapping[str, Any], source: str) -> Mapping[str, Any]:
        if self.text_config_key is None:
            return raw
        text = raw.get(self.text_config_key)
        if not isinstance(text, dict):
            raise ModelLoadError(f"{source}: {self.text_config_key!r} must be an object")
        # The outer object may hold what the text model's leaves out (its tie, its names).
        return {**{k: v for k, v in raw.items() if k != self.text_config_key}, **text}


def _silu_mlp(read: ConfigReader) -> None:
    read.refuse_unless("hidden_act", ("silu",), default="silu")


def _llama(read: ConfigReader) -> dict[str, Any]:
    # Mistral and Phi-3 too: Phi-3's differences (fused projections, partial rotary, LongRoPE)
    # are its checkpoint layout and its rope parameters, which the shared parsing reads.
    _silu_mlp(read)
    return {}


def _qwen_windows(read: ConfigReader) -> tuple[int | None, ...]:
    # Before transformers 5 wrote `layer_types`, Qwen's window applied only with
    # use_sliding_window, and only from layer max_window_layers on.
    num_layers = read.positive("num_hidden_layers")
    if not read.flag("use_sliding_window"):
        return read.windows(num_layers, ["full_attention"] * num_layers)
    first = read.raw.get("max_window_layers", num_layers)
    if not isinstance(first, int) or isinstance(first, bool) or first < 0:
        raise ModelLoadError(
            f"{read.source}: 'max_window_layers' must be an integer >= 0, got {first!r}"
        )
    types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    return read.windows(num_layers, types)


def _qwen2(read: ConfigReader) -> dict[str, Any]:
    _silu_mlp(read)
    return {"qkv_bias": True, "o_bias": False, "layer_windows": _qwen_windows(read)}


def _qwen3(read: ConfigReader) -> dict[str, Any]:
    _silu_mlp(read)
    return {"qk_norm": True, "layer_windows": _qwen_windows(read)}


def _granite(read: ConfigReader) -> dict[str, Any]:
    _silu_mlp(read)
    return {
        "attention_scale": read.number("attention_multiplier", 1.0),
        "embedding_multiplier": read.number("embedding_multiplier", 1.0),
        "residual_multiplier": read.number("residual_multiplier", 1.0),
        "logits_divisor": read.number("logits_scaling", 1.0),
    }


def _gelu_tanh_mlp(read: ConfigReader) -> None:
    act = read.raw.get("hidden_activation") or read.raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(
            f"{read.source}: 'hidden_activation' {act!r} is not supported; Gemma uses "
            "'gelu_pytorch_tanh'"
        )


def _gemma_layer_types(read: ConfigReader, num_layers: int) -> list[str]:
    """Without `layer_types`: every `sliding_window_pattern`-th layer global (Gemma 3, 4)."""
    pattern = read.positive("sliding_window_pattern", 6)
    return [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)
    ]


def _final_logit_softcapping(read: ConfigReader) -> float | None:
    if read.raw.get("final_logit_softcapping") is None:
        return None
    return read.number("final_logit_softcapping", 0.0)


def _gemma3(read: ConfigReader) -> dict[str, Any]:
    _gelu_tanh_mlp(read)
    read.refuse_unless("attn_logit_softcapping", (None,))
    read.refuse_unless("use_bidirectional_attention", (None, False))
    num_layers = read.positive("num_hidden_layers")
    default_types = _gemma_layer_types(read, num_layers)
    params = read.rope_parameters()
    if isinstance(params.get("sliding_attention"), dict):  # transformers 5: nested by layer type
        global_params, local_params = (
            params.get("full_attention") or {},
            params["sliding_attention"],
        )
    else:  # as Google ships it: rope_theta (+ rope_scaling) global, rope_local_base_freq local
        global_params = {"rope_theta": read.raw.get("rope_theta", 1_000_000.0), **params}
        local_params = {"rope_theta": read.raw.get("rope_local_base_freq", 10_000.0)}
    hidden_size = read.positive("hidden_size")
    return {
        "rope": read.rope(global_params),
        "local_rope": read.rope(local_params),
        "layer_windows": read.windows(num_layers, default_types),
        "qk_norm": True,
        "norm_weight_offset": 1.0,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "attention_scale": read.number("query_pre_attn_scalar", 256.0) ** -0.5,
        "embedding_multiplier": hidden_size**0.5,
        "final_logit_softcapping": _final_logit_softcapping(read),
    }


# transformers' Gemma4TextConfig defaults: the rope of each layer type, and the head dim of
# the global layers when the config names none.
_GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}
_GEMMA4_GLOBAL_HEAD_DIM = 512
# What a Gemma 4 layer's `per_layer_config` entry may override.
_GEMMA4_LAYER_KEYS = ("head_dim", "num_key_value_heads")


def _gemma4(read: ConfigReader) -> dict[str, Any]:
    """Gemma 3's block (sandwich norms, scaled embeddings, windows, GELU-tanh MLP, q/k norms)
    with transformers' Gemma4TextConfig / Gemma4TextModel on top: plain-weight norms, softmax
    scale 1, wide global layers, values normed, KV sharing, per-layer inputs, layer scalars and
    a MoE block beside the MLP."""
    _gelu_tanh_mlp(read)
    read.refuse_unless("attn_logit_softcapping", (None,))
    # "vision" makes image tokens attend both ways; text tokens, all this appliance serves,
    # stay causal. "all" is an encoder.
    read.refuse_unless("use_bidirectional_attention", (None, "vision"))
    num_layers = read.positive("num_hidden_layers")
    types = read.raw.get("layer_types") or _gemma_layer_types(read, num_layers)
    if isinstance(types, list) and types and types[-1] != "full_attention":
        raise ModelLoadError(
            f"{read.source}: 'layer_types' must end with a 'full_attention' layer (Gemma 4's "
            f"last layer is global), got {types[-1]!r}"
        )
    windows = read.windows(num_layers, types)
    is_global = [t == "full_attention" for t in types]
    params = read.rope_parameters() or _GEMMA4_ROPE
    for layer_type in ("full_attention", "sliding_attention"):
        if not isinstance(params.get(layer_type), dict):
            raise ModelLoadError(
                f"{read.source}: 'rope_parameters' must hold an object for {layer_type!r}"
            )
    values_are_keys = read.flag("attention_k_eq_v")
    head_dims, kv_heads = _gemma4_head_shapes(read, is_global, values_are_keys)
    kv_sources = _gemma4_kv_sources(read, types)
    intermediate = read.positive("intermediate_size")
    double_wide = read.flag("use_double_wide_mlp")
    shares = [source != i for i, source in enumerate(kv_sources)]
    per_layer = read.raw.get("hidden_size_per_layer_input") or 0
    return {
        "rope": read.rope(params["full_attention"]),
        "local_rope": read.rope(params["sliding_attention"]),
        "layer_windows": windows,
        "qk_norm": True,
        "sandwich_norms": True,
        "activation": "gelu_tanh",
        "attention_scale": 1.0,
        "embedding_multiplier": read.positive("hidden_size") ** 0.5,
        "final_logit_softcapping": _final_logit_softcapping(read),
        "layer_head_dims": head_dims,
        "layer_num_kv_heads": kv_heads,
        "layer_intermediate_sizes": tuple(
            intermediate * (2 if double_wide and shared else 1) for shared in shares
        ),
        "layer_values_are_keys": tuple(values_are_keys and g for g in is_global),
        "layer_kv_sources": kv_sources,
        "value_norm": True,
        "layer_scalars": True,
        "per_layer_input_size": read.positive("hidden_size_per_layer_input") if per_layer else 0,
        "per_layer_vocab_size": read.positive("vocab_size_per_layer_input") if per_layer else 0,
        "moe": _gemma4_moe(read, num_layers) if read.flag("enable_moe_block") else None,
    }


def _gemma4_head_shapes(
    read: ConfigReader, is_global: list[bool], values_are_keys: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Each layer's (head dim, KV heads): transformers 5 saves the global layers' as
    `per_layer_config` overrides; Google's configs name `global_head_dim` and (for
    attention_k_eq_v models) `num_global_key_value_heads`, from which transformers builds them."""
    num_heads = read.positive("num_attention_heads")
    head_dim = read.positive("head_dim")
    num_kv_heads = read.positive("num_key_value_heads", num_heads)
    overrides = read.raw.get("per_layer_config")
    if overrides is None:
        wide = {"head_dim": read.positive("global_head_dim", _GEMMA4_GLOBAL_HEAD_DIM)}
        if values_are_keys and read.raw.get("num_global_key_value_heads") is not None:
            wide["num_key_value_heads"] = read.positive("num_global_key_value_heads")
        overrides = {str(i): wide for i, g in enumerate(is_global) if g}
    if not isinstance(overrides, dict):
        raise ModelLoadError(f"{read.source}: 'per_layer_config' must be an object")
    layers: list[dict[str, Any]] = [{} for _ in is_global]
    for key, values in overrides.items():
        if not str(key).isdigit() or int(key) >= len(layers) or not isinstance(values, dict):
            raise ModelLoadError(
                f"{read.source}: 'per_layer_config' must map layer indices to objects, got {key!r}"
            )
        unknown = sorted(set(values) - set(_GEMMA4_LAYER_KEYS))
        if unknown:
            raise ModelLoadError(
                f"{read.source}: per_layer_config[{key!r}] overrides {unknown[0]!r}, which is "
                f"not supported; supported: {', '.join(_GEMMA4_LAYER_KEYS)}"
            )
        layers[int(key)] = values
    where = f"per_layer_config of {read.source}"
    head_dims, kv_heads = [], []
    for layer in layers:
        layer_read = ConfigReader({"head_dim": head_dim, "num_key_value_heads": num_kv_heads,
                                   **layer}, where)  # fmt: skip
        head_dims.append(layer_read.positive("head_dim"))
        kv_heads.append(layer_read.positive("num_key_value_heads"))
        if num_heads % kv_heads[-1]:
            raise ModelLoadError(
                f"{where}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {kv_heads[-1]}"
            )
    return tuple(head_dims), tuple(kv_heads)


def _gemma4_kv_sources(read: ConfigReader, types: list[str]) -> tuple[int, ...]:
    """transformers' Gemma4TextConfig.kv_sharing_modes: the last `num_kv_shared_layers` layers
    each attend over the KV of the last earlier layer of their own type (which stores it)."""
    num_layers = len(types)
    num_shared = read.raw.get("num_kv_shared_layers") or 0
    if not isinstance(num_shared, int) or isinstance(num_shared, bool) or num_shared < 0:
        raise ModelLoadError(
            f"{read.source}: 'num_kv_shared_layers' must be an integer >= 0, got {num_shared!r}"
        )
    first_shared = num_layers - num_shared
    sources = list(range(num_layers))
    for i in range(max(first_shared, 0), num_layers):
        owners = [j for j in range(first_shared) if types[j] == types[i]]
        if not owners:
            raise ModelLoadError(
                f"{read.source}: 'num_kv_shared_layers' {num_shared} leaves no earlier "
                f"{types[i]!r} layer to own the KV that layer {i} reuses"
            )
        sources[i] = owners[-1]
    return tuple(sources)


def _gemma4_moe(read: ConfigReader, num_layers: int) -> MoeConfig:
    num_experts, top_k = read.positive("num_experts"), read.positive("top_k_experts")
    if top_k > num_experts:
        raise ModelLoadError(
            f"{read.source}: 'top_k_experts' {top_k} exceeds the {num_experts} experts"
        )
    router = Router(
        num_experts=num_experts,
        top_k=top_k,
        renormalize=True,
        normed_input=True,
        per_expert_scale=True,
    )
    return MoeConfig(
        router=router,
        expert_size=read.positive("moe_intermediate_size"),
        moe_layers=(True,) * num_layers,
        activation="gelu_tanh",
        beside_dense_mlp=True,
    )


def _num_experts(read: ConfigReader) -> int:
    # transformers 5 writes num_local_experts for every MoE; Qwen's own configs num_experts.
    key = "num_local_experts" if "num_local_experts" in read.raw else "num_experts"
    return read.positive(key)


def _router(read: ConfigReader, **variant: Any) -> Router:
    num_experts, top_k = _num_experts(read), read.positive("num_experts_per_tok")
    if top_k > num_experts:
        raise ModelLoadError(
            f"{read.source}: 'num_experts_per_tok' {top_k} exceeds the {num_experts} experts"
        )
    return Router(num_experts=num_experts, top_k=top_k, **variant)


def _mixtral(read: ConfigReader) -> dict[str, Any]:
    _silu_mlp(read)
    num_layers = read.positive("num_hidden_layers")
    moe = MoeConfig(
        router=_router(read, renormalize=True),
        expert_size=read.positive("intermediate_size"),
        moe_layers=(True,) * num_layers,
    )
    return {"moe": moe}


def _qwen_moe_layers(read: ConfigReader) -> tuple[bool, ...]:
    # A layer is sparse unless listed in mlp_only_layers, and then only every
    # decoder_sparse_step-th (transformers' Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer).
    num_layers = read.positive("num_hidden_layers")
    dense = read.layer_indices("mlp_only_layers", num_layers)
    step = read.positive("decoder_sparse_step", 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _qwen3_moe(read: ConfigReader) -> dict[str, Any]:
    moe = MoeConfig(
        router=_router(read, renormalize=read.flag("norm_topk_prob")),
        expert_size=read.positive("moe_intermediate_size"),
        moe_layers=_qwen_moe_layers(read),
    )
    return {**_qwen3(read), "moe": moe}


def _qwen2_moe(read: ConfigReader) -> dict[str, Any]:
    moe = MoeConfig(
        router=_router(read, renormalize=read.flag("norm_topk_prob")),
        expert_size=read.positive("moe_intermediate_size"),
        moe_layers=_qwen_moe_layers(read),
        shared_expert_size=read.positive("shared_expert_intermediate_size"),
        shared_expert_gated=True,
    )
    return {**_qwen2(read), "qkv_bias": read.flag("qkv_bias", True), "moe": moe}


def _gpt_oss(read: ConfigReader) -> dict[str, Any]:
    # Every layer sparse; layer_types alternate windowed and full (written by transformers'
    # GptOssConfig); the router is biased, its softmax over the k best logits only; sinks in
    # every layer's attention. hidden_act is not read: the experts' activation is their own.
    num_layers = read.positive("num_hidden_layers")
    moe = MoeConfig(
        router=_router(read, score_after_topk=True, logit_bias=True),
        expert_size=read.positive("intermediate_size"),
        moe_layers=(True,) * num_layers,
        expert_bias=True,
        clamped_swiglu=ClampedSwiglu(
            alpha=read.number("swiglu_alpha", 1.702), limit=read.number("swiglu_limit", 7.0)
        ),
    )
    return {"moe": moe, "attention_sinks": True}


def _linear_attention(read: ConfigReader) -> LinearAttentionConfig:
    """Which layers are Gated DeltaNet (`layer_types`, else every layer but each
    `full_attention_interval`-th, as transformers' Qwen3_5TextConfig fills it) and their
    shapes."""
    num_layers = read.positive("num_hidden_layers")
    types = read.raw.get("layer_types")
    if types is None:
        interval = read.positive("full_attention_interval", 4)
        types = [
            "linear_attention" if (i + 1) % interval else "full_attention"
            for i in range(num_layers)
        ]
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelLoadError(
            f"{read.source}: 'layer_types' must list one type per layer ({num_layers})"
        )
    unknown = sorted({str(t) for t in types} - {"linear_attention", "full_attention"})
    if unknown:
        raise ModelLoadError(
            f"{read.source}: layer type {unknown[0]!r} is not supported in a hybrid Qwen; "
            "supported: linear_attention, full_attention"
        )
    linear = LinearAttentionConfig(
        num_key_heads=read.positive("linear_num_key_heads"),
        num_value_heads=read.positive("linear_num_value_heads"),
        key_head_dim=read.positive("linear_key_head_dim"),
        value_head_dim=read.positive("linear_value_head_dim"),
        conv_kernel_size=read.positive("linear_conv_kernel_dim"),
        layers=tuple(t == "linear_attention" for t in types),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise ModelLoadError(
            f"{read.source}: linear_num_value_heads {linear.num_value_heads} is not a multiple "
            f"of linear_num_key_heads {linear.num_key_heads}"
        )
    if linear.conv_kernel_size < 2:
        raise ModelLoadError(f"{read.source}: 'linear_conv_kernel_dim' must be at least 2")
    return linear


def _qwen3_5(read: ConfigReader) -> dict[str, Any]:
    # Gated DeltaNet layers between gated full-attention ones; every norm but the linear
    # layers' gated one scales by (1 + w); rope on partial_rotary_factor of each head. The
    # text model's rope is mrope, interleaved over (t, h, w) sections: for text all three
    # positions are the token's, so it is the plain rope of those dims.
    _silu_mlp(read)
    return {
        "linear_attention": _linear_attention(read),
        "attention_output_gate": True,
        "qk_norm": True,
        "norm_weight_offset": 1.0,
    }


def _qwen3_5_moe(read: ConfigReader) -> dict[str, Any]:
    # Every layer a mixture of experts: softmax, top-k, renormalised, plus the shared expert
    # with its sigmoid gate (transformers' Qwen3_5MoeSparseMoeBlock).
    moe = MoeConfig(
        router=_router(read, renormalize=True),
        expert_size=read.positive("moe_intermediate_size"),
        moe_layers=(True,) * read.positive("num_hidden_layers"),
        shared_expert_size=read.positive("shared_expert_intermediate_size"),
        shared_expert_gated=True,
    )
    return {**_qwen3_5(read), "moe": moe}


FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family(_llama),
    "MistralForCausalLM": Family(_llama),
    "Qwen2ForCausalLM": Family(_qwen2),
    "Qwen3ForCausalLM": Family(_qwen3),
    "GraniteForCausalLM": Family(_granite),
    "Phi3ForCausalLM": Family(_llama, layout=FUSED_PROJECTIONS),
    "Gemma3ForCausalLM": Family(_gemma3, tied_by_default=True),
    "MixtralForCausalLM": Family(_mixtral, layout=MIXTRAL_LAYOUT),
    "Qwen2MoeForCausalLM": Family(_qwen2_moe),
    "Qwen3MoeForCausalLM": Family(_qwen3_moe),
    "GptOssForCausalLM": Family(_gpt_oss, layout=GPT_OSS_LAYOUT),
    "Qwen3_5ForCausalLM": Family(_qwen3_5, layout=QWEN3_5_LAYOUT),
    "Qwen3_5MoeForCausalLM": Family(_qwen3_5_moe, layout=QWEN3_5_LAYOUT),
    "Qwen3_5ForConditionalGeneration": Family(
        _qwen3_5, layout=QWEN3_5_MULTIMODAL, text_config_key="text_config"
    ),
    "Qwen3_5MoeForConditionalGeneration": Family(
        _qwen3_5_moe, layout=QWEN3_5_MULTIMODAL, text_config_key="text_config"
    ),
    "Gemma3ForConditionalGeneration": Family(
        _gemma3, layout=GEMMA3_MULTIMODAL, text_config_key="text_config", tied_by_default=True
    ),
    "Gemma4ForCausalLM": Family(_gemma4, layout=GEMMA4_LAYOUT, tied_by_default=True),
    "Gemma4ForConditionalGeneration": Family(
        _gemma4, layout=GEMMA4_MULTIMODAL, text_config_key="text_config", tied_by_default=True
    ),
}
