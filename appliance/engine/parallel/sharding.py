"""Which slice of the model one tensor-parallel rank holds, and the module surgery that makes the
single-device Llama run on that slice (Megatron-LM's layout, applied afterwards as gpt-fast does).

Weights are [out, in] (nn.Linear's layout). Per layer, on each of `size` ranks:
- qkv_proj splits its outputs by heads: rank r holds query heads r*Hq/n .. (r+1)*Hq/n - 1 and
  KV heads r*Hkv/n .. (r+1)*Hkv/n - 1, the KV heads those query heads read under GQA
  (query head h reads KV head h // (Hq/Hkv)), so attention needs no communication and the KV
  cache holds Hkv/n heads per rank; gpt-oss's attention sinks (one per query head) follow
  their heads;
- o_proj splits its inputs the same way (columns of the weight): each rank's product is a
  partial sum of the output, all-reduced; a bias is added by rank 0 alone;
- gate_up_proj splits each of gate and up by rows, down_proj its columns; all-reduced likewise;
- embed_tokens and lm_head split the vocabulary by rows: each rank embeds the tokens it holds
  (zeros for the others; all-reduced) and computes its slice of the logits (all-gathered).
Norms are replicated. The all-reduced hidden states are the same on every rank.

A mixture of experts' sparse layers are expert-parallel (docs/ARCHITECTURE.md, "Expert
parallelism"): rank r holds whole experts r*E/n .. (r+1)*E/n - 1 of each layer's E (the stacked
`mlp.experts.*` tensors split along their expert dimension, their biases with them: each bias
is added once, by the rank that holds its expert); the router is replicated, so every rank
routes every token alike, runs its own experts (the others' ids become -1, which add nothing)
and its partial sum is all-reduced as the dense MLP's is. A shared expert is split as the dense
MLP (its sigmoid gate replicated: it scales each rank's partial sum alike).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from appliance.engine.errors import EngineConfigError, ModelLoadError
from appliance.engine.models.config import ModelConfig
from appliance.engine.models.decoder import CausalLM
from appliance.engine.models.layers import MLP
from appliance.engine.models.sparse_moe import Experts, SparseMoeBlock
from appliance.engine.parallel.all_reduce import AllReduce

# Our parameter names (appliance.engine.models.loader) whose outputs (rows) are split.
_SPLIT_ROWS = ("self_attn.qkv_proj", "mlp.gate_up_proj", "mlp.shared_expert.gate_up_proj")
# ... whose inputs (columns) are split: the row-parallel projections, followed by an all-reduce.
_SPLIT_COLUMNS = ("self_attn.o_proj", "mlp.down_proj", "mlp.shared_expert.down_proj")
# Parameters with one value per query head, split as the heads are.
_SPLIT_BY_HEAD = ("self_attn.sinks",)
# The module of a sparse layer's stacked experts: every tensor in it ([E, ...]: weights, biases,
# gpt-oss's MXFP4 blocks and scales) is split along its first dimension, by whole experts.
_EXPERTS = "mlp.experts"
# One expert's projection, as per-expert checkpoints (Mixtral, Qwen-MoE) name it in ours, and
# an FP8 checkpoint's scales of it: read only by the rank that holds the expert.
_ONE_EXPERT = re.compile(
    r"\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|weight_scale|weight_scale_inv)$"
)
# FP8 scales every rank holds whole: a static input scale and block-scale grids (the loader
# takes each rank's blocks). A scale per output channel ([out, 1]) follows its weight's rows;
# a row-parallel weight's is whole (every rank's partial sums have every output); a scale of
# a whole tensor (one number) is the same everywhere.
_WHOLE_SCALES = ("input_scale", "weight_scale_inv")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """Rank `rank` of `size`: which part of every weight it holds."""

    rank: int
    size: int
    num_experts: int = 0  # per sparse layer, all ranks' (0: a dense model)

    @classmethod
    def for_model(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        """Refuses a split the model's shapes do not allow, naming the dimension at fault."""
        verify_divisible(config, size)
        if not 0 <= rank < size:
            raise EngineConfigError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
        return cls(rank, size, 0 if config.moe is None else config.moe.router.num_experts)

    @property
    def experts(self) -> range:
        """The experts of each sparse layer this rank holds (expert parallelism)."""
        part = self.num_experts // self.size
        return range(self.rank * part, (self.rank + 1) * part)

    def split(self, target: str, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the full tensor of parameter `target` (our name, as the loader
        maps checkpoint names) that this rank holds; None when every rank holds all of it; an
        empty part (start == stop) when it holds none of it (another rank's expert).
        Fused parameters are split shard by shard: `shape` is one shard's (q, k, v, gate, up)."""
        module, _, kind = target.rpartition(".")
        one_expert = _ONE_EXPERT.search(target)
        if one_expert is not None:
            expert = int(one_expert.group(1))
            # One past the config's experts is read, for the loader to refuse by name.
            held = expert in self.experts or expert >= self.num_experts
            return None if held else (0, 0, 0)
        if kind in _WHOLE_SCALES or (kind == "weight_scale" and math.prod(shape) == 1):
            return None
        if module.endswith(_EXPERTS):
            if shape[0] != self.num_experts:
                raise ModelLoadError(
                    f"tensor {target!r} stacks {shape[0]} experts along dimension 0; the "
                    f"config has {self.num_experts}"
                )
            return 0, self.experts.start, self.experts.stop
        rows = module.endswith(_SPLIT_ROWS) or target.endswith(_SPLIT_BY_HEAD)
        if rows or target in ("embed_tokens.weight", "lm_head"):
            dim = 0
        elif module.endswith(_SPLIT_COLUMNS) and kind == "weight":
            dim = 1
        else:
            return None
        if shape[dim] % self.size:
            raise ModelLoadError(
                f"tensor {target!r} has {shape[dim]} along dimension {dim}, which does not split "
                f"into {self.size} equal parts; choose another tensor_parallel_size"
            )
        part = shape[dim] // self.size
        return dim, self.rank * part, (self.rank + 1) * part

    def offset(self, target: str, shape: tuple[int, ...]) -> tuple[int, int]:
        """(row, column) where this rank's part of parameter `target`, of `shape` on this rank,
        starts in the whole tensor."""
        full = list(shape)
        for dim in (0, 1):
            full[dim] = shape[dim] * self.size
            part = self.split(target, tuple(full))
            if part is not None and part[0] == dim:
                return (part[1], 0) if dim == 0 else (0, part[1])
            full[dim] = shape[dim]
        return 0, 0

    def finish_load(self, model: CausalLM) -> None:
        """After the weights are in: a row-parallel bias is added once, by rank 0, to the
        all-reduced sum, so the other ranks hold zeros in its place."""
        if self.rank == 0:
            return
        for layer in model.layers:
            bias = layer.self_attn.o_proj.bias
            if bias is not None:
                bias.data.zero_()


def verify_divisible(config: ModelConfig, size: int) -> None:
    """Every split dimension must divide by `size` (no padding of heads, experts or
    vocabulary)."""
    if size < 1:
        raise EngineConfigError(f"tensor_parallel_size must be at least 1, not {size}")
    if size > 1 and (config.layer_head_dims or config.per_layer_input_size):
        raise EngineConfigError(
            f"tensor_parallel_size {size}: {config.architecture}'s layers of different head "
            "dims and its per-layer inputs are not split across GPUs (not built); set "
            "tensor_parallel_size = 1"
        )
    if size > 1 and config.is_hybrid:
        raise EngineConfigError(
            f"tensor_parallel_size {size}: {config.architecture} has linear-attention layers, "
            "whose projections and recurrent state are not sharded; set tensor_parallel_size = 1"
        )
    dims = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "vocab_size": config.vocab_size,
    }
    moe = config.moe
    if moe is None or not all(moe.moe_layers):  # some layer has the dense MLP
        dims["intermediate_size"] = config.intermediate_size
    if moe is not None:
        dims["num_experts"] = moe.router.num_experts
        if moe.shared_expert_size:
            dims["shared_expert_intermediate_size"] = moe.shared_expert_size
    for name, value in dims.items():
        if value % size:
            raise EngineConfigError(
                f"tensor_parallel_size {size} does not divide the model's {name} ({value}): "
                "each GPU must hold the same number of whole heads, experts, rows and "
                f"vocabulary entries; choose a divisor of {value}"
            )


class VocabParallelEmbedding(nn.Module):
    """Rows vocab_start .. vocab_start + num_embeddings - 1 of the embedding; the full lookup is
    the all-reduce of every rank's (each token is in exactly one rank's rows)."""

    def __init__(self, num_embeddings: int, hidden_size: int, vocab_start: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, hidden_size))
        self.num_embeddings = num_embeddings
        self.vocab_start = vocab_start
        self.all_reduce: AllReduce | None = None  # set by connect_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start  # [T]
        inside = (local >= 0) & (local < self.num_embeddings)
        x = F.embedding(torch.where(inside, local, 0), self.weight)  # [T, hidden]
        x = x.masked_fill(~inside.unsqueeze(-1), 0)  # other ranks' tokens
        assert self.all_reduce is not None, "connect_model wires the embedding's all-reduce"
        self.all_reduce(x)
        return x


