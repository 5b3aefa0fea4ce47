"""What KV groups (issue 21) save: a long sequence's KV bytes and the long sequences a KV budget
holds, with one pool and with the windowed layers in a pool of their own.

Arithmetic, not a timing (no GPU): it runs the engine's own sizing code on a model's published
shapes (`bench.gpu_engine.SHAPES`), so the figures stay true to the code. Before: one pool,
every KV-owning layer's pages for every token (the engine for a model whose layers are not all
windowed, until KV groups). After: the full layers' pages for every token, the windowed layers'
for the blocks a decode's window sees; the budget split as the engine splits it
(`KVCacheSpec.pools_within`, the window pool being `window_pool_num_blocks` for the engine's
settings).

    python bench/kv_groups.py --model gemma-3-12b --context 32768 --budget-gib 40
"""

from __future__ import annotations

import argparse

import torch

from appliance.engine.block_manager import BlockManager, window_pool_num_blocks
from appliance.engine.engine_settings import EngineSettings
from appliance.engine.kv_cache import KVCacheSpec
from appliance.engine.models.config import ModelConfig
from bench.gpu_engine import SHAPES


def main() -> None:
    defaults = EngineSettings()
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(SHAPES), default="gemma-3-12b")
    parser.add_argument("--context", type=int, default=32768, help="tokens of each sequence")
    parser.add_argument("--budget-gib", type=float, default=40.0, help="the KV budget")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens
    )
    parser.add_argument("--block-size", type=int, default=defaults.block_size)
    args = parser.parse_args()

    config = ModelConfig.from_dict(SHAPES[args.model])
    window = config.window_group_window
    if window is None:
        raise SystemExit(f"{args.model} has one KV group: nothing to compare")
    block = args.block_size
    spec = KVCacheSpec.for_model(config, block, torch.bfloat16)
    per_token = spec.bytes_per_block // block
    full_per_token = spec.full_group_bytes_per_block // block
    # A decoding sequence's window blocks: those its query's window sees (a straddle included).
    window_blocks = BlockManager(1, block, kv_window=window).max_blocks_held(args.context, 1)
    before = args.context * per_token
    after = args.context * full_per_token + window_blocks * spec.window_group_bytes_per_block
    budget = int(args.budget_gib * 2**30)
    num_window_blocks = window_pool_num_blocks(
        window, block, args.max_num_seqs, args.max_num_batched_tokens, config.max_model_len
    )
    one_pool = spec.pools_within(budget, 0)
    two_pools = spec.pools_within(budget, num_window_blocks)
    blocks_per_seq = -(-args.context // block)
    num_before = one_pool.num_blocks // blocks_per_seq
    num_after = min(two_pools.num_blocks // blocks_per_seq, args.max_num_seqs)
    window_bytes = num_window_blocks * spec.window_group_bytes_per_block

    print(
        f"{args.model}: {len(config.kv_layers)} KV layers, {len(config.window_group)} of window "
        f"{window}; bf16 KV, blocks of {block}"
    )
    print(
        f"KV bytes/token: {per_token:,} in one pool; {full_per_token:,} full layers + "
        f"{spec.window_group_bytes_per_block // block:,} windowed layers (a window's worth)"
    )
    print(
        f"a {args.context}-token sequence: {before / 2**30:.2f} GiB before, "
        f"{after / 2**30:.2f} GiB after (window layers: {window_blocks} blocks), "
        f"{before / after:.1f}x less"
    )
    print(
        f"{args.budget_gib:g} GiB of KV, max_num_seqs {args.max_num_seqs}, "
        f"max_num_batched_tokens {args.max_num_batched_tokens}: window pool "
        f"{num_window_blocks} blocks ({window_bytes / 2**30:.2f} GiB), full pool "
        f"{two_pools.num_blocks} blocks ({two_pools.num_blocks * block:,} tokens)"
    )
    print(
        f"{args.context}-token sequences held at once: {num_before} before, {num_after} after"
        + ("" if two_pools.num_window_blocks else " (the split fell back to one pool)")
    )


if __name__ == "__main__":
    main()
