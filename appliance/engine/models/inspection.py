"""What `inferno model inspect DIR` reports about a model directory, without loading weights.

The config is parsed as the engine parses it, and the loader runs dry on the meta device (the
safetensors headers only), so "served: yes" means the engine's own checks passed: a supported
architecture and settings, every tensor present with the shape the config needs, no stray one.
Anything else is one line naming what is not supported.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.fused_experts import mxfp4_num_params
from appliance.engine.models.loader import checkpoint_files, load_model
from appliance.engine.models.recurrent_state import (
    HYBRID_PREFIX_CACHING_OFF,
    state_bytes_per_slot,
)

# The KV cache's dtype on the GPU (the engine's default there).
_KV_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class ModelReport:
    architecture: str
    lines: list[tuple[str, str]]  # (what, value), in display order
    unsupported: str | None  # why the engine would refuse it, or None: it serves it

    def render(self) -> str:
        rows = [*self.lines, ("served", "yes" if self.unsupported is None else "no")]
        if self.unsupported is not None:
            rows.append(("not supported", self.unsupported))
        width = max(len(what) for what, _ in rows)
        return "\n".join(f"{what:<{width}}  {value}" for what, value in rows)


def inspect_model(model_dir: Path) -> ModelReport:
    """Raises ModelLoadError only for a directory without a readable config.json."""
    config_path = Path(model_dir) / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path} is not readable JSON: {exc}") from exc
    archs = raw.get("architectures") if isinstance(raw, dict) else None
    architecture = str(archs[0]) if isinstance(archs, list) and archs else "(none given)"
    lines = [("architecture", architecture)]
    quantization = raw.get("quantization_config") if isinstance(raw, dict) else None
    mxfp4 = isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"
    lines += _tensor_lines(Path(model_dir), mxfp4=mxfp4)
    try:
        config = ModelConfig.from_dict(raw, source=str(config_path))
    except ModelLoadError as exc:
        return ModelReport(architecture, lines, str(exc))
    lines += _config_lines(config)
    lines += _unserved_lines(Path(model_dir), config)
    try:
        load_model(model_dir, device="meta")
    except ModelLoadError as exc:
        return ModelReport(architecture, lines, str(exc))
    return ModelReport(architecture, lines, None)


def _tensor_lines(model_dir: Path, *, mxfp4: bool) -> list[tuple[str, str]]:
    """The parameters and their dtypes. An MXFP4 checkpoint's experts count as the dequantized
    model has them (two FP4 parameters per byte of blocks, its scales none)."""
    try:
        files = checkpoint_files(model_dir)
        num_params, dtypes = 0, Counter[str]()
        for path in files:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    view = f.get_slice(name)
                    numel = 1
                    for n in view.get_shape():
                        numel *= n
                    count = mxfp4_num_params(name, numel) if mxfp4 else numel
                    if count:
                        num_params += count
                        # FP4 codes two to a byte: their dtype is MXFP4, not the bytes'.
                        dtypes["MXFP4" if count > numel else view.get_dtype()] += count
    except (ModelLoadError, OSError, RuntimeError, ValueError) as exc:
        return [("weights", f"unreadable ({exc})")]
    shown = ", ".join(f"{d} {n / num_params:.0%}" for d, n in dtypes.most_common())
    return [
        ("parameters", f"{_count(num_params)} ({num_params:,}) in {len(files)} file(s)"),
        ("dtype", shown or "no tensors"),
    ]


def _count(num_params: int) -> str:
    return f"{num_params / 1e9:.2f} B" if num_params >= 1e9 else f"{num_params / 1e6:.2f} M"


def _config_lines(config: ModelConfig) -> list[tuple[str, str]]:
    # Over the layers that attend (a hybrid's linear layers have no window or KV).
    attending = [i for i in range(config.num_layers) if not config.is_linear_layer(i)]
    windows = Counter(config.layer_windows[i] for i in attending)
    num_layers = config.num_layers
    if None in windows and len(windows) == 1:
        window_text = f"none: full attention on all {num_layers} layers"
        if len(attending) < num_layers:
            window_text = f"none: full attention on {len(attending)} of {num_layers} layers"
    else:
        parts = [
            f"{w} tokens on {n} of {num_layers} layers" for w, n in windows.items() if w is not None
        ]
        if windows[None]:
            parts.append(f"full attention on {windows[None]}")
        window_text = "; ".join(parts)
    # Only layers that own KV pages count (Gemma 4's KV-shared layers read another's).
    kv_layers = config.kv_layers
    kv_width = sum(config.num_kv_heads_of(i) * config.head_dim_of(i) for i in kv_layers)
    kv_bytes = 2 * kv_width * _KV_DTYPE.itemsize
    kv_owners = "all layers" if len(kv_layers) == num_layers else f"{len(kv_layers)} layers own KV"
    fp8 = config.fp8
    if config.mxfp4_experts:
        quantization = "MXFP4 experts, dequantized to bf16 on load"
    elif fp8 is None:
        quantization = "none"
    else:
        scales = f"{fp8.scales} weight scales" + (
            f" in {fp8.block_size[0]}x{fp8.block_size[1]} blocks" if fp8.block_size else ""
        )
        inputs = "static input scales" if fp8.static_input else "per-token input scales"
        quantization = f"FP8 e4m3 projections, {scales}, {inputs}"
        if config.moe is not None:
            quantization += "; FP8 e4m3 experts, a scale per output channel of each expert"
    return [
        ("quantization", quantization),
        *_expert_lines(config),
        ("context", f"{config.max_model_len} tokens"),
        ("windows", window_text),
        ("KV bytes/token", f"{kv_bytes:,} ({kv_bytes / 1024:.0f} KiB in bf16, {kv_owners})"),
        *_kv_group_lines(config),
        *_hybrid_lines(config),
    ]


def _kv_group_lines(config: ModelConfig) -> list[tuple[str, str]]:
    """A model with windowed and full layers: the two KV pools' bytes per token (the window
    group's kept for a window's blocks per sequence: appliance.engine.kv_cache)."""
    window_group = set(config.window_group)
    if not window_group:
        return []

    def bytes_per_token(layers: list[int]) -> int:
        width = sum(config.num_kv_heads_of(i) * config.head_dim_of(i) for i in layers)
        return 2 * width * _KV_DTYPE.itemsize

    full = [i for i in config.kv_layers if i not in window_group]
    full_bytes, window_bytes = bytes_per_token(full), bytes_per_token(sorted(window_group))
    num_kv = len(config.kv_layers)
    return [
        (
            "KV groups",
            f"full {full_bytes:,} B/token ({len(full)} of {num_kv} KV layers) for every token; "
            f"window {window_bytes:,} B/token ({len(window_group)} of {num_kv}) for the last "
            f"{config.window_group_window} of each sequence",
        )
    ]


def _unserved_lines(model_dir: Path, config: ModelConfig) -> list[tuple[str, str]]:
    """The checkpoint's parts this appliance does not serve (a multimodal model's towers),
    named, with how many of its tensors are skipped."""
    layout = config.family.layout
    try:
        num_unserved = 0
        for path in checkpoint_files(model_dir):
            with safe_open(path, framework="pt", device="cpu") as f:
                num_unserved += sum(layout.is_unserved(name) for name in f.keys())  # noqa: SIM118
    except (ModelLoadError, OSError, RuntimeError, ValueError):
        return []  # the weights line already says they are unreadable
    if not num_unserved:
        return []
    return [("not served", f"{num_unserved} tensors of {layout.unserved_part}")]


def _hybrid_lines(config: ModelConfig) -> list[tuple[str, str]]:
    """A hybrid model's linear layers, their state per sequence, and why it has no prefix
    cache."""
    linear = config.linear_attention
    if linear is None:
        return []
    layers = (
        f"Gated DeltaNet on {linear.num_linear_layers} of {config.num_layers} layers "
        f"({linear.num_key_heads} key heads of {linear.key_head_dim}, {linear.num_value_heads} "
        f"value heads of {linear.value_head_dim}, conv of {linear.conv_kernel_size})"
    )
    state_bytes = state_bytes_per_slot(linear, _KV_DTYPE)
    return [
        ("linear attention", layers),
        (
            "state/sequence",
            f"{state_bytes:,} ({state_bytes / 2**20:.2f} MiB, fixed at any context length)",
        ),
        ("prefix caching", HYBRID_PREFIX_CACHING_OFF.removeprefix("prefix caching is ")),
    ]


def _expert_lines(config: ModelConfig) -> list[tuple[str, str]]:
    """A mixture of experts' experts, and the parameters one token's forward pass reads: all
    but the experts its router did not choose (the model's own, counted on the meta device)."""
    moe = config.moe
    if moe is None:
        return []
    router = moe.router
    shared = (
        f", a shared expert of intermediate size {moe.shared_expert_size}"
        if moe.shared_expert_size
        else ""
    )
    experts = (
        f"{router.num_experts} of intermediate size {moe.expert_size} on {moe.num_moe_layers} "
        f"of {config.num_layers} layers, {router.top_k} active per token{shared}"
    )
    with torch.device("meta"):
        total = sum(p.numel() for p in CausalLM(config).parameters())
    per_expert = 3 * config.hidden_size * moe.expert_size
    if moe.expert_bias:
        per_expert += 2 * moe.expert_size + config.hidden_size
    active = total - moe.num_moe_layers * (router.num_experts - router.top_k) * per_expert
    return [
        ("experts", experts),
        ("active parameters", f"{_count(active)} ({active:,}) of {_count(total)} per token"),
    ]
