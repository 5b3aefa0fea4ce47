"""The contract between the model code and a kernel backend.

`kernels.reference` implements it in plain torch; the Triton backend implements the same
functions with the same semantics, so the model never knows which one it runs on.
"""

from __future__ import annotations

from typing import Protocol

import torch


class KernelOps(Protocol):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rotary_embedding(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor: ...

    def write_kv_cache(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None: ...

    def paged_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: list[int],
        query_lens: list[int],
        scale: float,
    ) -> torch.Tensor: ...