def shard_model(model: CausalLM, plan: ShardPlan) -> None:
    """Shrink a model built on the meta device to this rank's shapes (before `to_empty`)."""
    config, n = model.config, plan.size
    if n == 1:
        return
    hidden = config.hidden_size
    with torch.device("meta"):
        for layer in model.layers:
            attn = layer.self_attn
            attn.num_heads //= n
            attn.num_kv_heads //= n
            attn.q_size //= n
            attn.kv_size //= n
            attn.qkv_proj = nn.Linear(hidden, attn.q_size + 2 * attn.kv_size, bias=config.qkv_bias)
            attn.o_proj = nn.Linear(attn.q_size, hidden, bias=config.o_bias)
            if attn.sinks is not None:
                attn.sinks = nn.Parameter(torch.empty(attn.num_heads))
            if isinstance(layer.mlp, SparseMoeBlock):
                _shard_sparse_block(layer.mlp, config, plan)
            else:
                _shard_mlp(layer.mlp, config.intermediate_size // n)
        vocab = config.vocab_size // n
        model.embed_tokens = VocabParallelEmbedding(vocab, hidden, plan.rank * vocab)
        if model.lm_head is not None:
            model.lm_head = nn.Parameter(torch.empty(vocab, hidden))


def _shard_mlp(mlp: MLP, part: int) -> None:
    """On the meta device: `part` of the intermediate rows (gate/up) and columns (down)."""
    hidden = mlp.down_proj.out_features
    mlp.gate_up_proj = nn.Linear(hidden, 2 * part, bias=False)
    mlp.down_proj = nn.Linear(part, hidden, bias=False)


def _shard_sparse_block(block: SparseMoeBlock, config: ModelConfig, plan: ShardPlan) -> None:
    """On the meta device: this rank's experts; the shared expert split as the dense MLP."""
    assert config.moe is not None, "a sparse block belongs to a mixture of experts"
    block.experts = Experts(config.moe, config.hidden_size, plan.experts)
    if block.shared_expert is not None:
        _shard_mlp(block.shared_expert, config.moe.shared_expert_size // plan.size)


def connect_model(
    model: CausalLM, plan: ShardPlan, group: dist.ProcessGroup, *, one_shot: bool = True
) -> AllReduce | None:
    """After the weights are loaded: the all-reduces after each row-parallel projection and
    the embedding, and the all-gather of the logits. Every rank must then run the same forward
    passes and `compute_logits` calls, in the same order. A collective (the all-reduce's
    one-shot buffer, `one_shot`: parallel.all_reduce): every rank calls it alike. Returns the
    all-reduce, for `AllReduce.close` before the group is left (None for one rank)."""
    if plan.size == 1:
        return None
    weight = model.embed_tokens.weight
    all_reduce = AllReduce.for_group(group, weight.device, weight.dtype, one_shot=one_shot)

    def all_reduce_output(_module: nn.Module, _inputs: object, output: torch.Tensor) -> None:
        all_reduce(output)  # [T, hidden]: the sum of every rank's partial

    for layer in model.layers:
        layer.self_attn.register_forward_hook(all_reduce_output)
        layer.mlp.register_forward_hook(all_reduce_output)
    assert isinstance(model.embed_tokens, VocabParallelEmbedding)
    model.embed_tokens.all_reduce = all_reduce
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, the same on every rank."""
        local = local_logits(hidden)  # [N, vocab / n]: this rank's rows of the vocabulary
        parts = [torch.empty_like(local) for _ in range(plan.size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=-1)

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    return all_reduce
