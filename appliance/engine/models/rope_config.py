"""Rotary position embedding's parameters, as config.json gives them: `RopeConfig`, parsed once.

The tables they define are `models.rotary`'s. No torch here: a model's config is read by the
start-up before torch is imported (docs/ARCHITECTURE.md, "Start-up").
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from appliance.engine.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = frozenset(
    {"default", "linear", "llama3", "yarn", "longrope", "proportional"}
)


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Base frequency and optional context-extension scaling. Fields a type does not use keep
    their defaults; `attention_factor` None means "derived from the scaling" (yarn, longrope)."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # longrope: one factor per rotary frequency, short below the original context, long above
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    # proportional (Gemma 4's global layers): only the first `proportion` of each half's
    # frequencies turn, with exponents over the whole head; the rest are 0 (cos 1, sin 0), so
    # dims i and i + D/2 are a rotated pair for i < proportion * D/2 and the others pass through.
    proportion: float = 1.0

    @classmethod
    def parse(cls, params: Mapping[str, Any], raw: Mapping[str, Any], *, source: str) -> RopeConfig:
        """From one transformers 5 `rope_parameters` dict (or an older `rope_scaling`) of the
        config.json `raw`, whose top-level `rope_theta`, `original_max_position_embeddings` and
        `max_position_embeddings` fill what the dict leaves out, as transformers does."""
        rope_type = params.get("rope_type", params.get("type", "default"))
        if raw.get("architectures") == ["Phi3ForCausalLM"] and rope_type in ("su", "yarn"):
            rope_type = "longrope"  # Phi-3's names for it before transformers settled on one
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"{source}: rope scaling {rope_type!r} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ROPE_TYPES))}"
            )
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        kwargs: dict[str, Any] = {
            "theta": _number(theta, "rope_theta", source),
            "rope_type": rope_type,
        }
        for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            if params.get(key):
                kwargs[key] = _number(params[key], key, source)
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                kwargs[key] = _number(params[key], key, source)
        if params.get("truncate") is not None:
            kwargs["truncate"] = bool(params["truncate"])
        # Phi-3 keeps the pretraining context at the top level, and there it takes precedence.
        original = None
        if rope_type in ("llama3", "yarn", "longrope"):
            original = raw.get("original_max_position_embeddings")
        if original is None:
            original = params.get("original_max_position_embeddings")
        if original is None and rope_type in ("llama3", "yarn", "longrope"):
            original = raw.get("max_position_embeddings")
        if original is not None:
            if not isinstance(original, int) or isinstance(original, bool) or original < 1:
                raise ModelLoadError(
                    f"{source}: 'original_max_position_embeddings' must be a positive integer, "
                    f"got {original!r}"
                )
            kwargs["original_max_position_embeddings"] = original
        factor = params.get("factor")
        if factor is None and rope_type in ("yarn", "longrope"):
            # Phi-3 and DeepSeek leave it out: the extension is the ratio of the two contexts.
            factor = raw.get("max_position_embeddings", original) / original
        if factor is not None:
            kwargs["factor"] = _number(factor, "factor", source)
        if rope_type == "proportional" and params.get("partial_rotary_factor") is not None:
            proportion = _number(params["partial_rotary_factor"], "partial_rotary_factor", source)
            if not 0 < proportion <= 1:
                raise ModelLoadError(
                    f"{source}: rope 'partial_rotary_factor' must be in (0, 1], got {proportion}"
                )
            kwargs["proportion"] = proportion
        if rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                values = params.get(key)
                if not isinstance(values, list) or not values:
                    raise ModelLoadError(f"{source}: longrope scaling needs a list {key!r}")
                kwargs[key] = tuple(_number(v, key, source) for v in values)
        return cls(**kwargs)


def _number(value: Any, key: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ModelLoadError(f"{source}: rope {key!r} must be a finite number, got {value!r}")
    return float(value)
