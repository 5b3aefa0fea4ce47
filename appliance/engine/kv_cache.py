"""The paged KV-cache pool: its geometry, its encoding, its size from a memory budget, its
tensors.

The pool stores keys and values in the model's dtype, or (`kv_cache_dtype = "fp8_e4m3"`) in
float8_e4m3fn, each value divided by its layer's K or V scale (kernels.reference.quantize_kv;
the scales live in the model's attention layers). Blocks are sized by their real bytes, so an
FP8 pool holds twice the blocks of a bf16 one in the same memory.

Each layer that owns KV has a cache tensor of its own shape (Gemma 4's global layers have wider
heads and fewer of them); a layer that attends over another's KV (Gemma 4's KV-shared layers)
owns none, and a block's bytes are the sum over the owning layers.
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
    # Per layer that owns KV pages (ModelConfig.kv_layers), in order: (num_kv_heads, head_dim).
    layer_shapes: tuple[tuple[int, int], ...]
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
        Only the layers of `config.kv_layers` have pages (a hybrid's linear layers keep a
        recurrent state instead, models.recurrent_state; Gemma 4's KV-shared layers read an
        earlier layer's)."""
        shapes = tuple(
            (config.num_kv_heads_of(i) // tensor_parallel_size, config.head_dim_of(i))
            for i in config.kv_layers
        )
        dtype = model_dtype if kv_cache_dtype == "auto" else KV_CACHE_FP8
        return cls(shapes, block_size, dtype)

    @property
    def num_layers(self) -> int:
        """Layers that own KV pages (ModelConfig.kv_layers)."""
        return len(self.layer_shapes)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == KV_CACHE_FP8

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        per_token = sum(num_kv_heads * head_dim for num_kv_heads, head_dim in self.layer_shapes)
        return 2 * self.block_size * per_token * elem

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
        for index in model.config.kv_layers:
            for name in ("k_scale", "v_scale"):
                value = float(getattr(model.layers[index].self_attn, name).float().item())
                if not (math.isfinite(value) and value > 0):
                    raise EngineConfigError(
                        f"layer {index}'s KV-cache {name} is {value}: an FP8 KV cache needs "
                        "positive finite scales (load the model with models.loader, or call "
                        "reset_kv_scales after materialising it)"
                    )

    def allocate(self, num_blocks: int, device: torch.device | str) -> list[torch.Tensor]:
        """One tensor per KV-owning layer: [2 (k, v), num_blocks, block_size, num_kv_heads,
        head_dim], of that layer's shape.

        Zero-filled, so a never-written slot read through padding is finite.
        """
        return [
            torch.zeros(
                (2, num_blocks, self.block_size, num_kv_heads, head_dim),
                dtype=self.dtype,
                device=device,
            )
            for num_kv_heads, head_dim in self.layer_shapes
        ]
