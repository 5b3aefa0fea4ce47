"""Load a model directory's safetensors into a model, one tensor at a time.

The model is built on the meta device and materialised empty on the target device; each
checkpoint tensor is then read (memory-mapped), converted and copied into its slice of the fused
parameter, and dropped. Peak host memory is the model plus one tensor, never two models.

A sealed model's weights never exist as files: they are decrypted into memory
(attestation.sealed) and handed over as `weights`, safetensors images by file name, whose
tensors are read in place (`torch.frombuffer`, no copy) after their header is validated here.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from appliance.engine.errors import ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.llama import LlamaForCausalLM
from appliance.engine.parallel.sharding import ShardPlan, shard_model
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


def load_model(
    model_dir: Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    ops: KernelOps | None = None,
    weights: Mapping[str, memoryview | bytearray | torch.Tensor] | None = None,
    shard: ShardPlan | None = None,
) -> LlamaForCausalLM:
    """Build the architecture in `model_dir/config.json` and fill it from its safetensors, or,
    when `weights` is given, from those in-memory safetensors images (by file name) instead of
    the directory's files. With `shard`, build and fill one tensor-parallel rank's part
    (appliance.engine.parallel.sharding): from files, only that part of each tensor is read.

    Raises ModelLoadError naming the file for a missing directory or config, an unsupported
    architecture, a corrupt or truncated safetensors file or image, or missing/unexpected/
    misshapen tensors.
    """
    config = ModelConfig.from_model_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config) if ops is None else LlamaForCausalLM(config, ops)
    if shard is not None:
        shard_model(model, shard)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_kv_scales()
    params = dict(model.named_parameters())
    shard_sizes = _shard_sizes(config, 1 if shard is None else shard.size)
    missing = {(name, part) for name in params for part in _shards_of(name, shard_sizes)}

    part_of = parts_of(shard)
    tensors = (
        _read_tensors(Path(model_dir), part_of)
        if weights is None
        else _read_images(model_dir, weights, part_of)
    )
    for path, name, tensor in tensors:
        if _IGNORED.search(name) or (name == "lm_head.weight" and config.tie_word_embeddings):
            continue
        if _load_kv_scale(model, path, name, tensor):
            continue
        target, fused, piece = _map_name(name)
        if target not in params:
            raise ModelLoadError(
                f"{path.name}: unexpected tensor {name!r} for {config.architecture}"
            )
        dest = params[target].data
        if fused is not None:
            sizes = shard_sizes[fused]
            start = sum(sizes[:piece])
            dest = dest[start : start + sizes[piece]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the config needs {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        missing.discard((target, piece))
    if missing:
        names = sorted({name for name, _ in missing})
        shown = ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")
        raise ModelLoadError(f"{model_dir}: the checkpoint lacks tensors for {shown}")
    if shard is not None:
        shard.finish_load(model)
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
) -> LlamaForCausalLM:
    """The architecture of `model_dir/config.json` (one rank's part with `shard`) with
    normal(0, 0.02) weights drawn on `device` and norm weights 1: benchmarks of shapes whose
    checkpoint is not at hand. Each rank draws its own (the model computes nothing meaningful)."""
    config = ModelConfig.from_model_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops)
    if shard is not None:
        shard_model(model, shard)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_kv_scales()
    generator = torch.Generator(device).manual_seed(seed + (0 if shard is None else shard.rank))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    model.init_rope_tables(config.max_model_len)
    return model.eval()


def _load_kv_scale(model: LlamaForCausalLM, path: Path, name: str, tensor: torch.Tensor) -> bool:
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
    for which in _KV_SCALES[match.group(2)]:
        getattr(attn, which).copy_(value)
    return True


def _shard_sizes(config: ModelConfig, num_ranks: int = 1) -> dict[str, list[int]]:
    """Rows of each fused projection, in checkpoint order ([q; k; v] and [gate; up]), on each
    of `num_ranks` tensor-parallel ranks."""
    kv = config.num_kv_heads * config.head_dim // num_ranks
    mlp = config.intermediate_size // num_ranks
    return {
        "self_attn.qkv_proj": [config.num_heads * config.head_dim // num_ranks, kv, kv],
        "mlp.gate_up_proj": [mlp, mlp],
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


# A tensor's name and full shape -> (dim, start, stop) of the part to read; None: all of it.
PartOf = Callable[[str, tuple[int, ...]], tuple[int, int, int] | None]


def parts_of(shard: ShardPlan | None) -> PartOf:
    """Which part of each checkpoint tensor (by its checkpoint name) `shard` holds."""

    def part_of(name: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        return None if shard is None else shard.split(_map_name(name)[0], shape)

    return part_of


def _read_tensors(model_dir: Path, part_of: PartOf) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in _safetensors_files(model_dir):
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                    view = f.get_slice(name)
                    part = part_of(name, tuple(view.get_shape()))
                    if part is None:
                        yield path, name, f.get_tensor(name)
                    else:
                        dim, start, stop = part
                        index = (slice(None),) * dim + (slice(start, stop),)
                        yield path, name, view[index]
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(
                f"{path} is not a valid safetensors file ({exc}); re-convert or re-copy the model"
            ) from exc


# safetensors dtype names -> torch dtypes (https://github.com/huggingface/safetensors, format).
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
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
