"""Load a model directory's safetensors into a model, one tensor at a time.

The model is built on the meta device and materialised empty on the target device; each
checkpoint tensor is then read (memory-mapped), converted and copied into its slice of the fused
parameter, and dropped. Peak host memory is the model plus one tensor, never two models.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.llama import LlamaForCausalLM
from kernels.ops import KernelOps

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Checkpoint name (inside a layer) -> (our parameter, which shard of the fused rows).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}
# Buffers some checkpoints carry that are recomputed here.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: KernelOps | None = None,
) -> LlamaForCausalLM:
    """Build the architecture in `model_dir/config.json` and fill it from its safetensors.

    Raises ModelLoadError naming the file for a missing directory or config, an unsupported
    architecture, a corrupt or truncated safetensors file, or missing/unexpected/misshapen
    tensors.
    """
    config = ModelConfig.from_model_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config) if ops is None else LlamaForCausalLM(config, ops)
    model.to_empty(device=device)
    model.to(dtype)
    params = dict(model.named_parameters())
    shard_sizes = _shard_sizes(config)
    missing = {(name, shard) for name in params for shard in _shards_of(name, shard_sizes)}
    for path, name, tensor in _read_tensors(Path(model_dir)):
        if _IGNORED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        target, fused, shard = _map_name(name)
        if target not in params:
            raise ModelLoadError(
                f"{path.name}: unexpected tensor {name!r} for {config.architecture}"
            )
        dest = params[target].data
        if fused is not None:
            sizes = shard_sizes[fused]
            start = sum(sizes[:shard])
            dest = dest[start : start + sizes[shard]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        missing.discard((target, shard))
    if missing:
        names = sorted({name for name, _ in missing})
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise ModelLoadError(f"{model_dir}: the checkpoint lacks tensors for {shown}")
    model.init_rope_tables(config.max_model_len)
    return model.eval()


def _shard_sizes(config: ModelConfig) -> dict[str, list[int]]:
    """Rows of each fused projection, in checkpoint order ([q; k; v] and [gate; up])."""
    kv = config.num_kv_heads * config.head_dim
    return {
        "self_attn.qkv_proj": [config.num_heads * config.head_dim, kv, kv],
        "mlp.gate_up_proj": [config.intermediate_size, config.intermediate_size],
    }


def _shards_of(param: str, shard_sizes: dict[str, list[int]]) -> list[int | None]:
    module = param.rsplit(".", 1)[0]
    for fused, sizes in shard_sizes.items():
        if module.endswith(fused):
            return list(range(len(sizes)))
    return [None]


def _map_name(name: str) -> tuple[str, str | None, int | None]:
    """Checkpoint tensor name -> (our parameter, fused projection or None, shard index)."""
    if name == "lm_head.weight":
        return "lm_head", None, None
    match = _LAYER.match(name)
    if match:
        index, rest = match.groups()
        module, _, kind = rest.rpartition(".")
        if module in _FUSED:
            fused, shard = _FUSED[module]
            return f"layers.{index}.{fused}.{kind}", fused, shard
        return f"layers.{index}.{rest}", None, None
    return name.removeprefix("model."), None, None


def _read_tensors(model_dir: Path) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    yield path, name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{path} is not a valid safetensors file ({exc}); re-convert or re-copy the model"
            ) from exc


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if not single.exists():
        raise ModelLoadError(f"{model_dir} has no model.safetensors (nor an index of shards)")
    return [single]
