"""The paged KV-cache pool: its geometry, its encoding, its size from a memory budget, its
tensors.

The pool stores keys and values in the model's dtype, or (`kv_cache_dtype = "fp8_e4m3"`) in
float8_e4m3fn, each value divided by its layer's K or V scale (kernels.reference.quantize_kv;
the scales live in the model's attention layers). Blocks are sized by their real bytes, so an
FP8 pool holds twice the blocks of a bf16 one in the same memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from appliance.engine.engine_settings import KVCacheDtype
from appliance.engine.errors import EngineConfigError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from kernels.launch_checks import KV_CACHE_FP8


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
        model_dtype: torch.dtype,
        *,
        kv_cache_dtype: KVCacheDtype = "auto",
        tensor_parallel_size: int = 1,
    ) -> KVCacheSpec:
        """One device's pool: under tensor parallelism each holds its share of the KV heads.
        Only the layers of `config.kv_cache_layers` have pages (a hybrid's linear layers keep a
        recurrent state instead: models.recurrent_state)."""
        num_kv_heads = config.num_kv_heads // tensor_parallel_size
        dtype = model_dtype if kv_cache_dtype == "auto" else KV_CACHE_FP8
        num_layers = len(config.kv_cache_layers)
        return cls(num_layers, num_kv_heads, config.head_dim, block_size, dtype)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == KV_CACHE_FP8

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

    def verify_scales(self, model: CausalLM) -> None:
        """An FP8 pool needs every layer's K and V scale positive and finite (1 unless the
        checkpoint set them); raise EngineConfigError naming the first that is not. Reads
        them on the host: once, as the engine is built."""
        if not self.is_fp8:
            return
        for index, attention in zip(model.config.kv_cache_layers, model.attentions, strict=True):
            for name in ("k_scale", "v_scale"):
                value = float(getattr(attention, name).float().item())
                if not (math.isfinite(value) and value > 0):
                    raise EngineConfigError(
                        f"layer {index}'s KV-cache {name} is {value}: an FP8 KV cache needs "
                        "positive finite scales (load the model with models.loader, or call "
                        "reset_kv_scales after materialising it)"
                    )

    def allocate(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """One tensor per layer: [2 (k, v), num_blocks, block_size, num_kv_heads, head_dim].

        Zero-filled, so a never-written slot read through padding is finite.
        """
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(self.num_layers)]
