"""Tiny random-weight checkpoints written by transformers itself, one per supported variant.

Each is built with transformers' own config and model classes and saved with `save_pretrained`,
so the directory is exactly what a real conversion produces (config.json in transformers 5's
format, safetensors named as transformers names them). Weights are re-drawn from a seeded normal
with O(1) activations: transformers' default init (std 0.02) leaves attention almost uniform,
which would hide rotary and bias mistakes below any tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

TINY_DIMS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
}
LLAMA31_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Small, so that scaling matters at positions < 512: with head_dim 16 and theta 5e5 the
    # wavelengths (6, 33, 171, ... tokens) fall in all three bands (kept, smoothed, slowed).
    "original_max_position_embeddings": 64,
}


@dataclass(frozen=True)
class Variant:
    """One architecture as transformers builds it: which classes and which config overrides."""

    arch: str  # a key of _classes
    num_layers: int
    overrides: dict[str, Any] = field(default_factory=dict)


VARIANTS: dict[str, Variant] = {
    "llama2": Variant("llama", 2, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}),
    "llama3.1": Variant("llama", 2, {"rope_parameters": LLAMA31_ROPE}),
    "llama-linear-rope": Variant(
        "llama", 2, {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}}
    ),
    "smollm2-tied": Variant("llama", 3, {"tie_word_embeddings": True}),
    "llama-attention-bias": Variant("llama", 2, {"attention_bias": True}),
    "mistral": Variant("mistral", 2),
    "qwen2": Variant("qwen2", 3),
}
# The families beyond Llama's, each with what distinguishes it switched on. Windows of 24 tokens
# sit well inside the test prompts (up to ~100 tokens), so every windowed layer drops keys.
WINDOW = 24
FAMILY_VARIANTS: dict[str, Variant] = {
    "mistral-window": Variant("mistral", 2, {"sliding_window": WINDOW}),
    "qwen3": Variant("qwen3", 2),
    "qwen3-yarn-window": Variant(
        "qwen3",
        3,
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            "use_sliding_window": True,
            "sliding_window": WINDOW,
            "max_window_layers": 1,
        },
    ),
    "granite": Variant(
        "granite",
        2,
        {
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.5,
            "attention_multiplier": 0.2,
            "logits_scaling": 4.0,
        },
    ),
    # Partial rotary (12 of 16 dims) and LongRoPE; the test prompts stay inside the original
    # context, where transformers and Inferno both take the short factors (test_rotary covers
    # the long ones).
    "phi3-longrope": Variant(
        "phi3",
        2,
        {
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                "long_factor": [2.0, 3.0, 4.0, 5.0, 6.0, 8.0],
            },
            "original_max_position_embeddings": 128,
            "pad_token_id": 0,
        },
    ),
    "gemma3": Variant(
        "gemma3",
        3,
        {
            "sliding_window": WINDOW,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 24,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3-multimodal": Variant(
        "gemma3-multimodal",
        2,
        {"sliding_window": WINDOW, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24},
    ),
    # Mixtures of experts: 6 experts, each token's best 2 (Mixtral renormalises them). Mixtral
    # with its window on every layer; Qwen3-MoE with norm_topk_prob and a dense layer between
    # sparse ones (mlp_only_layers); Qwen2-MoE unnormalised, every other layer sparse
    # (decoder_sparse_step), with its gated shared expert.
    "mixtral-window": Variant(
        "mixtral",
        2,
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 48,
         "sliding_window": WINDOW},
    ),
    "qwen3-moe": Variant(
        "qwen3-moe",
        3,
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
         "norm_topk_prob": True, "mlp_only_layers": [1]},
    ),
    "qwen2-moe": Variant(
        "qwen2-moe",
        3,
        {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
         "shared_expert_intermediate_size": 96, "decoder_sparse_step": 2},
    ),
    # gpt-oss: its windowed and full layers alternating (layer_types, GptOssConfig's default),
    # YaRN past 32 tokens, sinks, a biased router and experts, and a SwiGLU limit low enough
    # (2, not 7) that the clamps bite. Experts of 32, a block of MXFP4 (test_gpt_oss.py).
    "gpt-oss": Variant(
        "gpt-oss",
        3,
        {"num_local_experts": 6, "num_experts_per_tok": 2, "intermediate_size": 32,
         "sliding_window": WINDOW, "swiglu_limit": 2.0,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 16.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 32}},
    ),
    # Gemma 4 (transformers' defaults: proportional rope on the global layers, a quarter of
    # their frequencies turning). Six layers, windowed and global alternating: wide global
    # heads (32, one KV head, values that are the keys), per-layer inputs of 8, the last two
    # layers reusing the KV of layers 2 and 3 with double-wide MLPs, softcapped logits.
    "gemma4": Variant(
        "gemma4",
        6,
        {"layer_types": ["sliding_attention", "full_attention"] * 3, "sliding_window": WINDOW,
         "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
         "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256,
         "num_kv_shared_layers": 2, "use_double_wide_mlp": True,
         "final_logit_softcapping": 30.0},
    ),
    # Gemma 4's MoE block beside each layer's MLP (26B-A4B's shape): 6 experts of 48, best 2;
    # no per-layer inputs and no KV sharing (transformers' own forward fails on KV-shared
    # layers without per-layer inputs; no released Gemma 4 combines them).
    "gemma4-moe": Variant(
        "gemma4",
        4,
        {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": WINDOW,
         "global_head_dim": 32, "num_global_key_value_heads": 1, "attention_k_eq_v": True,
         "hidden_size_per_layer_input": 0, "enable_moe_block": True, "num_experts": 6,
         "top_k_experts": 2, "moe_intermediate_size": 48},
    ),
    "gemma4-multimodal": Variant(
        "gemma4-multimodal",
        4,
        {"layer_types": ["sliding_attention", "full_attention"] * 2, "sliding_window": WINDOW,
         "global_head_dim": 32, "hidden_size_per_layer_input": 8,
         "vocab_size_per_layer_input": 256, "num_kv_shared_layers": 2},
    ),
}  # fmt: skip
# The hybrid Qwen (issue 23): three Gated DeltaNet layers, then a gated full-attention one (rope
# on a quarter of each head), 2 key heads and 4 value heads (GQA) of 8 dims, a conv of 4; the
# MoE with 6 experts, the best 2 renormalised, and its gated shared expert in every layer.
_LINEAR_DIMS = {
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
}
HYBRID_VARIANTS: dict[str, Variant] = {
    "qwen3.5": Variant("qwen3.5", 4, _LINEAR_DIMS),
    "qwen3.5-moe": Variant(
        "qwen3.5-moe",
        4,
        {**_LINEAR_DIMS, "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
         "shared_expert_intermediate_size": 96},
    ),
    "qwen3.5-multimodal": Variant("qwen3.5-multimodal", 4, _LINEAR_DIMS),
}  # fmt: skip
# Real head shapes for the GPU tests (tests/.../test_families_gpu.py): Gemma 3's head_dim 256
# with a 64-token window, Phi-4-mini's 96 rotary dims of 128, Gemma 4's 256 and 512 (its global
# layers', one KV head whose values are its keys), with a KV-shared layer and per-layer inputs.
GPU_VARIANTS: dict[str, Variant] = {
    "gemma4-head512": Variant(
        "gemma4",
        4,
        {
            "hidden_size": 256,
            "head_dim": 256,
            "global_head_dim": 512,
            "num_global_key_value_heads": 1,
            "attention_k_eq_v": True,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": 256,
            "num_kv_shared_layers": 1,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3-head256": Variant(
        "gemma3",
        4,
        {
            "hidden_size": 256,
            "head_dim": 256,
            "sliding_window": 64,
            "sliding_window_pattern": 2,
            "query_pre_attn_scalar": 256,
        },
    ),
    "phi3-head128": Variant(
        "phi3",
        2,
        {
            "hidden_size": 512,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.02 * i for i in range(48)],
                "long_factor": [2.0 + 0.1 * i for i in range(48)],
            },
            "original_max_position_embeddings": 512,
            "pad_token_id": 0,
        },
    ),
}
# Gemma 4 split over two ranks (tests/appliance/engine/parallel/test_new_families_tp.py): the
# tiny Gemma 4s with two global KV heads, so that every layer's heads divide by 2.
TP_VARIANTS: dict[str, Variant] = {
    f"{name}-tp": Variant(
        FAMILY_VARIANTS[name].arch,
        FAMILY_VARIANTS[name].num_layers,
        {**FAMILY_VARIANTS[name].overrides, "num_global_key_value_heads": 2},
    )
    for name in ("gemma4", "gemma4-moe")
}
ALL_VARIANTS = {
    **VARIANTS, **FAMILY_VARIANTS, **HYBRID_VARIANTS, **GPU_VARIANTS, **TP_VARIANTS
}  # fmt: skip


def _classes(arch: str) -> tuple[type, type]:
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
        "gemma3-multimodal": (
            transformers.Gemma3TextConfig,
            transformers.Gemma3ForConditionalGeneration,
        ),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "qwen2-moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "gpt-oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "gemma4": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
        "gemma4-multimodal": (
            transformers.Gemma4TextConfig,
            transformers.Gemma4ForConditionalGeneration,
        ),
        "qwen3.5": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM),
        "qwen3.5-moe": (transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM),
        "qwen3.5-multimodal": (
            transformers.Qwen3_5TextConfig,
            transformers.Qwen3_5ForConditionalGeneration,
        ),
    }[arch]


# A vision tower as small as Siglip allows: the multimodal checkpoint must carry one, for the
# loader to skip by name.
_TINY_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
_TINY_GEMMA4_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                       "position_embedding_size": 64}  # fmt: skip
_TINY_GEMMA4_AUDIO = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                      "subsampling_conv_channels": [8, 4], "output_proj_dims": 32}  # fmt: skip
_TINY_QWEN_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                     "out_hidden_size": 64, "patch_size": 14}  # fmt: skip


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """transformers' model for variant `name`, float32, eval mode, seeded random weights."""
    variant = ALL_VARIANTS[name]
    config_class, model_class = _classes(variant.arch)
    dims = dict(TINY_DIMS)
    if variant.arch in ("qwen2", "phi3", "qwen2-moe"):
        dims.pop("head_dim")  # derived: 64 / 4 = 16
    config = config_class(num_hidden_layers=variant.num_layers, **{**dims, **variant.overrides})
    if variant.arch == "gemma3-multimodal":
        import transformers

        config = transformers.Gemma3Config(
            text_config=config.to_dict(), vision_config=_TINY_VISION, mm_tokens_per_image=4
        )
    if variant.arch == "gemma4-multimodal":
        import transformers

        config = transformers.Gemma4Config(
            text_config=config.to_dict(),
            vision_config=_TINY_GEMMA4_VISION,
            audio_config=_TINY_GEMMA4_AUDIO,
        )
    if variant.arch == "qwen3.5-multimodal":
        import transformers

        config = transformers.Qwen3_5Config(
            text_config=config.to_dict(), vision_config=_TINY_QWEN_VISION
        )
    torch.manual_seed(seed)
    model = model_class(config).eval()
    _swiglu_from_config(model, config)
    redraw_weights(model, seed)
    return model


