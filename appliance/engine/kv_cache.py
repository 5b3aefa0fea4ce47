"""The paged KV-cache pool: its geometry, its size from a memory budget, its tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.errors import EngineConfigError
from appliance.engine.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        block_size: int,
        dtype: torch.dtype,
        *,
        tensor_parallel_size: int = 1,
    ) -> KVCacheSpec:
        """One device's pool: under tensor parallelism each holds its share of the KV heads."""
        num_kv_heads = config.num_kv_heads // tensor_parallel_size
        return cls(config.num_layers, num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem

    def num_blocks_within(self, memory_bytes: int) -> int:
        num_blocks = memory_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise EngineConfigError(
                f"the KV-cache budget of {memory_bytes} bytes holds no block of "
                f"{self.bytes_per_block} bytes; raise the KV-cache memory"
            )
        return num_blocks

    def allocate(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """One tensor per layer: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].

        Zero-filled, so a never-written slot read through padding is finite.
        """
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
