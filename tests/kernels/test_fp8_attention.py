"""The FP8 attention arithmetic (`kernels.fp8_attention`): its e4m3 rounding under the
interpreter, and that on an H100 the prefill kernel's products really run on e4m3 operands.

The kernels' outputs against the references are tested in test_prefill_attention.py and
test_decode_attention.py (bounds in fp8_attention_bounds.py).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

from kernels.fp8 import FP8_MAX
from kernels.fp8_attention import quantize_q_rows, to_e4m3
from kernels.launch_checks import triton_interprets

interpreted_only = pytest.mark.skipif(
    not triton_interprets(), reason="the emulated rounding runs under TRITON_INTERPRET=1 only"
)


@triton.jit
def _round_trip_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, EMULATE_ROUNDING: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, to_e4m3(x, EMULATE_ROUNDING).to(tl.float32), mask=offs < n)


@triton.jit
def _quantize_q_kernel(q_ptr, q8_ptr, scale_ptr, M: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, M)[:, None] * D + tl.arange(0, D)[None, :]
    q8, scale = quantize_q_rows(tl.load(q_ptr + offs), True)
    tl.store(q8_ptr + offs, q8)
    tl.store(scale_ptr + tl.arange(0, M), scale)


def _awkward_values() -> torch.Tensor:
    """Values around every e4m3 binade, ties between neighbours (which round to even) and
    subnormals, both signs, within +-448."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite() & (grid.abs() <= FP8_MAX)].unique()
    midpoints = (grid[1:] + grid[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    random = torch.cat([torch.randn(4096, generator=gen) * 40, torch.rand(4096, generator=gen)])
    nudged = torch.cat([midpoints * (1 + 2**-20), midpoints * (1 - 2**-20)])
    return torch.cat([grid, midpoints, nudged, random]).clamp(-FP8_MAX, FP8_MAX)


@interpreted_only
def test_emulated_rounding_to_e4m3_matches_torch_on_every_binade_and_tie() -> None:
    x = _awkward_values()
    out = torch.empty_like(x)
    _round_trip_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), 1024, True)
    torch.testing.assert_close(out, x.to(torch.float8_e4m3fn).float(), atol=0, rtol=0)


@interpreted_only
def test_the_interpreters_own_rounding_is_still_wrong() -> None:
    """Why EMULATE_ROUNDING exists: when this fails, Triton fixed its interpreter and the
    emulation can go."""
    x = torch.tensor([31.04, 126.3, 7.97, 100.0])
    out = torch.empty_like(x)
    _round_trip_kernel[(1,)](x, out, x.numel(), 4, False)
    assert not torch.equal(out, x.to(torch.float8_e4m3fn).float())


@interpreted_only
def test_q_rows_are_quantized_as_the_reference_quantizes_rows() -> None:
    from kernels.fp8 import quantize_rows

    q = torch.randn(16, 32) * torch.logspace(-3, 2, 16)[:, None]
    q[3] = 0.0  # a padding row: a tiny scale, zeros
    q8 = torch.empty(16, 32, dtype=torch.float8_e4m3fn)
    scale = torch.empty(16)
    _quantize_q_kernel[(1,)](q, q8, scale, 16, 32)
    expected_q8, expected_scale = quantize_rows(q)
    torch.testing.assert_close(scale, expected_scale, atol=0, rtol=0)
    torch.testing.assert_close(q8.float(), expected_q8.float(), atol=0, rtol=0)


# Compiles both attention kernels for an H100 (sm_90) with an FP8 cache, at the 8B model's
# shapes and at the tiny test model's (head_dim 16, float32: the FP8 dot needs K >= 32 and
# widens there); Triton's compiler and ptxas need no GPU. Run in a fresh process: under
# TRITON_INTERPRET=1 the kernels are not compilable.
_COMPILE_FOR_HOPPER = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernels import decode_attention, prefill_attention

def compile_for_hopper(fn, pointers, scalars, strides, constexprs, config):
    signature = {**dict.fromkeys(scalars, "i32"), "qk_scale": "fp32"}
    signature.update({name: kind for name, kind in pointers.items()})
    signature.update({"stride_" + name: "i32" for name in strides})
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