def _swiglu_from_config(model: torch.nn.Module, config: Any) -> None:
    """gpt-oss's experts clamp at the config's `swiglu_limit` with its `swiglu_alpha`, as
    transformers reads them since 5.2x; 5.17 (the GPU machine's) hard-coded the published 7.0
    and 1.702, whatever the config said, so its reference would differ from the checkpoint's
    own config. Set them from the config, as later versions do."""
    for module in model.modules():
        if type(module).__name__ == "GptOssExperts":
            module.limit = getattr(config, "swiglu_limit", module.limit)
            module.alpha = getattr(config, "swiglu_alpha", module.alpha)


def redraw_weights(model: torch.nn.Module, seed: int) -> None:
    """Every weight of a transformers model re-drawn from a seeded normal so that activations
    are O(1) (see the module docstring); float32, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        # named_parameters() lists a tied embedding once, so ties survive the re-draw.
        for param_name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in param_name:
                param.copy_(1.0 + 0.1 * noise)
            elif param_name.endswith("bias"):
                param.copy_(0.5 * noise)  # non-zero, so a dropped bias shows in the logits
            elif "embed_tokens" in param_name:
                # Small enough that a tied lm_head gives logits of a few units, like the others.
                param.copy_(0.25 * noise)
            else:  # a projection, or a stack of experts' ([E, out, in]): by its fan-in
                param.copy_(noise * (1.5 / math.sqrt(param.shape[-1])))
        for buffer_name, buffer in model.named_buffers():
            if buffer_name.endswith("layer_scalar"):  # Gemma 4's, saved with the weights
                buffer.copy_(0.8 + 0.4 * torch.rand(buffer.shape, generator=generator))


def save_checkpoint(model: torch.nn.Module, model_dir: Path, **kwargs: Any) -> Path:
    model.save_pretrained(model_dir, safe_serialization=True, **kwargs)
    return model_dir


def checkpoint_cache(tmp_path_factory: pytest.TempPathFactory):
    """name -> (model directory, transformers' model with the same weights), built once each."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            model = build_hf_model(name)
            model_dir = save_checkpoint(model, tmp_path_factory.mktemp(name.replace(".", "_")))
            cache[name] = (model_dir, model)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    return checkpoint_cache(tmp_path_factory)
