"""gpt-oss's fused expert tensors, as transformers saves them, turned into our stacked layout.

A gpt-oss checkpoint stores each layer's experts as four tensors (transformers' GptOssExperts):
`mlp.experts.gate_up_proj` [E, H, 2I] (x @ w: transposed, the gate and up columns interleaved,
gate at even columns), `gate_up_proj_bias` [E, 2I] (interleaved the same way), `down_proj`
[E, I, H] and `down_proj_bias` [E, H]. OpenAI's release stores both projections in MXFP4
instead (`*_blocks` [E, rows, cols / 32, 16] uint8 and `*_scales` [E, rows, cols / 32] uint8,
rows already ours: [E, 2I, H] interleaved and [E, H, I]), dequantized here to bf16.

`convert_fused_experts` rewrites that stream of checkpoint tensors into the canonical stacked
ones the loader knows (models.sparse_moe.Experts: [E, 2I, H] with [gate; up] rows, [E, H, I]);
every other tensor passes through unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import torch

from appliance.engine.errors import ModelLoadError

# The OCP Microscaling spec's FP4 (E2M1) values by code: sign bit 3, then 3 magnitude bits.
_FP4_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_VALUES = _FP4_MAGNITUDES + tuple(-v for v in _FP4_MAGNITUDES)
MXFP4_BLOCK = 32  # values per shared scale (two per byte: 16 bytes a block)
_SCALE_BIAS = 127  # a scale byte is an E8M0 exponent: 2 ** (byte - 127)

_FUSED = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$"
)


def mxfp4_num_params(name: str, numel: int) -> int:
    """The parameters that stored tensor `name` of `numel` elements holds once dequantized, in
    an MXFP4 checkpoint: two per byte of an expert's `*_blocks` (each byte two FP4 codes), none
    for its `*_scales` (shared exponents, not parameters), `numel` for any other tensor."""
    match = _FUSED.match(name)
    kind = match.group(3) if match else None
    if kind == "_blocks":
        return 2 * numel
    return 0 if kind == "_scales" else numel


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """MXFP4 blocks and scales -> the values, [..., G * 32] in `dtype`.

    blocks: [..., G, 16] uint8, each byte two FP4 codes (the low nibble first);
    scales: [..., G] uint8, one E8M0 exponent per block of 32. Exact in bf16 (an FP4 value has
    two significant bits; the scale only moves the exponent).
    """
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ModelLoadError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}"
        )
    if blocks.shape[-1] != MXFP4_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ModelLoadError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}: "
            f"blocks must be [..., G, {MXFP4_BLOCK // 2}] for scales [..., G]"
        )
    lut = torch.tensor(_FP4_VALUES, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1)  # [..., G, 16, 2]
    values = lut[codes.int()].flatten(-2)  # [..., G, 32]
    exponents = scales.int() - _SCALE_BIAS
    values = torch.ldexp(values, exponents[..., None])
    return values.flatten(-2)


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """gpt-oss's interleaved gate/up (dim 1: gate at even, up at odd) -> [gate; up]."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


def _stacked(projection: str, kind: str, tensor: torch.Tensor) -> torch.Tensor:
    """One of gpt-oss's dense expert tensors -> ours (see the module docstring)."""
    if tensor.dim() != (2 if kind == "_bias" else 3):
        raise ModelLoadError(f"has shape {tuple(tensor.shape)}; gpt-oss's experts are stacked")
    if kind != "_bias":
        tensor = tensor.transpose(1, 2)
    return _deinterleave(tensor) if projection == "gate_up_proj" else tensor


def convert_fused_experts(
    tensors: Iterator[tuple[Path, str, torch.Tensor]],
) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """The checkpoint's tensors with gpt-oss's experts in our layout: a dense projection or
    bias as soon as it comes, an MXFP4 one once both its blocks and scales have (one of the
    pair is held meanwhile). Raises ModelLoadError naming a tensor whose pair never came."""
    waiting: dict[str, tuple[Path, torch.Tensor]] = {}  # "<prefix><projection>_blocks" -> it
    for path, name, tensor in tensors:
        match = _FUSED.match(name)
        if match is None:
            yield path, name, tensor
            continue
        prefix, projection, kind = match.group(1), match.group(2), match.group(3) or ""
        canonical = prefix + projection + ("_bias" if kind == "_bias" else "")
        if kind in ("", "_bias"):
            try:
                yield path, canonical, _stacked(projection, kind, tensor)
            except ModelLoadError as exc:
                raise ModelLoadError(f"{path.name}: tensor {name!r} {exc}") from None
            continue
        other = prefix + projection + ("_scales" if kind == "_blocks" else "_blocks")
        if other not in waiting:
            waiting[name] = (path, tensor)
            continue
        _, pair = waiting.pop(other)
        blocks, scales = (tensor, pair) if kind == "_blocks" else (pair, tensor)
        try:
            weight = _dequantized(blocks, scales)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path.name}: tensor {name!r}: {exc}") from None
        yield path, canonical, _deinterleave(weight) if projection == "gate_up_proj" else weight
    if waiting:
        name = sorted(waiting)[0]
        raise ModelLoadError(
            f"{waiting[name][0].name}: MXFP4 tensor {name!r} has no matching "
            f"{'scales' if name.endswith('_blocks') else 'blocks'}"
        )


def _dequantized(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    if blocks.is_meta or scales.is_meta:  # a dry run: only the shape is checked
        if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape:
            raise ModelLoadError(
                f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}"
            )
        return torch.empty(*scales.shape[:-1], scales.shape[-1] * MXFP4_BLOCK, device="meta")
    return dequantize_mxfp4(blocks, scales)
