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

Every layer splits its own shapes: Gemma 4's global layers their wider heads and fewer KV heads
(a KV-shared layer its queries, reading its owner's KV heads of the same rank), its double-wide
MLPs their rows. Its per-layer inputs' table is split by vocabulary as the embedding is (the
projections beside it are replicated). A hybrid Qwen's linear-attention layers split by head:
in_proj's q, k, v, z, b, a rows, the convolution's channels, A_log and dt_bias by this rank's
key and value heads (value head h reads key head h // (Hv / Hk)), out_proj by columns; its
recurrent state holds those heads only. A checkpoint's in_proj_qkv and conv1d stack all of q,
then k, then v: a rank's rows of them are three ranges (`grouped_part`).

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
from appliance.engine.models.layers import MLP, Attention
from appliance.engine.models.linear_attention import GatedDeltaNet
from appliance.engine.models.sparse_moe import Experts, SparseMoeBlock
from appliance.engine.parallel.all_reduce import AllReduce

# Our parameter names (appliance.engine.models.loader) whose outputs (rows) are split. The
# linear attention's in_proj: its z, b and a parts (by value head); its qkv part is grouped.
_SPLIT_ROWS = (
    "self_attn.qkv_proj",
    "mlp.gate_up_proj",
    "mlp.shared_expert.gate_up_proj",
    "linear_attn.in_proj",
)
# ... whose inputs (columns) are split: the row-parallel projections, followed by an all-reduce.
_SPLIT_COLUMNS = (
    "self_attn.o_proj",
    "mlp.down_proj",
    "mlp.shared_expert.down_proj",
    "linear_attn.out_proj",
)
# Parameters with one value per head, split as the heads are: gpt-oss's sinks (query heads),
# Gated DeltaNet's decay and time step (value heads).
_SPLIT_BY_HEAD = ("self_attn.sinks", "linear_attn.A_log", "linear_attn.dt_bias")
# Embedding tables split by vocabulary (VocabParallelEmbedding): the tokens' and Gemma 4's
# per-layer inputs'.
_SPLIT_VOCABULARY = ("embed_tokens.weight", "embed_tokens_per_layer.weight", "lm_head")
# Checkpoint tensors (canonical names) whose rows stack a linear-attention layer's q, k and v
# (in_proj_qkv's rows and the convolution's channels, with a per-channel FP8 scale): a rank
# holds its heads of each of the three, so its rows are three ranges, not one (`grouped_part`).
_GROUPED = (
    "linear_attn.in_proj_qkv.weight",
    "linear_attn.in_proj_qkv.weight_scale",
    "linear_attn.conv1d.weight",
)
# The module of a sparse layer's stacked experts (in the MLP's place, or Gemma 4's beside it):
# every tensor in it ([E, ...]: weights, biases, gpt-oss's MXFP4 blocks and scales) is split
# along its first dimension, by whole experts.
_EXPERTS = ("mlp.experts", "moe.experts")
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
    # A hybrid model's linear-attention [q; k; v] rows (all ranks'): key, key, value sizes.
    qkv_groups: tuple[int, ...] = ()

    @classmethod
    def for_model(cls, config: ModelConfig, rank: int, size: int) -> ShardPlan:
        """Refuses a split the model's shapes do not allow, naming the dimension at fault."""
        verify_divisible(config, size)
        if not 0 <= rank < size:
            raise EngineConfigError(f"tensor-parallel rank {rank} is outside 0..{size - 1}")
        linear = config.linear_attention
        groups = () if linear is None else (linear.key_size, linear.key_size, linear.value_size)
        return cls(rank, size, 0 if config.moe is None else config.moe.router.num_experts, groups)

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
        if rows or target in _SPLIT_VOCABULARY:
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

    @staticmethod
    def is_grouped(name: str) -> bool:
        """Whether checkpoint tensor `name` (canonical) is one whose part is several ranges of
        rows (`grouped_part`): read it whole."""
        return name.endswith(_GROUPED)

    def grouped_part(self, name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """This rank's rows of checkpoint tensor `name` (canonical) when it stacks a linear
        attention's q, k and v: its key heads' rows of q and of k and its value heads' of v,
        in that order (its in_proj and conv1d hold them so); None for any other tensor."""
        if name.endswith("linear_attn.in_proj_qkv.weight_scale_inv"):
            raise ModelLoadError(
                f"tensor {name!r}: block-scaled FP8 linear-attention input projections are not "
                "split across GPUs (not built); set tensor_parallel_size = 1"
            )
        if not self.is_grouped(name) or tensor.numel() == 1:  # one scale: the same for all
            return None
        if tensor.shape[0] != sum(self.qkv_groups):
            raise ModelLoadError(
                f"tensor {name!r} has {tensor.shape[0]} rows; the config's linear attention "
                f"has {sum(self.qkv_groups)} (q, k, v: {self.qkv_groups})"
            )
        parts, start = [], 0
        for rows in self.qkv_groups:
            part = rows // self.size
            parts.append(tensor[start + self.rank * part : start + (self.rank + 1) * part])
            start += rows
        return torch.cat(parts)

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
        for attn in model.attentions:
            if attn.o_proj.bias is not None:
                attn.o_proj.bias.data.zero_()


def verify_divisible(config: ModelConfig, size: int) -> None:
    """Every split dimension must divide by `size` (no padding of heads, experts or
    vocabulary), in every layer: Gemma 4's global layers have KV heads and MLPs of their own,
    a hybrid's linear layers key and value heads of theirs."""
    if size < 1:
        raise EngineConfigError(f"tensor_parallel_size must be at least 1, not {size}")
    dims = {
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "vocab_size": config.vocab_size,
    }
    moe = config.moe
    for i in range(config.num_layers):
        if not config.is_linear_layer(i):
            dims.setdefault(f"key-value heads of layer {i}", config.num_kv_heads_of(i))
        if moe is None or not moe.moe_layers[i] or moe.beside_dense_mlp:  # a dense MLP
            dims.setdefault(f"intermediate_size of layer {i}", config.intermediate_size_of(i))
    if config.per_layer_input_size:
        dims["vocab_size_per_layer_input"] = config.per_layer_vocab_size
    linear = config.linear_attention
    if linear is not None:
        dims["linear_num_key_heads"] = linear.num_key_heads
        dims["linear_num_value_heads"] = linear.num_value_heads
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
    """Shrink a model built on the meta device to this rank's shapes (before its tensors are
    allocated)."""
    config, n = model.config, plan.size
    if n == 1:
        return
    with torch.device("meta"):
        for i, layer in enumerate(model.layers):
            if layer.linear_attn is not None:
                linear = layer.linear_attn
                layer.linear_attn = GatedDeltaNet(
                    linear.config.per_rank(n), config.hidden_size, linear.norm.eps, linear.ops
                )
            else:
                assert layer.self_attn is not None, "a layer attends one way or the other"
                _shard_attention(layer.self_attn, config, n)
            if isinstance(layer.mlp, SparseMoeBlock):
                _shard_sparse_block(layer.mlp, config, plan)
            else:
                _shard_mlp(layer.mlp, config.intermediate_size_of(i) // n)
            if layer.moe is not None:  # Gemma 4's, beside the MLP
                _shard_sparse_block(layer.moe, config, plan)
        vocab = config.vocab_size // n
        model.embed_tokens = VocabParallelEmbedding(vocab, config.hidden_size, plan.rank * vocab)
        if model.lm_head is not None:
            model.lm_head = nn.Parameter(torch.empty(vocab, config.hidden_size))
        if model.embed_tokens_per_layer is not None:
            # Gemma 4's per-layer table is split by vocabulary, as the token embedding is:
            # 262,144 rows of every layer's input side by side (E4B: 42 x 256 wide, 5.6 GB in
            # bfloat16) is most of a small model's bytes, and its lookup's all-reduce one
            # [T, layers x P] per step. Split by width instead, every layer would need an
            # all-reduce of its own (the norm over P sees all of P); the projections beside it
            # (hidden x layers x P, and 2 x hidden x P per layer) are replicated.
            rows = config.per_layer_vocab_size // n
            width = model.embed_tokens_per_layer.weight.shape[1]
            model.embed_tokens_per_layer = VocabParallelEmbedding(rows, width, plan.rank * rows)


def _shard_attention(attn: Attention, config: ModelConfig, n: int) -> None:
    """On the meta device: 1/n of the layer's own query and KV heads (Gemma 4's global layers
    have their own head dim and KV heads; a KV-shared layer, projecting q alone, holds the
    heads of the layer whose cache it reads, which are split alike)."""
    attn.num_heads //= n
    attn.num_kv_heads //= n
    attn.q_size //= n
    attn.kv_size //= n
    attn.qkv_proj = nn.Linear(config.hidden_size, attn.q_rows + attn.kv_rows, bias=config.qkv_bias)
    attn.o_proj = nn.Linear(attn.q_size, config.hidden_size, bias=config.o_bias)
    if attn.sinks is not None:
        attn.sinks = nn.Parameter(torch.empty(attn.num_heads))


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
        # Each output the norms or the residual read is whole. Gemma 4's MoE block beside the
        # MLP: both are normed before their sum (a norm of a partial sum is not a partial sum
        # of norms), so each is all-reduced.
        attention = layer.self_attn if layer.linear_attn is None else layer.linear_attn
        for block in (attention, layer.mlp, layer.moe):
            if block is not None:
                block.register_forward_hook(all_reduce_output)
    for table in (model.embed_tokens, model.embed_tokens_per_layer):
        if table is not None:
            assert isinstance(table, VocabParallelEmbedding)
            table.all_reduce = all_reduce
    local_logits = model.compute_logits

    def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32, the same on every rank."""
        local = local_logits(hidden)  # [N, vocab / n]: this rank's rows of the vocabulary
        parts = [torch.empty_like(local) for _ in range(plan.size)]
        dist.all_gather(parts, local, group=group)
        return torch.cat(parts, dim=-1)

    model.compute_logits = compute_logits  # type: ignore[method-assign]
    return all_reduce
