"""What the attention layers of one forward pass need to find each sequence's KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """A flattened, variable-length batch: sequence b owns `query_lens[b]` consecutive tokens.

    slot_mapping: [T] int64, where each new token's key and value are written (-1: padding)
    block_tables: [B, max_blocks] int32, each sequence's block ids (padding: 0)
    seq_lens / query_lens: per sequence, total context after this step / tokens in this step
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: list[int]
    query_lens: list[int]
