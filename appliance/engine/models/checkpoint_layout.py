"""How a family names its tensors in a checkpoint, mapped onto one canonical naming.

The canonical names are Llama's as transformers saves them: `model.embed_tokens.weight`,
`model.layers.{i}.self_attn.{q,k,v,o}_proj.weight`, `model.layers.{i}.mlp.{gate,up,down}_proj.
weight`, the norms under their own names, `model.norm.weight` and `lm_head.weight`. The loader
knows only those (and, for a mixture of experts, Qwen's `mlp.gate.weight` and
`mlp.experts.{e}.{gate,up,down}_proj.weight`); a layout says where a family's differ: the decoder
under another prefix (Gemma 3 inside a multimodal checkpoint), modules under other names
(Mixtral's `block_sparse_moe.experts.{e}.w1`), projections stored already fused (Phi-3), parts
of the checkpoint this appliance does not serve (Gemma 3's vision tower), skipped by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# A fused checkpoint projection -> the canonical projections stacked in its rows, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


@dataclass(frozen=True, slots=True)
class Piece:
    """Rows [start, stop) of a checkpoint tensor are the canonical tensor `name` (stop None:
    the whole tensor)."""

    name: str
    start: int = 0
    stop: int | None = None


@dataclass(frozen=True, slots=True)
class CheckpointLayout:
    # Prefixes the decoder's tensors carry instead of "model.", and the lm_head's names.
    decoder_prefixes: tuple[str, ...] = ("model.",)
    lm_head_names: tuple[str, ...] = ("lm_head.weight",)
    # qkv_proj and gate_up_proj are stored as one tensor each ([q; k; v], [gate; up] rows).
    fused_projections: bool = False
    # Tensors of parts not served here, skipped by name, and what the part is.
    unserved_prefixes: tuple[str, ...] = ()
    unserved_part: str = ""
    # (theirs, canonical) substrings of a tensor name, replaced in order.
    renames: tuple[tuple[str, str], ...] = ()
    # Experts stored as gpt-oss stores them: stacked, transposed, gate and up interleaved,
    # biased, dense or MXFP4 (converted on load, models.fused_experts).
    gpt_oss_experts: bool = False

    def is_unserved(self, name: str) -> bool:
        return name.startswith(self.unserved_prefixes)

    def canonical_name(self, name: str) -> str:
        """The canonical name of checkpoint tensor `name` (fused ones keep their own)."""
        if name in self.lm_head_names:
            return "lm_head.weight"
        for theirs, canonical in self.renames:
            name = name.replace(theirs, canonical)
        for prefix in self.decoder_prefixes:
            if name.startswith(prefix):
                return "model." + name.removeprefix(prefix)
        return name

    def fused_parts(self, name: str) -> tuple[str, tuple[str, ...]] | None:
        """(fused projection, its canonical parts) when `name` is stored fused, else None."""
        if not self.fused_projections:
            return None
        module = self.canonical_name(name).rpartition(".")[0]
        for fused, parts in _FUSED.items():
            if module.endswith("." + fused):
                return fused, parts
        return None

    def pieces(self, name: str, rows: Mapping[str, tuple[int, ...]]) -> list[Piece]:
        """The canonical tensors in checkpoint tensor `name` (none: an unserved part's).
        `rows` gives the row counts of each fused projection's parts ("self_attn.qkv_proj":
        (q, k, v), "mlp.gate_up_proj": (gate, up)). An unknown name passes through unchanged,
        for the loader to refuse."""
        if self.is_unserved(name):
            return []
        canonical = self.canonical_name(name)
        fused = self.fused_parts(name)
        if fused is None:
            return [Piece(canonical)]
        projection, parts = fused
        module, _, kind = canonical.rpartition(".")
        base = module.removesuffix(projection)
        pieces, start = [], 0
        for part, num_rows in zip(parts, rows[projection], strict=True):
            pieces.append(Piece(f"{base}{part}.{kind}", start, start + num_rows))
            start += num_rows
        return pieces


LLAMA_LAYOUT = CheckpointLayout()
FUSED_PROJECTIONS = CheckpointLayout(fused_projections=True)
# Mixtral's MoE block is `block_sparse_moe`, its experts' gate, down and up projections w1, w2, w3
# (as Mistral released them and transformers 5 still saves them).
MIXTRAL_LAYOUT = CheckpointLayout(
    renames=(
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w2.", ".down_proj."),
        (".w3.", ".up_proj."),
    )
)
# gpt-oss's router is `mlp.router` (a projection with a bias); its experts see models.fused_experts.
GPT_OSS_LAYOUT = CheckpointLayout(renames=((".mlp.router.", ".mlp.gate."),), gpt_oss_experts=True)
# transformers 5 saves Gemma3ForConditionalGeneration as model.language_model.* next to
# model.vision_tower.*; Google's releases as language_model.model.* next to vision_tower.*.
GEMMA3_MULTIMODAL = CheckpointLayout(
    decoder_prefixes=("model.language_model.", "language_model.model."),
    lm_head_names=("lm_head.weight", "language_model.lm_head.weight"),
    unserved_prefixes=(
        "model.vision_tower.",
        "model.multi_modal_projector.",
        "vision_tower.",
        "multi_modal_projector.",
    ),
    unserved_part="the vision tower (this appliance serves Gemma 3's text model; image inputs "
    "are refused)",
)
# Gemma 4's MoE block sits beside the MLP at the layer's top level: its router's projection,
# input scale and per-expert scales, and its stacked experts ([E, 2I, H] gate/up, [E, H, I]),
# renamed into the block's (models.sparse_moe).
_GEMMA4_MOE_RENAMES = (
    (".router.proj.", ".moe.gate."),
    (".router.scale", ".moe.gate.scale"),
    (".router.per_expert_scale", ".moe.gate.per_expert_scale"),
    (".experts.", ".moe.experts."),
)
GEMMA4_LAYOUT = CheckpointLayout(renames=_GEMMA4_MOE_RENAMES)
# Gemma4ForConditionalGeneration: the text model under model.language_model, beside its vision
# and audio towers and their embedders.
GEMMA4_MULTIMODAL = CheckpointLayout(
    decoder_prefixes=("model.language_model.",),
    renames=_GEMMA4_MOE_RENAMES,
    unserved_prefixes=(
        "model.vision_tower.",
        "model.embed_vision.",
        "model.audio_tower.",
        "model.embed_audio.",
    ),
    unserved_part="the vision and audio towers (this appliance serves Gemma 4's text model; "
    "image and audio inputs are refused)",
)
# Qwen3.5 as released carries a multi-token-prediction head (`mtp.*`, speculative decoding's
# draft layer), which this appliance does not run.
QWEN3_5_LAYOUT = CheckpointLayout(
    unserved_prefixes=("mtp.",),
    unserved_part="the multi-token-prediction head (not used for decoding here)",
)
# transformers 5 saves Qwen3_5ForConditionalGeneration (and its MoE) as model.language_model.*
# next to model.visual.*.
QWEN3_5_MULTIMODAL = CheckpointLayout(
    decoder_prefixes=("model.language_model.",),
    unserved_prefixes=("model.visual.", "mtp."),
    unserved_part="the vision tower and the multi-token-prediction head (this appliance serves "
    "Qwen3.5's text model; image inputs are refused)",
)
