"""Load a model directory's safetensors into a model, one tensor at a time.

The model is built on the meta device and materialised empty on the target device; each
checkpoint tensor is then read (memory-mapped), converted and copied into its slice of the fused
parameter, and dropped. Peak host memory is the model plus one tensor, never two models.

A sealed model's weights never exist as files: they are decrypted into memory
(attestation.sealed) and handed over as `weights`, safetensors images by file name, whose
tensors are read in place (`torch.frombuffer`, no copy) after their header is validated here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.checkpoint_layout import LLAMA_LAYOUT, CheckpointLayout
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.fused_experts import convert_fused_experts
from appliance.engine.models.fused_rows import FUSED_PARTS, fused_row_sizes
from appliance.engine.models.layers import RMSNorm
from appliance.engine.models.linear_attention import GATED_NORM_WEIGHT
from appliance.engine.models.projections import quantize_projections, use_fp8_projections
from appliance.engine.models.quantization import Fp8Checkpoint
from appliance.engine.models.sparse_moe import Experts, quantize_expert_rows
from appliance.engine.parallel.sharding import ShardPlan, shard_model
from kernels.fp8 import FP8_DTYPE, dequantize_blocks, quantize_rows
from kernels.ops import KernelOps

logger = logging.getLogger(__name__)

# What `engine.quantization` may ask of an unquantized checkpoint.
Quantization = Literal["fp8"]

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# One expert's projection of a mixture of experts, stacked here into [E, ...] parameters: its
# weight, and in an FP8 checkpoint its per-channel (or per-tensor) `weight_scale` or its
# 128x128-block `weight_scale_inv`.
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\."
    r"(weight|weight_scale|weight_scale_inv)$"
)
# Our stacked expert parameters (inside a layer), FP8 experts' scales with them, and how many
# pieces each expert fills.
_STACKED_EXPERTS = {
    "mlp.experts.gate_up_proj": 2,
    "mlp.experts.down_proj": 1,
    "mlp.experts.gate_up_proj_scale": 2,
    "mlp.experts.down_proj_scale": 1,
}
# Every family's stacked expert weights (Gemma 4's block is `moe`, the others' `mlp`).
_EXPERT_STACKS = ("experts.gate_up_proj", "experts.down_proj")
# Buffers some checkpoints carry that are recomputed here.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
# The FP8 KV-cache scales FP8 checkpoints ship, by the names their tools write (inside a
# layer; the names vLLM accepts): llm-compressor / compressed-tensors' `self_attn.k_scale` and
# `v_scale`, its older `k_proj.output_scale` / `v_proj.output_scale`, ModelOpt's
# `k_proj.k_scale` / `v_proj.v_scale`, and AutoFP8's `self_attn.kv_scale` (one scale for both).
# -> which of our scales each sets.
_KV_SCALES = {
    "self_attn.k_scale": ("k_scale",),
    "self_attn.v_scale": ("v_scale",),
    "self_attn.k_proj.output_scale": ("k_scale",),
    "self_attn.v_proj.output_scale": ("v_scale",),
    "self_attn.k_proj.k_scale": ("k_scale",),
    "self_attn.v_proj.v_scale": ("v_scale",),
    "self_attn.kv_scale": ("k_scale", "v_scale"),
}
# A shard index names files and tensors; the largest real ones are a few MiB.
_MAX_INDEX_BYTES = 64 << 20


def build_model(
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: KernelOps | None,
    shard: ShardPlan | None,
    quantization: Quantization | None = None,
) -> CausalLM:
    """The architecture (one rank's part with `shard`), its parameters allocated on `device`
    in `dtype` and left empty; an FP8 checkpoint's projections as empty Fp8Linears. A
    mixture's experts are FP8 (empty, models.sparse_moe.Experts.use_fp8) for an FP8 checkpoint
    and under `quantization="fp8"`: the loader quantizes each expert tensor as it is read."""
    with torch.device("meta"):
        model = CausalLM(config) if ops is None else CausalLM(config, ops)
    if shard is not None:
        shard_model(model, shard)
    model.to(dtype)  # on the meta device: the parameters are then allocated in their dtype
    _offset_norms_in_float32(model)
    if config.fp8 is not None:
        keep = functools.partial(_left_unquantized, config.fp8)
        use_fp8_projections(model, keep, static_input_scale=config.fp8.static_input)
    if config.fp8 is not None or quantization == "fp8":
        for module in model.modules():
            if isinstance(module, Experts):
                module.use_fp8()
    _allocate(model, device)
    model.reset_kv_scales()
    return model


def _allocate(model: CausalLM, device: torch.device | str) -> None:
    """`model.to_empty(device=device)` without, for contiguous tensors (every one a model is
    built of), its `empty_like` of a meta tensor, whose Python decomposition imports sympy: up to
    0.3 s on the sealed start's path (W5, docs/BENCHMARKS.md, round 10). `_apply` is what
    `to_empty` runs; another layout still goes through `empty_like`, as it would there."""

    def empty(t: torch.Tensor) -> torch.Tensor:
        if t.is_contiguous():
            return torch.empty(t.size(), dtype=t.dtype, device=device)
        return torch.empty_like(t, device=device)

    model._apply(empty)


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: KernelOps | None = None,
    weights: Mapping[str, memoryview | bytearray | torch.Tensor] | None = None,
    shard: ShardPlan | None = None,
    quantization: Quantization | None = None,
) -> CausalLM:
    """Build the architecture in `model_dir/config.json` and fill it from its safetensors, or,
    when `weights` is given, from those in-memory safetensors images (by file name) instead of
    the directory's files. On the meta device only the files' headers are read: every check
    below runs, no weight is loaded (`inferno model inspect`). With `shard`, build and fill one
    tensor-parallel rank's part
    (appliance.engine.parallel.sharding): from files, only that part of each tensor is read
    (a projection the checkpoint stores fused is read whole and split here).

    `dtype` is the model's; an FP8 checkpoint (config.json's quantization_config,
    models.quantization) keeps its projections in FP8 with a scale per output channel, and
    `quantization="fp8"` quantizes an unquantized checkpoint's projections so (models.projections);
    a mixture's experts likewise (models.sparse_moe.Experts), each expert tensor as it is read.

    Raises ModelLoadError naming the file for a missing directory or config, an unsupported
    architecture or quantization, a corrupt or truncated safetensors file or image, a shard
    index that names a file outside the directory, or missing/unexpected/misshapen tensors.
    """
    config = ModelConfig.from_model_dir(model_dir)
    part_of = parts_of(shard, config.family.layout)
    shapes_only = torch.device(device).type == "meta"  # a dry run: names and shapes checked
    tensors = (
        _read_tensors(Path(model_dir), part_of, shapes_only=shapes_only)
        if weights is None
        else _read_images(model_dir, weights, part_of)
    )
    model = build_model(
        config, dtype=dtype, device=device, ops=ops, shard=shard, quantization=quantization
    )
    return _load_into(model, tensors, shard=shard, source=str(model_dir), quantization=quantization)


def load_state_dict(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: KernelOps | None = None,
    quantization: Quantization | None = None,
) -> CausalLM:
    """Build `config`'s architecture and fill it from `state_dict`, tensors already in memory
    by checkpoint name (on any device): the tensors of a transformers model of the same
    architecture (its `state_dict()`), mapped by the same names, layouts and checks as
    `load_model`'s files. The tensors are copied; the mapping is left as it was.

    Raises ModelLoadError as `load_model` does for missing, unexpected or misshapen tensors.
    """
    source = Path("state_dict")
    tensors = ((source, name, tensor) for name, tensor in state_dict.items())
    model = build_model(
        config, dtype=dtype, device=device, ops=ops, shard=None, quantization=quantization
    )
    return _load_into(
        model, tensors, shard=None, source="the state dict", quantization=quantization
    )


def _load_into(
    model: CausalLM,
    tensors: Iterator[tuple[Path, str, torch.Tensor]],
    *,
    shard: ShardPlan | None,
    source: str,
    quantization: Quantization | None,
) -> CausalLM:
    """Copy checkpoint tensors (each with the file it came from) into `model`'s empty
    parameters through its family's checkpoint layout, then quantize if asked and build the
    rope tables. Raises ModelLoadError naming `source` when tensors are missing."""
    config = model.config
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith(".input_scale"):
            param.data.zero_()  # the largest of the fused modules' static scales is kept
    shard_sizes = fused_row_sizes(config, 1 if shard is None else shard.size)
    # A checkpoint storing fused projections (Phi-3) has layers alike: layer 0's rows say all.
    checkpoint_rows = {
        k.split(".", 2)[2]: tuple(v)
        for k, v in fused_row_sizes(config).items()
        if k.startswith("layers.0.")
    }
    held = _held_experts(config, shard)
    missing = {(name, part) for name in params for part in _pieces_of(name, held, shard_sizes)}
    layout = config.family.layout
    blocks = _BlockScaledWeights(config, shard)
    block_scaled = config.fp8 is not None and config.fp8.scales == "block"
    expert_blocks = _BlockScaledExperts(config)

    if layout.gpt_oss_experts:
        tensors = convert_fused_experts(tensors)
    num_unserved = 0
    for path, name, tensor in tensors:
        pieces = layout.pieces(name, checkpoint_rows)
        num_unserved += not pieces
        for piece in pieces:
            part = tensor if piece.stop is None else tensor[piece.start : piece.stop]
            canonical = piece.name
            grouped = None if shard is None else shard.grouped_part(canonical, part)
            if grouped is not None:  # a linear attention's q, k and v rows: three ranges
                part = grouped
            if _IGNORED.search(canonical) or (
                canonical == "lm_head.weight" and config.tie_word_embeddings
            ):
                continue
            if _load_kv_scale(model, path, canonical, part):
                continue
            filled = _load_expert(params, config, held, canonical, part, expert_blocks, path.name)
            if filled is not None:
                missing -= filled
                continue
            target, fused, index = _map_name(canonical)
            module, _, kind = target.rpartition(".")
            if kind == "weight_scale_inv" and f"{module}.weight" in params:
                blocks.add_scales(params, module, index, part, path=path, name=name)
                missing -= blocks.finished(params)
                continue
            if target not in params:
                raise ModelLoadError(
                    f"{path.name}: unexpected tensor {name!r} for {config.architecture}"
                )
            if piece.stop is not None and shard is not None:
                split = shard.split(target, tuple(part.shape))
                if split is not None:
                    part = part.narrow(split[0], split[1], split[2] - split[1])
            dest = params[target].data
            if target.endswith(_EXPERT_STACKS) and dest.dtype == FP8_DTYPE:
                _quantize_expert_stack(params, target, part, where=f"{path.name}: tensor {name!r}")
                missing -= {
                    (stack, piece)
                    for stack in (target, f"{target}_scale")
                    for piece in _pieces_of(stack, held, shard_sizes)
                }
                continue
            if fused is not None and kind != "input_scale":
                sizes = shard_sizes[module]
                start = sum(sizes[:index])
                dest = dest[start : start + sizes[index]]
            if (
                config.norm_weight_offset
                and target.endswith("norm.weight")
                and not target.endswith(GATED_NORM_WEIGHT)
            ):
                part = part.float() + config.norm_weight_offset  # Gemma's (1 + w), in float32
            _copy_tensor(dest, part, kind, where=f"{path.name}: tensor {name!r}")
            missing.discard((target, index))
            if target.endswith(tuple(_STACKED_EXPERTS)):  # stored stacked: every expert at once
                missing -= {(target, piece) for piece in _pieces_of(target, held, shard_sizes)}
            if block_scaled and kind == "weight" and dest.dtype == FP8_DTYPE:
                blocks.add_weight(module, index)
                missing -= blocks.finished(params)
    if missing:
        names = sorted({name for name, _ in missing})
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise ModelLoadError(f"{source}: the checkpoint lacks tensors for {shown}")
    if num_unserved:
        logger.info("skipped %d tensors of %s", num_unserved, layout.unserved_part)
    if shard is not None:
        shard.finish_load(model)
    if quantization == "fp8" and config.fp8 is None:
        quantize_projections(model)
    model.init_rope_tables(config.max_model_len)
    return model.eval()


def random_model(
    model_dir: Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str,
    ops: KernelOps,
    shard: ShardPlan | None = None,
    seed: int = 0,
    quantization: Quantization | None = None,
) -> CausalLM:
    """The architecture of `model_dir/config.json` (one rank's part with `shard`) with
    normal(0, 0.02) weights drawn on `device` and norm weights 1: benchmarks of shapes whose
    checkpoint is not at hand. Each rank draws its own (the model computes nothing meaningful).
    With `quantization="fp8"`, or for an FP8 checkpoint's directory, the projections and
    experts are then quantized (models.projections, models.sparse_moe), so warm-up compiles the
    kernels that model runs."""
    config = ModelConfig.from_model_dir(model_dir)
    model = build_model(
        dataclasses.replace(config, fp8=None), dtype=dtype, device=device, ops=ops, shard=shard
    )
    fill_randomly(model, seed + (0 if shard is None else shard.rank))
    if quantization == "fp8" or config.fp8 is not None:
        for module in model.modules():
            if isinstance(module, Experts):
                module.quantize()
        quantize_projections(model)
    model.init_rope_tables(config.max_model_len)
    return model.eval()


def fill_randomly(model: nn.Module, seed: int) -> None:
    """Every parameter normal(0, 0.02) but those named "*norm.weight" (1), drawn from `seed` on
    the model's device in parameter order: random_model's weights, and those of a peer's model
    given the same shapes (bench/gpt_fast_peer.py)."""
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)


def _load_kv_scale(model: CausalLM, path: Path, name: str, tensor: torch.Tensor) -> bool:
    """Set a layer's FP8 KV-cache scale(s) if `name` is one; whether it was. Only per-tensor
    scales: one positive finite value (every tensor-parallel rank reads the same)."""
    match = _LAYER.match(name)
    if match is None or match.group(2) not in _KV_SCALES:
        return False
    index = int(match.group(1))
    if index >= len(model.layers):
        raise ModelLoadError(f"{path.name}: tensor {name!r} is for a layer the config lacks")
    if tensor.numel() != 1:
        raise ModelLoadError(
            f"{path.name}: KV-cache scale {name!r} has shape {tuple(tensor.shape)}; only one "
            "scale per tensor (per layer) is supported"
        )
    value = tensor.float().reshape(1)
    if not (torch.isfinite(value).all() and (value > 0).all()):
        raise ModelLoadError(
            f"{path.name}: KV-cache scale {name!r} is {value.item()}; it must be positive and "
            "finite"
        )
    attn = model.layers[index].self_attn
    if attn is None:
        raise ModelLoadError(f"{path.name}: tensor {name!r} is for a linear-attention layer")
    for which in _KV_SCALES[match.group(2)]:
        getattr(attn, which).copy_(value)
    return True


def _copy_tensor(dest: torch.Tensor, tensor: torch.Tensor, kind: str, *, where: str) -> None:
    """Copy a checkpoint tensor into its parameter (or slice of one). FP8 weights only into FP8
    parameters (a cast would drop their scales); a weight scale of one number becomes every
    output channel's; a static input scale keeps the largest of a fused module's."""
    if (tensor.dtype == FP8_DTYPE) != (dest.dtype == FP8_DTYPE):
        raise ModelLoadError(
            f"{where} is {tensor.dtype}, but its parameter is {dest.dtype}: the checkpoint does "
            "not match its config.json's quantization_config"
        )
    if kind in ("weight_scale", "input_scale"):
        if tensor.numel() == 1:
            tensor = tensor.reshape(1).expand(dest.shape)
        elif tuple(tensor.shape) in ((dest.shape[0], 1), (dest.shape[0],)):
            tensor = tensor.reshape(dest.shape)
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ModelLoadError(
            f"{where} has shape {tuple(tensor.shape)}, the config needs {tuple(dest.shape)}"
        )
    if kind == "input_scale":
        torch.maximum(dest, tensor.to(dest.device, dest.dtype), out=dest)
    else:
        dest.copy_(tensor)


def _left_unquantized(fp8: Fp8Checkpoint, projection: str) -> bool:
    """Whether an FP8 checkpoint left our projection `projection` (e.g. layers.0.mlp.gate_up_
    proj) unquantized: all of its checkpoint modules ignored. Refuses a fused projection whose
    parts disagree (it has one dtype)."""
    layer, _, module = projection.partition(".")[2].partition(".")
    parts = [name for name, (fused, _) in FUSED_PARTS.items() if fused == module] or [module]
    ignored = {fp8.ignores(f"model.layers.{layer}.{part}") for part in parts}
    if len(ignored) > 1:
        raise ModelLoadError(
            f"config.json's quantization_config leaves only some of layer {layer}'s "
            f"{', '.join(parts)} unquantized; Inferno fuses them into one projection"
        )
    return ignored.pop()


class _BlockScaledWeights:
    """The block-scaled layout's weights, each requantized per output channel once both its
    FP8 rows and its block scales (`weight_scale_inv`) have been read, in either order."""

    def __init__(self, config: ModelConfig, shard: ShardPlan | None):
        self._config = config
        self._shard = shard
        self._shard_sizes = fused_row_sizes(config, 1 if shard is None else shard.size)
        self._weights: set[tuple[str, int | None]] = set()
        self._scales: dict[tuple[str, int | None], torch.Tensor] = {}

    def add_weight(self, module: str, piece: int | None) -> None:
        self._weights.add((module, piece))

    def add_scales(
        self,
        params: dict[str, nn.Parameter],
        module: str,
        piece: int | None,
        scales: torch.Tensor,
        *,
        path: Path,
        name: str,
    ) -> None:
        """scales: [ceil(out / bn), ceil(in / bk)], for the whole (unsharded) weight."""
        if self._config.fp8 is None or self._config.fp8.scales != "block":
            raise ModelLoadError(f"{path.name}: unexpected tensor {name!r} (no block layout)")
        # A copy: an image's tensors are views of a buffer the next file may reuse.
        device = params[f"{module}.weight"].device
        self._scales[(module, piece)] = scales.to(device, torch.float32, copy=True)

    def finished(self, params: dict[str, nn.Parameter]) -> set[tuple[str, int | None]]:
        """Requantize every weight whose rows and scales are both in; returns the (parameter,
        piece) pairs that are now filled."""
        done = set()
        for key in self._weights & self._scales.keys():
            module, piece = key
            rows, scale_rows = self._rows(params, module, piece)
            grid = self._grid(module, rows.shape, self._scales.pop(key))
            q, scale = quantize_rows(dequantize_blocks(rows, grid, self._block))
            rows.copy_(q)
            scale_rows.copy_(scale)
            self._weights.discard(key)
            done |= {(f"{module}.weight", piece), (f"{module}.weight_scale", piece)}
        return done

    @property
    def _block(self) -> tuple[int, int]:
        assert self._config.fp8 is not None and self._config.fp8.block_size is not None
        return self._config.fp8.block_size

    def _rows(
        self, params: dict[str, nn.Parameter], module: str, piece: int | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weight = params[f"{module}.weight"].data
        scale = params[f"{module}.weight_scale"].data
        if piece is None:
            return weight, scale
        sizes = self._shard_sizes[module]
        start = sum(sizes[:piece])
        return weight[start : start + sizes[piece]], scale[start : start + sizes[piece]]

    def _grid(self, module: str, shape: tuple[int, ...], scales: torch.Tensor) -> torch.Tensor:
        """The block scales of this rank's part (rows x columns of `shape`) of the weight."""
        (bn, bk), (n, k) = self._block, shape
        row, col = (0, 0) if self._shard is None else self._shard.offset(f"{module}.weight", shape)
        if row % bn or col % bk:
            raise ModelLoadError(
                f"{module}: the tensor-parallel split starts at row {row}, column {col}, inside "
                f"a {bn}x{bk} block of its scales; choose another tensor_parallel_size"
            )
        part = scales[row // bn : -(-(row + n) // bn), col // bk : -(-(col + k) // bk)]
        if tuple(part.shape) != (-(-n // bn), -(-k // bk)):
            raise ModelLoadError(
                f"{module}: block scales of shape {tuple(scales.shape)} do not cover its weight "
                f"in {bn}x{bk} blocks"
            )
        return part


class _BlockScaledExperts:
    """Per-expert FP8 weights of the block layout (Qwen3-30B-A3B-FP8's `weight_scale_inv`),
    each requantized per output channel into its expert's rows once both its FP8 rows and its
    block scales have been read, in either order, as `_BlockScaledWeights` does for the dense
    projections. Experts are never split (expert parallelism holds whole ones)."""

    def __init__(self, config: ModelConfig):
        self._block = config.fp8.block_size if config.fp8 is not None else None
        # (parameter, piece) -> [(FP8 rows [N, K], their scales [N, 1]) or None, grid or None]
        self._pending: dict[tuple[str, int], list[Any]] = {}

    def add(
        self,
        key: tuple[str, int],
        *,
        where: str,
        rows: tuple[torch.Tensor, torch.Tensor] | None = None,
        scales: torch.Tensor | None = None,
    ) -> set[tuple[str, int]]:
        """Record one half; returns the (parameter, piece) pairs filled once both are in."""
        assert self._block is not None, "only the block layout has block scales"
        entry = self._pending.setdefault(key, [None, None])
        if rows is not None:
            entry[0] = rows
        if scales is not None:
            # A copy: an image's tensors are views of a buffer the next file may reuse.
            entry[1] = scales.to(torch.float32, copy=True)
        if entry[0] is None or entry[1] is None:
            return set()
        del self._pending[key]
        (weight, scale), grid = entry
        (bn, bk), (n, k) = self._block, weight.shape
        if tuple(grid.shape) != (-(-n // bn), -(-k // bk)):
            raise ModelLoadError(
                f"{where}: block scales of shape {tuple(grid.shape)} do not cover its "
                f"{tuple(weight.shape)} weight in {bn}x{bk} blocks"
            )
        q, row_scales = quantize_rows(dequantize_blocks(weight, grid.to(weight.device), (bn, bk)))
        weight.copy_(q)
        scale.copy_(row_scales[:, None])
        target, piece = key
        return {(target, piece), (f"{target}_scale", piece)}


def _offset_norms_in_float32(model: CausalLM) -> None:
    """Gemma's and Qwen3.5's zero-centred norms keep their `1 + w` in float32 (a few KB): the
    kernels then scale in float32 and round once, as transformers computes `x * (1 + w.float())`
    (kernels.reference.rms_norm). In bfloat16 `1 + w` itself would lose w's low bits, and
    rounding the normed row first adds a second rounding: together enough to take Qwen3.5's
    bf16 log-probability error 20% past transformers' own (docs/BENCHMARKS.md)."""
    if not model.config.norm_weight_offset:
        return
    for name, module in model.named_modules():
        if isinstance(module, RMSNorm) and not f"{name}.weight".endswith(GATED_NORM_WEIGHT):
            module.float()


def _held_experts(config: ModelConfig, shard: ShardPlan | None) -> range:
    """The experts of each sparse layer this model holds: all, or one rank's (none: dense)."""
    if config.moe is None:
        return range(0)
    return range(config.moe.router.num_experts) if shard is None else shard.experts


def _pieces_of(param: str, held: range, shard_sizes: dict[str, list[int]]) -> list[int | None]:
    """The pieces a checkpoint fills parameter `param` from: a fused projection's parts, each
    held expert's part of a stacked expert parameter (gate 2e, up 2e + 1; down e, with e its
    index among the `held` experts), else the whole."""
    for stacked, per_expert in _STACKED_EXPERTS.items():
        if param.endswith(stacked) and held:
            return list(range(per_expert * len(held)))
    sizes = shard_sizes.get(param.rsplit(".", 1)[0])
    return [None] if sizes is None else list(range(len(sizes)))


def _load_expert(
    params: dict[str, nn.Parameter],
    config: ModelConfig,
    held: range,
    name: str,
    tensor: torch.Tensor,
    blocks: _BlockScaledExperts,
    where: str,
) -> set[tuple[str, int]] | None:
    """Copy one expert's projection (canonical `name`: its weight or, in an FP8 checkpoint,
    its scales) into its slice of the stacked expert parameters, which hold the `held`
    experts; returns the (parameter, piece) pairs now filled, or None when `name` is no
    expert's. FP8 experts take an FP8 weight as it is (its scales from their own tensors) and
    quantize any other per output channel as it comes."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    layer, projection, kind = match.group(1), match.group(3), match.group(4)
    stacked = "down_proj" if projection == "down" else "gate_up_proj"
    target = f"layers.{layer}.mlp.experts.{stacked}"
    fp8 = config.fp8
    expected = (
        kind == "weight"
        or (kind == "weight_scale" and fp8 is not None and fp8.scales != "block")
        or (kind == "weight_scale_inv" and fp8 is not None and fp8.scales == "block")
    )
    if target not in params or int(match.group(2)) not in held or not expected:
        raise ModelLoadError(f"{where}: unexpected tensor {name!r} for {config.architecture}")
    expert = int(match.group(2)) - held.start
    rows, piece = slice(None), expert
    if projection != "down":
        size = params[target].shape[1] // 2
        half = projection == "up"
        rows, piece = slice(half * size, (half + 1) * size), 2 * expert + half
    weight = params[target].data[expert, rows]  # [N, K]: I of [2I, H] or [H, I]
    at = f"{where}: tensor {name!r}"
    if weight.dtype != FP8_DTYPE:
        _copy_tensor(weight, tensor, "weight", where=at)
        return {(target, piece)}
    scale = params[f"{target}_scale"].data[expert, rows]  # [N, 1]
    filled = {(target, piece), (f"{target}_scale", piece)}
    if kind == "weight" and tensor.dtype != FP8_DTYPE:  # engine.quantization = "fp8"
        if tuple(tensor.shape) != tuple(weight.shape):
            raise ModelLoadError(
                f"{at} has shape {tuple(tensor.shape)}, the config needs {tuple(weight.shape)}"
            )
        quantize_expert_rows(tensor[None], weight[None], scale[None])
        return filled
    if kind == "weight_scale":
        _copy_tensor(scale, tensor, kind, where=at)
        return {(f"{target}_scale", piece)}
    if kind == "weight":
        _copy_tensor(weight, tensor, kind, where=at)
        if fp8 is None or fp8.scales != "block":
            return {(target, piece)}
        return blocks.add((target, piece), rows=(weight, scale), where=at)
    return blocks.add((target, piece), scales=tensor, where=at)


def _quantize_expert_stack(
    params: dict[str, nn.Parameter], target: str, tensor: torch.Tensor, *, where: str
) -> None:
    """A checkpoint's stacked experts ([E, N, K] in its dtype: gpt-oss's once converted,
    Gemma 4's, Qwen3.5-MoE's) quantized into FP8 experts, one expert at a time."""
    weight, scale = params[target].data, params[f"{target}_scale"].data
    if tensor.dtype == FP8_DTYPE:
        raise ModelLoadError(
            f"{where}: FP8 checkpoints that store their experts stacked are not supported; "
            "load the bf16 checkpoint with engine.quantization = 'fp8'"
        )
    if tuple(tensor.shape) != tuple(weight.shape):
        raise ModelLoadError(
            f"{where} has shape {tuple(tensor.shape)}, the config needs {tuple(weight.shape)}"
        )
    quantize_expert_rows(tensor, weight, scale)


def _map_name(name: str) -> tuple[str, str | None, int | None]:
    """Canonical checkpoint name -> (our parameter, fused projection or None, shard index)."""
    if name == "lm_head.weight":
        return "lm_head", None, None
    match = _LAYER.match(name)
    if match:
        index, rest = match.groups()
        module, _, kind = rest.rpartition(".")
        if module in FUSED_PARTS:
            fused, shard = FUSED_PARTS[module]
            return f"layers.{index}.{fused}.{kind}", fused, shard
        return f"layers.{index}.{rest}", None, None
    return name.removeprefix("model."), None, None


# A tensor's name and full shape -> (dim, start, stop) of the part to read; None: all of it;
# an empty part (start == stop): none of it, not even read (another rank's expert).
PartOf = Callable[[str, tuple[int, ...]], tuple[int, int, int] | None]


def parts_of(shard: ShardPlan | None, layout: CheckpointLayout = LLAMA_LAYOUT) -> PartOf:
    """Which part of each checkpoint tensor (by its checkpoint name) `shard` holds. A
    projection the checkpoint stores fused, and a linear attention's stacked q, k and v
    (ShardPlan.is_grouped), are wanted whole: the loader splits them."""

    def part_of(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        if shard is None or layout.is_unserved(name) or layout.fused_parts(name) is not None:
            return None
        canonical = layout.canonical_name(name)
        if shard.is_grouped(canonical):
            return None  # several ranges of rows: read whole, split by the loader
        return shard.split(_map_name(canonical)[0], shape)

    return part_of


def _read_tensors(
    model_dir: Path, part_of: PartOf, *, shapes_only: bool = False
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """Each tensor of the directory's safetensors files (this rank's part of it); with
    `shapes_only`, meta tensors of the headers' shapes and dtypes, no data read."""
    for path in checkpoint_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    view = f.get_slice(name)
                    part = part_of(name, tuple(view.get_shape()))
                    if part is not None and part[1] == part[2]:
                        continue  # another rank's (expert)
                    if shapes_only:
                        yield path, name, _meta_tensor(path, name, view, part)
                    elif part is None:
                        yield path, name, f.get_tensor(name)
                    else:
                        dim, start, stop = part
                        index = (slice(None),) * dim + (slice(start, stop),)
                        yield path, name, view[index]
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{path} is not a valid safetensors file ({exc}); re-convert or re-copy the model"
            ) from exc


def _meta_tensor(
    path: Path, name: str, view: Any, part: tuple[int, int, int] | None
) -> torch.Tensor:
    shape = list(view.get_shape())
    if part is not None:
        shape[part[0]] = part[2] - part[1]
    dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
    if dtype is None:
        raise ModelLoadError(
            f"{path.name}: tensor {name!r} is stored as {view.get_dtype()}, which is not supported"
        )
    return torch.empty(shape, dtype=dtype, device="meta")


# safetensors dtype names -> torch dtypes (https://github.com/huggingface/safetensors, format).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
}  # fmt: skip


def _read_images(
    model_dir: Path,
    weights: Mapping[str, memoryview | bytearray | torch.Tensor],
    part_of: PartOf,
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """The tensors of in-memory safetensors images (host buffers, or uint8 tensors on any
    device), viewed in place (no copy). Images are taken one at a time, in name order."""
    for file_name in sorted(weights):
        image = weights[file_name]
        if not isinstance(image, torch.Tensor):
            image = memoryview(image).cast("B")
        path = Path(model_dir) / file_name
        for name, tensor in _image_tensors(path, image):
            part = part_of(name, tuple(tensor.shape))
            if part is not None and part[1] == part[2]:
                continue  # another rank's (expert)
            if part is not None:
                tensor = tensor.narrow(part[0], part[1], part[2] - part[1])
            yield path, name, tensor


def _image_tensors(
    path: Path, image: memoryview | torch.Tensor
) -> Iterator[tuple[str, torch.Tensor]]:
    """Parse a safetensors image strictly: an 8-byte little-endian header size, a JSON header
    of {name: {dtype, shape, data_offsets}}, then the data, which the tensors must tile exactly
    (as the safetensors library itself requires)."""

    def invalid(why: str) -> ModelLoadError:
        return ModelLoadError(f"{path} is not a valid safetensors image ({why})")

    def read(start: int, end: int) -> bytes:
        if isinstance(image, torch.Tensor):
            return image[start:end].cpu().numpy().tobytes()
        return bytes(image[start:end])

    image_size = image.numel() if isinstance(image, torch.Tensor) else len(image)
    if image_size < 8:
        raise invalid("shorter than its header size")
    (header_size,) = struct.unpack("<Q", read(0, 8))
    if header_size > min(image_size - 8, 100 << 20):
        raise invalid(f"header size {header_size} exceeds the image")
    try:
        header = json.loads(read(8, 8 + header_size))
    except ValueError as exc:
        raise invalid(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise invalid("header is not a JSON object")
    header.pop("__metadata__", None)
    data_start, spans = 8 + header_size, []
    for name, info in header.items():
        try:
            dtype = _SAFETENSORS_DTYPES[info["dtype"]]
            shape = [int(n) for n in info["shape"]]
            begin, end = (int(n) for n in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise invalid(f"tensor {name!r} has an unusable dtype, shape or data_offsets") from None
        numel = 1
        for n in shape:
            numel *= n
        if min(shape, default=0) < 0 or end - begin != numel * dtype.itemsize or begin < 0:
            raise invalid(f"tensor {name!r} spans {begin}..{end}, not {shape} of {dtype}")
        spans.append((begin, end, name, dtype, shape, numel))
    spans.sort()
    position = 0
    for begin, end, name, *_ in spans:
        if begin != position:
            raise invalid(f"tensor {name!r} does not follow the previous one in the data")
        position = end
    if data_start + position != image_size:
        raise invalid(f"the tensors cover {position} data bytes of {image_size - data_start}")
    for begin, end, name, dtype, shape, numel in spans:
        if numel == 0:
            yield name, torch.empty(shape, dtype=dtype)
        elif isinstance(image, torch.Tensor):
            data = image[data_start + begin : data_start + end]
            # A dtype view needs an aligned start; safetensors aligns its data, others may not.
            if (data_start + begin) % dtype.itemsize:
                data = data.clone()
            yield name, data.view(dtype).view(shape)
        else:
            flat = torch.frombuffer(image, dtype=dtype, count=numel, offset=data_start + begin)
            yield name, flat.view(shape)


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files: those `model.safetensors.index.json` names when it exists (each must
    lie inside the model directory, symlinks resolved), else `model.safetensors`."""
    index = model_dir / "model.safetensors.index.json"
    if not index.exists():
        single = model_dir / "model.safetensors"
        if not single.exists():
            raise ModelLoadError(f"{model_dir} has no model.safetensors (nor an index of shards)")
        return [single]
    try:
        if index.stat().st_size > _MAX_INDEX_BYTES:
            raise ModelLoadError(
                f"{index} is larger than {_MAX_INDEX_BYTES >> 20} MiB; no real shard index is"
            )
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{index} is not a valid safetensors index: {exc}") from exc
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to file names")
    root = model_dir.resolve()
    files = []
    for name in sorted(set(weight_map.values())):
        path = (model_dir / name).resolve()
        if not path.is_relative_to(root) or path == root:
            raise ModelLoadError(
                f"{index} names {name!r}, which is outside the model directory; refusing it"
            )
        if not path.is_file():
            raise ModelLoadError(f"{index} names {name!r}, which is not in {model_dir}")
        files.append(model_dir / name)
    return files
