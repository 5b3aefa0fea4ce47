"""Linear-attention kernels (issue 23) against the ceilings of the same run (GPU machine).

Qwen3.6-35B-A3B's Gated DeltaNet shapes (16 key heads x 128, 32 value heads x 128, conv kernel
4 over the 8192 channels of q, k and v), bf16 inputs, float32 delta-rule state. Each kernel is
first checked on fresh random inputs against transformers' own torch functions (the Qwen3.5
modeling file's `torch_recurrent_gated_delta_rule`, `torch_chunk_gated_delta_rule`,
`causal_conv1d_fn`), then timed:
- the decode step (`kernels.gated_delta_rule`'s recurrent kernel, and the conv update) at batch
  1, 64 and 256, replayed from a CUDA graph over enough copies of the state that none is served
  from L2 (as across a model's layers): state bytes read + written per second against the
  measured copy bandwidth, the bound of a step that must read and rewrite every state byte;
- chunked prefill of 8 x 2048 tokens: tokens/s beside transformers' `torch_chunk_gated_delta_rule`
  (the peer, eager, same inputs), and a few (chunk, Dv tile) variants of the chunked kernel.

    python bench/linear_attention.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch
import triton
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from bench.kernel_micro import graph_time, print_header
from kernels.causal_conv1d import causal_conv1d
from kernels.gated_delta_rule import gated_delta_rule
from kernels.ops import RecurrentStateMetadata

HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
CONV_DIM = 2 * HK * DK + HV * DV
DTYPE = torch.bfloat16
# Copies of the state replayed back to back: together above the H100's 50 MB of L2 (at most
# MAX_COPIES launches in one graph).
MIN_STATE_BYTES_TIMED = 256 * 2**20
MAX_COPIES = 512


def metadata(query_lens: list[int], has_initial: bool) -> RecurrentStateMetadata:
    starts = torch.tensor([0, *query_lens], device="cuda").cumsum(0).to(torch.int32)
    num_seqs = len(query_lens)
    return RecurrentStateMetadata(
        state_slots=torch.randperm(num_seqs, device="cuda").to(torch.int32),
        has_initial_state=torch.full((num_seqs,), has_initial, device="cuda"),
        query_start_loc=starts,
        query_lens=query_lens,
        decode_only=all(n == 1 for n in query_lens),
    )


def delta_rule_inputs(num_tokens: int) -> dict[str, torch.Tensor]:
    return {
        "q": torch.randn(num_tokens, HK, DK, dtype=DTYPE, device="cuda"),
        "k": torch.randn(num_tokens, HK, DK, dtype=DTYPE, device="cuda"),
        "v": torch.randn(num_tokens, HV, DV, dtype=DTYPE, device="cuda"),
        "g": -torch.nn.functional.softplus(torch.randn(num_tokens, HV, device="cuda")),
        "beta": torch.rand(num_tokens, HV, device="cuda"),
    }


def check(name: str, ours: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Print whether every element is within tol * |reference| + tol * max |reference| (the
    outputs are small: a normalised q over Dk ** 0.5). Unlike `kernel_micro.check` a mismatch
    does not stop the run: the timings still come, marked."""
    if ours.shape != ref.shape:
        print(f"check {name}: shape {tuple(ours.shape)} against {tuple(ref.shape)} MISMATCH")
        return False
    ref = ref.float()
    err = (ours.float() - ref).abs()
    scale = ref.abs().max().item()
    agrees = (err - tol * ref.abs()).max().item() <= tol * scale
    status = "ok" if agrees else "MISMATCH"
    print(f"check {name}: max abs error {err.max().item():.3g} of {scale:.3g} {status}", flush=True)
    return agrees