def pointers(q, out, names):
    kinds = {"q_ptr": q, "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": out,
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "lse_ptr": "*fp32",
             "sinks_ptr": "*fp32"}
    return {name: kinds.get(name, "*i32") for name in names}

def prefill(q, head_dim, group):
    config = prefill_attention.pick_config(getattr(__import__("torch"), q), head_dim, False, True)
    q = {"bfloat16": "*bf16", "float32": "*fp32"}[q]
    return compile_for_hopper(
        prefill_attention._paged_prefill_attention_kernel,
        pointers(q, q, ("q_ptr", "k_cache_ptr", "v_cache_ptr", "v_words_ptr", "out_ptr",
                        "block_tables_ptr", "seq_lens_ptr", "query_start_loc_ptr", "k_scale_ptr",
                        "v_scale_ptr", "sinks_ptr", "first_seq_ptr")),
        ("max_blocks", "window"),
        ("qt", "qh", "kb", "kt", "kh", "vb", "vt", "vh", "ot", "oh", "bt"),
        {"GROUP": group, "PACK": group, "BLOCK_SIZE": 16, "HEAD_DIM": head_dim,
         "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "DOT_FP32": False,
         "FP8_KV": True, "EMULATE_ROUNDING": False, "V_PLANES": head_dim >= 64,
         "INTERPRETED": False, "HAS_SINKS": False, "SKIP_LEADING": True},
        config)

def decode(q, head_dim, group):
    config = decode_attention.pick_config(head_dim, fp8_kv=True)
    return compile_for_hopper(
        decode_attention._decode_split_kernel,
        pointers(q, "*fp32", ("q_ptr", "k_cache_ptr", "v_cache_ptr", "v_words_ptr",
                              "block_tables_ptr", "seq_lens_ptr", "out_ptr", "lse_ptr",
                              "k_scale_ptr", "v_scale_ptr", "sinks_ptr", "num_rows_ptr")),
        ("max_blocks", "window"),
        ("qb", "qh", "kb", "ks", "kh", "vb", "vs", "vh", "btb", "ob", "oh", "os", "lb", "lh"),
        {"GROUP_SIZE": group, "G_PAD": 16, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
         "BLOCK_N": config.block_n, "NUM_SPLITS": 4, "DIRECT": False, "DOT_PRECISION": "tf32",
         "FP8_KV": True, "EMULATE_ROUNDING": False, "V_PLANES": head_dim >= 64,
         "INTERPRETED": False, "PDL": True, "HAS_SINKS": False, "ROW_COUNT": False},
        config)

ptx = prefill("bfloat16", 128, 4)
products = re.findall(r"wgmma\\.mma_async\\S+\\.f32\\.(\\w+)\\.\\w+\\s", ptx)
print("prefill products:", sorted(set(products)))
prefill("float32", 16, 2)
ptx = decode("*bf16", 128, 4)
bytewise = re.findall(r"ld\\.shared\\.[bsu]8", ptx)
print("decode: byte loads from shared memory", len(bytewise))
decode("*fp32", 16, 2)
print("all compiled")
"""


@pytest.mark.slow
def test_prefill_products_run_on_e4m3_tensor_cores_for_hopper() -> None:
    """What the interpreter cannot show: with an FP8 cache the prefill kernel's score product
    compiles to e4m3 wgmma on sm_90 (K's tile enters as loaded: widening every K and V tile to
    bf16 made steps carrying prefills 18% slower, issue 17) and its P V to float16 wgmma over
    V's word planes; the decode kernel reads V's tile out of shared memory without byte loads
    (what its word planes are for: Triton 3.6 transposed the e4m3 tile with 128
    `ld.shared.b8` per thread, and the kernel read the cache at ~62% of copy bandwidth); and
    both kernels compile at a head_dim of 16, below the FP8 dot's smallest K."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_HOPPER],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == [
        "prefill products: ['e4m3', 'f16']",
        "decode: byte loads from shared memory 0",
        "all compiled",
    ]
