"""The paged KV-cache pool: its geometry, its encoding, its size from a memory budget, its
tensors.

The pool stores keys and values in the model's dtype, or (`kv_cache_dtype = "fp8_e4m3"`) in
float8_e4m3fn, each value divided by its layer's K or V scale (kernels.reference.quantize_kv;
the scales live in the model's attention layers). Blocks are sized by their real bytes, so an
FP8 pool holds twice the blocks of a bf16 one in the same memory.

Each layer that owns KV has a cache tensor of its own shape (Gemma 4's global layers have wider
heads and fewer of them); a layer that attends over another's KV (Gemma 4's KV-shared layers)
owns none, and a block's bytes are the sum over the owning layers.

KV groups (docs/ARCHITECTURE.md, "KV groups"): a model with both windowed and full KV-owning
layers (Gemma 3, Gemma 4, gpt-oss) may keep its windowed layers' pages in a pool of their own,
whose blocks are given back as they leave the window (appliance.engine.block_manager). A
block id then means a block of one pool or the other: each layer's tensor has its group's
number of blocks. `KVPools` says how many each pool has.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from appliance.engine.engine_settings import KVCacheDtype
from appliance.engine.errors import EngineConfigError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from kernels.launch_checks import KV_CACHE_FP8


@dataclass(frozen=True, slots=True)
class KVPools:
    """Blocks in each group's pool: the full group's (every layer's, with one group) and the
    window group's (0: one group)."""

    num_blocks: int
    num_window_blocks: int = 0


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    # Per layer that owns KV pages (ModelConfig.kv_layers), in order: (num_kv_heads, head_dim).
    layer_shapes: tuple[tuple[int, int], ...]
    block_size: int
    dtype: torch.dtype
    # Per layer of layer_shapes: whether its pages may live in the window group's pool
    # (ModelConfig.window_group); empty for a model with one group.
    window_layers: tuple[bool, ...] = ()

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        block_size: int,
        model_dtype: torch.dtype,
        *,
        kv_cache_dtype: KVCacheDtype = "auto",
        tensor_parallel_size: int = 1,
    ) -> KVCacheSpec:
        """One device's pool: under tensor parallelism each holds its share of the KV heads.
        Only the layers of `config.kv_layers` have pages (a hybrid's linear layers keep a
        recurrent state instead, models.recurrent_state; Gemma 4's KV-shared layers read an
        earlier layer's)."""
        shapes = tuple(
            (config.num_kv_heads_of(i) // tensor_parallel_size, config.head_dim_of(i))
            for i in config.kv_layers
        )
        dtype = model_dtype if kv_cache_dtype == "auto" else KV_CACHE_FP8
        window_group = set(config.window_group)
        window_layers = tuple(i in window_group for i in config.kv_layers) if window_group else ()
        return cls(shapes, block_size, dtype, window_layers)

    @property
    def num_layers(self) -> int:
        """Layers that own KV pages (ModelConfig.kv_layers)."""
        return len(self.layer_shapes)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == KV_CACHE_FP8

    @property
    def bytes_per_block(self) -> int:
        """A block of every KV-owning layer: one pool's block with one group."""
        return self._bytes_per_block(lambda _in_window: True)

    @property
    def full_group_bytes_per_block(self) -> int:
        """A block of the full group's layers (every layer's, for a model with one group)."""
        return self._bytes_per_block(lambda in_window: not in_window)

    @property
    def window_group_bytes_per_block(self) -> int:
        """A block of the window group's layers (0 for a model with one group)."""
        return self._bytes_per_block(lambda in_window: in_window)

    def _bytes_per_block(self, counts: Callable[[bool], bool]) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        in_window = self.window_layers or (False,) * self.num_layers
        per_token = sum(
            num_kv_heads * head_dim
            for (num_kv_heads, head_dim), window in zip(self.layer_shapes, in_window, strict=True)
            if counts(window)
        )
        return 2 * self.block_size * per_token * elem

    def pools_within(self, memory_bytes: int, num_window_blocks: int) -> KVPools:
        """The pools `memory_bytes` holds, the window group's of `num_window_blocks` blocks
        (block_manager.window_pool_num_blocks) and the rest the full group's.

        Two groups only where the window pool fits in the share of the memory its layers would
        take in one pool: then the full group holds at least as many tokens as one pool would,
        and the window group at least as many window tokens, so no load does worse than with
        one pool. Otherwise (a tight budget for max_num_seqs windows) one pool, as for a model
        with one group."""
        window_bytes = num_window_blocks * self.window_group_bytes_per_block
        share = memory_bytes * self.window_group_bytes_per_block // self.bytes_per_block
        if not self.window_layers or not num_window_blocks or window_bytes > share:
            return KVPools(self._num_blocks_within(memory_bytes, self.bytes_per_block))
        full = self._num_blocks_within(memory_bytes - window_bytes, self.full_group_bytes_per_block)
        return KVPools(full, num_window_blocks)

    def pool_bytes(self, pools: KVPools) -> int:
        """What the tensors of `allocate(pools)` take."""
        if not pools.num_window_blocks:
            return pools.num_blocks * self.bytes_per_block
        return (
            pools.num_blocks * self.full_group_bytes_per_block
            + pools.num_window_blocks * self.window_group_bytes_per_block
        )

    @staticmethod
    def _num_blocks_within(memory_bytes: int, bytes_per_block: int) -> int:
        num_blocks = memory_bytes // bytes_per_block
        if num_blocks < 1:
            raise EngineConfigError(
                f"the KV-cache budget of {memory_bytes} bytes holds no block of "
                f"{bytes_per_block} bytes; raise the KV-cache memory"
            )
        return num_blocks

    def verify_scales(self, model: CausalLM) -> None:
        """An FP8 pool needs every layer's K and V scale positive and finite (1 unless the
        checkpoint set them); raise EngineConfigError naming the first that is not. Reads
        them on the host: once, as the engine is built."""
        if not self.is_fp8:
            return
        for index in model.config.kv_layers:
            for name in ("k_scale", "v_scale"):
                value = float(getattr(model.layers[index].self_attn, name).float().item())
                if not (math.isfinite(value) and value > 0):
                    raise EngineConfigError(
                        f"layer {index}'s KV-cache {name} is {value}: an FP8 KV cache needs "
                        "positive finite scales (load the model with models.loader, or call "
                        "reset_kv_scales after materialising it)"
                    )

    def allocate(self, pools: KVPools, device: torch.device | str) -> list[torch.Tensor]:
        """One tensor per KV-owning layer: [2 (k, v), num_blocks, block_size, num_kv_heads,
        head_dim], of that layer's shape, with its group's number of blocks.

        Zero-filled, so a never-written slot read through padding is finite.
        """
        in_window = self.window_layers or (False,) * self.num_layers
        window_blocks = pools.num_window_blocks or pools.num_blocks
        return [
            torch.zeros(
                (2, window_blocks if window else pools.num_blocks, self.block_size, heads, dim),
                dtype=self.dtype,
                device=device,
            )
            for (heads, dim), window in zip(self.layer_shapes, in_window, strict=True)
        ]