def batched(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[B * L, ...] -> [B, L, ...], transformers' layout for equal-length sequences; q and k
    with each value head's own key head, as GQA reads it (older transformers take only as many
    key heads as value heads)."""
    if x.dim() == 3 and x.shape[1] != HV:
        x = x.repeat_interleave(HV // x.shape[1], dim=1)
    return x.reshape(batch, -1, *x.shape[1:])


def decode_step(copy_bw: float, batch: int) -> Iterator[str]:
    inputs = delta_rule_inputs(batch)
    meta = metadata([1] * batch, has_initial=True)
    state = torch.randn(batch, HV, DK, DV, device="cuda") * 0.1
    slots = meta.state_slots.long()
    expected, expected_state = torch_recurrent_gated_delta_rule(
        *(batched(inputs[n], batch) for n in ("q", "k", "v", "g", "beta")),
        initial_state=state[slots],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    out = gated_delta_rule(**inputs, state=state, meta=meta)
    agrees = check(f"delta rule decode, batch {batch}", out, expected.flatten(0, 1), 1e-2)
    agrees &= check(f"delta rule decode state, batch {batch}", state[slots], expected_state, 1e-4)

    state_bytes = 2 * state.numel() * 4  # read and rewritten
    copies = min(MAX_COPIES, max(4, -(-MIN_STATE_BYTES_TIMED // state_bytes)))
    ms = graph_time(
        lambda s: lambda: gated_delta_rule(**inputs, state=s, meta=meta),
        [state.clone() for _ in range(copies)],
    )
    name = f"delta rule decode step, batch {batch}" + ("" if agrees else " (MISMATCH)")
    yield _bandwidth_row(name, ms, state_bytes, copy_bw)

    x = torch.randn(batch, CONV_DIM, dtype=DTYPE, device="cuda")
    weight = torch.randn(CONV_DIM, CONV_K, dtype=DTYPE, device="cuda")
    conv_state = torch.randn(batch, CONV_DIM, CONV_K - 1, dtype=DTYPE, device="cuda")
    expected_conv = causal_conv1d_update(
        x[:, :, None], conv_state[slots], weight, activation="silu"
    )[:, :, 0]
    out_conv = causal_conv1d(x, weight, None, conv_state.clone(), meta)
    conv_name = f"causal conv decode step, batch {batch}"
    if not check(conv_name, out_conv, expected_conv, 1e-2):
        conv_name += " (MISMATCH)"
    conv_bytes = 2 * conv_state.numel() * 2 + 2 * x.numel() * 2  # state r+w, x in, out
    copies = min(MAX_COPIES, max(4, -(-MIN_STATE_BYTES_TIMED // conv_bytes)))
    ms = graph_time(
        lambda s: lambda: causal_conv1d(x, weight, None, s, meta),
        [conv_state.clone() for _ in range(copies)],
    )
    yield _bandwidth_row(conv_name, ms, conv_bytes, copy_bw)


def _bandwidth_row(name: str, ms: float, num_bytes: int, copy_bw: float) -> str:
    rate = num_bytes / (ms * 1e-3)
    return (
        f"| {name} | {ms * 1e3:.1f} µs | {num_bytes / 2**20:.1f} MiB | "
        f"{rate / 1e12:.2f} TB/s = {rate / copy_bw:.0%} of copy |"
    )


def prefill(batch: int = 8, length: int = 2048) -> Iterator[str]:
    num_tokens = batch * length
    inputs = delta_rule_inputs(num_tokens)
    meta = metadata([length] * batch, has_initial=True)
    initial = torch.randn(batch, HV, DK, DV, device="cuda") * 0.1
    slots = meta.state_slots.long()
    as_batch = [batched(inputs[n], batch) for n in ("q", "k", "v", "g", "beta")]

    def peer() -> tuple[torch.Tensor, torch.Tensor]:
        return torch_chunk_gated_delta_rule(
            *as_batch,
            initial_state=initial[slots],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    expected, expected_state = peer()
    # (chunk, Dv tile, stages): the defaults first, then their neighbours.
    variants = ((64, 64, 1), (64, 32, 1), (64, 32, 2), (32, 64, 1), (32, 64, 2), (16, 64, 2))
    for chunk, block_v, stages in variants:
        name = f"chunk {chunk}, Dv tile {block_v}, {stages} stage(s)"

        def run(s: torch.Tensor, chunk=chunk, block_v=block_v, stages=stages) -> torch.Tensor:
            return gated_delta_rule(**inputs, state=s, meta=meta, chunk_size=chunk,
                                    block_v=block_v, num_stages=stages)  # fmt: skip

        state = initial.clone()
        try:
            out = run(state)
        except triton.runtime.errors.OutOfResources as exc:
            yield f"| delta rule prefill {batch} × {length}, {name} | does not fit: {exc} | |"
            continue
        flat = expected.flatten(0, 1)
        agrees = check(f"delta rule prefill, {name}", out, flat, 1e-2)
        agrees &= check(f"delta rule prefill state, {name}", state[slots], expected_state, 1e-2)
        name += "" if agrees else " (MISMATCH)"
        ms = triton.testing.do_bench(lambda run=run, state=state: run(state), warmup=5, rep=50)
        yield (
            f"| delta rule prefill {batch} × {length}, {name} | {ms * 1e3:.0f} µs | "
            f"{num_tokens / (ms * 1e-3) / 1e6:.2f} M tokens/s |"
        )
    peer_ms = triton.testing.do_bench(peer, warmup=1, rep=10)
    yield (
        f"| peer: transformers torch_chunk_gated_delta_rule, {batch} × {length} | "
        f"{peer_ms * 1e3:.0f} µs | {num_tokens / (peer_ms * 1e-3) / 1e6:.2f} M tokens/s |"
    )

    x = torch.randn(num_tokens, CONV_DIM, dtype=DTYPE, device="cuda")
    weight = torch.randn(CONV_DIM, CONV_K, dtype=DTYPE, device="cuda")
    conv_state = torch.zeros(batch, CONV_DIM, CONV_K - 1, dtype=DTYPE, device="cuda")
    fresh = metadata([length] * batch, has_initial=False)
    expected_conv = causal_conv1d_fn(batched(x, batch).transpose(1, 2), weight, activation="silu")
    out = causal_conv1d(x, weight, None, conv_state, fresh)
    expected_conv = expected_conv.transpose(1, 2).flatten(0, 1)
    conv_name = (
        "causal conv prefill"
        if check("causal conv prefill", out, expected_conv, 1e-2)
        else "causal conv prefill (MISMATCH)"
    )
    ms = triton.testing.do_bench(lambda: causal_conv1d(x, weight, None, conv_state, fresh))
    yield (
        f"| {conv_name} {batch} × {length} | {ms * 1e3:.0f} µs | "
        f"{num_tokens / (ms * 1e-3) / 1e6:.2f} M tokens/s, "
        f"{2 * x.numel() * 2 / (ms * 1e-3) / 1e12:.2f} TB/s x in + out |"
    )


def main() -> None:
    torch.manual_seed(int.from_bytes(os.urandom(4), "little"))  # fresh inputs every run
    copy_bw, _ = print_header()
    # Rows print as they come (between the checks' lines): a run cut short keeps what it timed.
    print("\n| decode step | median time | state bytes | achieved |\n|---|---|---|---|")
    for batch in (1, 64, 256):
        for row in decode_step(copy_bw, batch):
            print(row, flush=True)
    print("\n| prefill | median time | throughput |\n|---|---|---|")
    for row in prefill():
        print(row, flush=True)


if __name__ == "__main__":
    main()
