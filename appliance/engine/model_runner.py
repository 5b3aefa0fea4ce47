"""Turns one scheduled step into model inputs, runs the model, and samples.

Inputs are flattened across sequences (vLLM's varlen layout): [T] token ids and positions, a
slot for each token in the paged KV cache, and each sequence's block table. Logits are computed
only where they are needed: the last position of a chunk that samples, and the prompt positions
of a request that asked for prompt log-probabilities.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from appliance.engine.models.llama import LlamaForCausalLM
from appliance.engine.sampling import sample, token_logprobs
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import ScheduledChunk
from kernels.ops import AttentionMetadata

# Rows of prompt logits turned into log-probabilities at once (bounds [rows, vocab] memory).
_PROMPT_LOGPROB_ROWS = 256


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and the `top` most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class ChunkResult:
    """What one scheduled chunk produced."""

    # The next token, when the chunk reached the sequence's end; its log-probabilities when the
    # request asked for them.
    token_id: int | None
    logprob: TokenLogprob | None
    # Log-probabilities of prompt tokens start+1 .. start+len, predicted at this chunk's positions.
    prompt_logprobs: list[TokenLogprob]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device | str,
    ):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)

    @torch.inference_mode()
    def execute(
        self, chunks: Seq[ScheduledChunk], generators: Seq[torch.Generator | None]
    ) -> list[ChunkResult]:
        """Run one step. `generators[i]` drives sampling for `chunks[i]` (None: global RNG)."""
        input_ids, positions, meta = self._prepare(chunks)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        ends = torch.tensor(meta.query_lens, device=self.device).cumsum(0) - 1
        sampling_rows = [i for i, c in enumerate(chunks) if c.samples]
        token_ids: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        if sampling_rows:
            logits = self.model.compute_logits(hidden[ends[sampling_rows]])
            params = [chunks[i].seq.params for i in sampling_rows]
            sampled = sample(logits, params, [generators[i] for i in sampling_rows])
            token_ids = dict(zip(sampling_rows, sampled.tolist(), strict=True))
            logprobs = self._logprobs(logits, sampled, params, sampling_rows)
        prompt = self._prompt_logprobs(chunks, hidden)
        return [
            ChunkResult(token_ids.get(i), logprobs.get(i), prompt.get(i, []))
            for i in range(len(chunks))
        ]

    def _prepare(
        self, chunks: Seq[ScheduledChunk]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        max_blocks = max(len(c.seq.block_table) for c in chunks)
        block_tables = [
            c.seq.block_table + [0] * (max_blocks - len(c.seq.block_table)) for c in chunks
        ]

        def tensor(values: list[int] | list[list[int]], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

        meta = AttentionMetadata.build(
            tensor(slots, torch.int64),
            tensor(block_tables, torch.int32),
            seq_lens=[c.start + c.num_new_tokens for c in chunks],
            query_lens=[c.num_new_tokens for c in chunks],
        )
        return tensor(input_ids, torch.int64), tensor(positions, torch.int64), meta

    @staticmethod
    def _logprobs(
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        params: list[SamplingParams],
        chunk_indices: list[int],
    ) -> dict[int, TokenLogprob]:
        """Log-probabilities for the rows whose request asked for them, keyed by chunk index."""
        if all(p.logprobs is None for p in params):
            return {}
        num_top = max((p.logprobs or 0) for p in params)
        chosen, top_ids, top_lps = token_logprobs(logits, token_ids, num_top)
        chosen_list, ids = chosen.tolist(), token_ids.tolist()
        results = {}
        for row, (chunk_index, p) in enumerate(zip(chunk_indices, params, strict=True)):
            if p.logprobs is None:
                continue
            k = p.logprobs
            top = tuple(zip(top_ids[row, :k].tolist(), top_lps[row, :k].tolist(), strict=True))
            results[chunk_index] = TokenLogprob(ids[row], chosen_list[row], top)
        return results

    def _prompt_logprobs(
        self, chunks: Seq[ScheduledChunk], hidden: torch.Tensor
    ) -> dict[int, list[TokenLogprob]]:
        results: dict[int, list[TokenLogprob]] = {}
        offset = 0
        for i, chunk in enumerate(chunks):
            seq = chunk.seq
            first = offset
            offset += chunk.num_new_tokens
            if not seq.wants_prompt_logprobs:
                continue
            # Position p predicts token p + 1; only prompt tokens count.
            last = min(chunk.start + chunk.num_new_tokens, seq.num_prompt_tokens - 1)
            num_rows = last - chunk.start
            if num_rows <= 0:
                continue
            k = seq.params.prompt_logprobs or 0
            out: list[TokenLogprob] = []
            for row in range(0, num_rows, _PROMPT_LOGPROB_ROWS):
                rows = range(row, min(row + _PROMPT_LOGPROB_ROWS, num_rows))
                logits = self.model.compute_logits(hidden[first + rows.start : first + rows.stop])
                targets = torch.tensor(
                    seq.token_ids[chunk.start + rows.start + 1 : chunk.start + rows.stop + 1],
                    device=self.device,
                )
                chosen, top_ids, top_lps = token_logprobs(logits, targets, k)
                for t, lp, ids, lps in zip(
                    targets.tolist(),
                    chosen.tolist(),
                    top_ids.tolist(),
                    top_lps.tolist(),
                    strict=True,
                ):
                    out.append(TokenLogprob(t, lp, tuple(zip(ids, lps, strict=True))))
            results[i] = out
        return results
