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

    arch: str  # "llama", "mistral" or "qwen2"
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


def _classes(arch: str) -> tuple[type, type]:
    import transformers

    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    }[arch]


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """transformers' model for variant `name`, float32, eval mode, seeded random weights."""
    variant = VARIANTS[name]
    config_class, model_class = _classes(variant.arch)
    dims = dict(TINY_DIMS)
    if variant.arch == "qwen2":
        dims.pop("head_dim")  # Qwen2 derives it: 64 / 4 = 16
    config = config_class(num_hidden_layers=variant.num_layers, **dims, **variant.overrides)
    torch.manual_seed(seed)
    model = model_class(config).eval()
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
            else:
                param.copy_(noise * (1.5 / math.sqrt(param.shape[1])))
    return model


def save_checkpoint(model: torch.nn.Module, model_dir: Path, **kwargs: Any) -> Path:
    model.save_pretrained(model_dir, safe_serialization=True, **kwargs)
    return model_dir


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """name -> (model directory, transformers' model with the same weights), built once each."""
    cache: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(name: str) -> tuple[Path, torch.nn.Module]:
        if name not in cache:
            model = build_hf_model(name)
            model_dir = save_checkpoint(model, tmp_path_factory.mktemp(name.replace(".", "_")))
            cache[name] = (model_dir, model)
        return cache[name]

    return get
