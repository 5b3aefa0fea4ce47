"""A decoder layer's projections (q/k/v, o, gate/up, down) in the model's dtype or in FP8.

A projection is an `nn.Linear`, or an `Fp8Linear` in its place: the same [out, in] weight in
FP8 (e4m3) with a float32 scale per output channel, the W8A8 scheme of `kernels.ops.Fp8Weight`.
The model hands `projection_weight(module)` to its kernel ops, which take either. Embeddings,
norms and the LM head are never quantized (as vLLM leaves them), so only these modules change.

An FP8 checkpoint fills empty `Fp8Linear`s (`use_fp8_projections` before the load); a bfloat16
or float32 checkpoint is loaded as it is and then quantized in place (`quantize_projections`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kernels.fp8 import FP8_DTYPE, quantize_rows
from kernels.ops import Fp8Weight

# Our projection modules inside a decoder layer (appliance.engine.models.layers).
PROJECTIONS = (
    "self_attn.qkv_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
    "mlp.shared_expert.gate_up_proj",
    "mlp.shared_expert.down_proj",
)


class Fp8Linear(nn.Module):
    """nn.Linear's place for an FP8 projection: weight [out, in] float8_e4m3fn, weight_scale
    [out] float32 (per output channel), input_scale [1] float32 when the checkpoint quantizes
    activations with a static scale (else None: per token, at run time), bias [out] or None
    in the model's dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        static_input_scale: bool = False,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features

        def parameter(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)

        self.weight = parameter(out_features, in_features, dtype=FP8_DTYPE)
        self.weight_scale = parameter(out_features, dtype=torch.float32)
        self.input_scale = parameter(1, dtype=torch.float32) if static_input_scale else None
        self.bias = parameter(out_features, dtype=dtype) if bias else None

    @classmethod
    def like(cls, linear: nn.Linear, *, static_input_scale: bool = False) -> Fp8Linear:
        """An empty Fp8Linear of `linear`'s shape, on its device, its bias in its dtype."""
        with torch.device(linear.weight.device):
            return cls(
                linear.in_features,
                linear.out_features,
                bias=linear.bias is not None,
                dtype=linear.weight.dtype,
                static_input_scale=static_input_scale,
            )

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        """`linear`'s weight quantized per output channel (kernels.fp8.quantize_rows); the bias
        is kept as it is."""
        fp8 = cls.like(linear)
        with torch.no_grad():
            q, scale = quantize_rows(linear.weight)
            fp8.weight.copy_(q)
            fp8.weight_scale.copy_(scale)
            if linear.bias is not None:
                assert fp8.bias is not None
                fp8.bias.copy_(linear.bias)
        return fp8

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8"


def projection_weight(module: nn.Module) -> torch.Tensor | Fp8Weight:
    """What the kernel ops take as `module`'s weight (kernels.ops.KernelOps.linear)."""
    if isinstance(module, Fp8Linear):
        return Fp8Weight(module.weight, module.weight_scale, module.input_scale)
    assert isinstance(module, nn.Linear)
    return module.weight


def fp8_weight(module: nn.Module) -> Fp8Weight | None:
    """`module`'s weight as the kernel ops take it if it is an FP8 projection, else None."""
    weight = projection_weight(module)
    return weight if isinstance(weight, Fp8Weight) else None


def use_fp8_projections(
    model: nn.Module, keep: Callable[[str], bool], *, static_input_scale: bool = False
) -> None:
    """Before a load from an FP8 checkpoint: replace each projection (our name, e.g.
    `layers.0.self_attn.qkv_proj`) by an empty Fp8Linear of its shape, unless `keep(name)`
    (a projection the checkpoint left unquantized)."""
    for name in projection_names(model):
        if not keep(name):
            _replace(
                model,
                name,
                lambda linear: Fp8Linear.like(linear, static_input_scale=static_input_scale),
            )


def quantize_projections(model: nn.Module) -> None:
    """Quantize every projection of a loaded model to FP8 in place, one at a time: only
    names are held, so each one's weight in the model's dtype is freed as soon as it is
    replaced and the model's memory at most briefly holds one projection in both forms."""
    for name in projection_names(model):
        _replace(model, name, Fp8Linear.quantize)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the freed projections, so the KV pool is sized without them


def projection_names(model: nn.Module) -> list[str]:
    """Our names of the model's projections still in its own dtype (nn.Linear)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and name.split(".", 2)[-1] in PROJECTIONS
    ]


def _replace(model: nn.Module, name: str, make: Callable[[nn.Linear], nn.Module]) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    setattr(parent, attr, make(getattr(parent, attr)))
