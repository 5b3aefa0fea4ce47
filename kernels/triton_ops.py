"""The kernel contract (`kernels.ops.KernelOps`) implemented with Inferno's Triton kernels.

Attention picks its kernel from the batch: a batch of single-token decodes (the steady state,
and what CUDA graphs capture) runs the split-KV decode kernel; anything with a longer query
(prefill, chunked prefill, prefix-cache extends) runs the varlen prefill kernel. A mixed batch
runs its leading decode rows through the decode kernel and the rest through the prefill kernel:
in the prefill kernel a decode row fills only Hq / Hkv rows of a 128-row tile, so its context
would cost the tensor cores 128 / (Hq / Hkv) times the work for the same bytes read. The host
counts those rows, or, in a prompt graph's metadata (`AttentionMetadata.device_decodes`), the
device: one capture then serves every mix of decode rows and prompts.
Projections of decode-sized batches (at most `kernels.linear.MAX_ROWS` rows) stream their
weights through Inferno's skinny-matmul kernel; larger ones are cuBLAS matmuls. FP8 weights
(`kernels.ops.Fp8Weight`) take `kernels.fp8_linear`'s W8A8 path, which routes the same way.
A mixture of experts is routed by one kernel (`kernels.moe_routing`: each token's top k
experts and their weights from the router's logits), and its experts run as `kernels.moe`'s two
grouped GEMMs.
Linear-attention layers (Gated DeltaNet) run `kernels.causal_conv1d` and
`kernels.gated_delta_rule` on their per-sequence state slots: the recurrent step for a decode
batch, the chunked form otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import fp8_linear, rmsnorm
from kernels import linear as skinny
from kernels.activation import gelu_tanh_and_mul, silu_and_mul
from kernels.causal_conv1d import causal_conv1d
from kernels.decode_attention import paged_decode_attention
from kernels.errors import KernelInputError
from kernels.gated_delta_rule import gated_delta_rule
from kernels.kv_cache_write import write_kv_cache
from kernels.moe import fused_moe
from kernels.moe_routing import route_experts
from kernels.ops import AttentionMetadata, Fp8Rows, Fp8Weight
from kernels.prefill_attention import paged_prefill_attention
from kernels.rmsnorm import add_rms_norm_fp8, rms_norm
from kernels.rotary import rotary_embedding
from kernels.rotary_kv_write import rotary_write_kv

__all__ = [
    "add_rms_norm",
    "causal_conv1d",
    "fused_moe",
    "gated_delta_rule",
    "gelu_tanh_mul_linear",
    "linear",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "rotary_write_kv",
    "route_experts",
    "silu_mul_linear",
    "write_kv_cache",
]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize_for: Fp8Weight | None = None,
) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
    """See `kernels.reference.add_rms_norm`; the residual is updated in place
    (`kernels.rmsnorm.add_rms_norm`). With `quantize_for`, the rows come quantized from the
    norm's own launch wherever the FP8 projection would quantize them (`fp8_linear.quantizes`:
    not one row, which it multiplies as it is)."""
    if quantize_for is None or not fp8_linear.quantizes(x.shape[0]):
        return rmsnorm.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_fp8(x, residual, weight, eps, quantize_for.input_scale)


def linear(
    x: torch.Tensor | Fp8Rows, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """x @ weight.T + bias; see `kernels.reference.linear`."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear.linear(x, weight, bias)
    if isinstance(x, Fp8Rows):
        raise KernelInputError("quantized rows are for an FP8 projection, not a dense one")
    if x.shape[0] <= skinny.MAX_ROWS:
        return skinny.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """Down projection of SiLU(gate) * up; see `kernels.reference.silu_mul_linear`."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear.silu_mul_linear(x, weight)
    if x.shape[0] == 1:
        return skinny.silu_mul_linear(x, weight)
    return F.linear(silu_and_mul(x), weight)


def gelu_tanh_mul_linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight) -> torch.Tensor:
    """Down projection of GELU-tanh(gate) * up (Gemma); see
    `kernels.reference.gelu_tanh_mul_linear`."""
    if isinstance(weight, Fp8Weight):
        return fp8_linear.gelu_tanh_mul_linear(x, weight)
    if x.shape[0] == 1:
        return skinny.gelu_tanh_mul_linear(x, weight)
    return F.linear(gelu_tanh_and_mul(x), weight)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, D]; see `kernels.reference.paged_attention` for the semantics."""
    per_layer = {"k_scale": k_scale, "v_scale": v_scale, "sinks": sinks}  # the layer's tensors
    if meta.decode_only:
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens_t,
            scale,
            num_splits=meta.num_splits,
            sliding_window=sliding_window,
            **per_layer,
        )
    out = torch.empty_like(q)
    # The leading decode rows (q's first rows, one each) through the decode kernel, the other
    # sequences' rows through the prefill kernel, which locates them through their
    # query_start_loc entries in the whole q. A prompt graph counts the decode rows on the
    # device: the decode kernel then spans every sequence the batch can hold and computes those
    # it counts, and the prefill kernel skips them.
    count = meta.device_decodes
    rows = meta.num_leading_decodes if count is None else meta.block_tables.shape[0]
    if rows:
        paged_decode_attention(
            q[:rows],
            k_cache,
            v_cache,
            meta.block_tables[:rows],
            meta.seq_lens_t[:rows],
            scale,
            num_splits=1,  # a program per (row, KV head), as the prefill kernel gave them
            sliding_window=sliding_window,
            out=out[:rows],
            num_rows=count,
            **per_layer,
        )
    skipped = meta.num_leading_decodes if count is None else 0
    return paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables[skipped:],
        meta.seq_lens_t[skipped:],
        meta.query_start_loc[skipped:],
        max_query_len=meta.max_query_len,
        scale=scale,
        sliding_window=sliding_window,
        out=out,
        first_seq=count,
        **per_layer,
    )
