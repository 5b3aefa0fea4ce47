"""A small random Llama checkpoint for the tensor-parallel GPU tests: widths the Triton kernels
serve (head_dim 64), GQA (8 query, 4 KV heads), O(1) activations (the tiny models' re-draw)."""

from __future__ import annotations

import math
from pathlib import Path

import torch


def save_gpu_test_model(model_dir: Path, seed: int = 0) -> Path:
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=4,
        vocab_size=4096,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.25 * noise)
            else:
                param.copy_(noise * (1.5 / math.sqrt(param.shape[1])))
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


# Mixtures of experts at widths the Triton kernels serve: 16 experts, each token's best 4, so
# every rank's experts are chosen in every step; Qwen3-MoE's q/k norms, gpt-oss's sinks, biased
# router and experts, clamped SwiGLU and alternating windows.
_MOE_CONFIGS = {
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 16, "moe_intermediate_size": 256, "norm_topk_prob": True},
    ),
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {"num_local_experts": 16, "intermediate_size": 256, "sliding_window": 128},
    ),
}
MOE_ARCHITECTURES = tuple(_MOE_CONFIGS)


def save_gpu_moe_model(model_dir: Path, architecture: str, seed: int = 0) -> Path:
    """A random mixture of experts (`architecture` one of MOE_ARCHITECTURES), 8 query and 4 KV
    heads of 64 like the dense one."""
    import transformers

    config_name, model_name, overrides = _MOE_CONFIGS[architecture]
    config = getattr(transformers, config_name)(
        hidden_size=512,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
        num_hidden_layers=4,
        num_experts_per_tok=4,
        vocab_size=4096,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        **overrides,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                param.copy_(0.25 * noise)
            elif name.endswith("bias") or name.endswith("sinks"):
                param.copy_(0.1 * noise)
            else:  # a projection, or a stack of experts': [E, out, in], gpt-oss's [E, in, out]
                transposed = architecture == "gpt-oss" and ".experts." in name
                fan_in = param.shape[1] if transposed else param.shape[-1]
                param.copy_(noise * (1.5 / math.sqrt(fan_in)))
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir


# Gemma 4 and the hybrid Qwen at widths the Triton kernels serve, every head count even (two
# GPUs): Gemma 4's windowed layers 8 query and 4 KV heads of 64, its global ones 8 of 128 and
# 2 KV heads whose values are the keys, per-layer inputs, a KV-shared last layer, softcapped
# logits (its MoE: 16 experts beside the MLP, best 4); the hybrid's Gated DeltaNet layers 4 key
# and 8 value heads of 128 (Qwen3.6-35B-A3B's dims), its gated full-attention layer 8 query
# and 4 KV heads of 64 (its MoE: 16 experts, best 4, and the gated shared expert).
_GEMMA4 = {
    "head_dim": 64, "global_head_dim": 128, "num_global_key_value_heads": 2,
    "attention_k_eq_v": True, "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"] * 2, "final_logit_softcapping": 30.0,
}  # fmt: skip
_QWEN3_5 = {
    "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
}  # fmt: skip
_NEW_FAMILY_CONFIGS = {
    "gemma4": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {**_GEMMA4, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 4096,
         "num_kv_shared_layers": 1},
    ),
    "gemma4-moe": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {**_GEMMA4, "hidden_size_per_layer_input": 0, "enable_moe_block": True,
         "num_experts": 16, "top_k_experts": 4, "moe_intermediate_size": 256},
    ),
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", _QWEN3_5),
    "qwen3.5-moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {**_QWEN3_5, "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256,
         "shared_expert_intermediate_size": 512},
    ),
}  # fmt: skip
NEW_FAMILY_ARCHITECTURES = tuple(_NEW_FAMILY_CONFIGS)


def save_gpu_new_family_model(model_dir: Path, architecture: str, seed: int = 0) -> Path:
    """A random Gemma 4 or hybrid Qwen (`architecture` one of NEW_FAMILY_ARCHITECTURES), with
    the engine tests' O(1) re-draw of its weights."""
    import transformers

    from tests.appliance.engine.models.conftest import redraw_weights

    config_name, model_name, overrides = _NEW_FAMILY_CONFIGS[architecture]
    config = getattr(transformers, config_name)(
        hidden_size=512,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_hidden_layers=4,
        vocab_size=4096,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        **overrides,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    redraw_weights(model, seed)
    model.save_pretrained(model_dir, safe_serialization=True)
    return model_dir
