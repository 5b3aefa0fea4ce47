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
