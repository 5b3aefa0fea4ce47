"""The architecture of a model directory, parsed once from its `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.quantization import Fp8Checkpoint

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary position embedding: base frequency and optional context-extension scaling."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    sliding_window: int | None = None
    # An FP8 checkpoint's layout (config.json's quantization_config); None: unquantized.
    fp8: Fp8Checkpoint | None = None

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
    def from_dict(cls, raw: dict[str, Any], *, source: str = "config") -> ModelConfig:
        def need(key: str, default: int | None = None) -> int:
            value = raw.get(key)
            if value is None:
                value = default
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(f"{source}: {key!r} must be a positive integer, got {value!r}")
            return value

        archs = raw.get("architectures")
        arch = archs[0] if isinstance(archs, list) and archs else None
        if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        num_heads = need("num_attention_heads")
        hidden_size = need("hidden_size")
        head_dim = need("head_dim", hidden_size // num_heads)
        num_kv_heads = need("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ModelLoadError(
                f"{source}: num_attention_heads {num_heads} is not a multiple of "
                f"num_key_value_heads {num_kv_heads}"
            )
        sliding_window = None
        if raw.get("sliding_window") is not None and (
            arch != "Qwen2ForCausalLM" or raw.get("use_sliding_window", False)
        ):
            sliding_window = need("sliding_window")
        attention_bias = bool(raw.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=need("vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=need("max_position_embeddings"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(raw, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or arch == "Qwen2ForCausalLM",
            o_bias=attention_bias,
            sliding_window=sliding_window,
            fp8=Fp8Checkpoint.from_config(raw.get("quantization_config"), source),
        )

    @property
    def max_model_len(self) -> int:
        """Longest context this engine serves exactly: with a sliding window shorter than the
        position limit, full attention is only equivalent up to the window."""
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings


def _parse_rope(raw: dict[str, Any], source: str) -> RopeConfig:
    # transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` plus an
    # optional `rope_scaling` dict whose type key was once called "type".
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{source}: rope scaling {rope_type!r} is not supported; "
            f"supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
        )
    kwargs: dict[str, Any] = {"theta": float(theta), "rope_type": rope_type}
    for key in (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ):
        if params.get(key) is not None:
            kwargs[key] = params[key]
    return RopeConfig(**kwargs)
