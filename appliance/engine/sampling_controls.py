"""The per-request controls that change a batch's logits before a token is picked: min_tokens,
logit_bias and the repetition, frequency and presence penalties.

They follow vLLM's v1 sampler (`vllm/v1/sample/sampler.py`, `vllm/model_executor/layers/utils.py`
`apply_penalties`), in its order: min_tokens masks the stop tokens, logit_bias adds, then the
repetition penalty scales, then the frequency and presence penalties subtract. Every control is
one batched tensor operation over the rows that use it, never a loop over requests on the device;
a batch where no request uses a control costs a look at each request's parameters on the host,
and nothing on the device. None of this runs inside a CUDA graph (those end at the hidden
states), and nothing here waits for the device.

Token counts live on the device from step to step while the batch's penalized sequences stay
the same, taking each step's sampled tokens there (one `index_put_`). When that set changes, or
a sequence's output is not what was counted, they are rebuilt from the sequences' token ids: one
padded tensor of the penalized rows' tokens, sent once and counted with one `scatter_add_`
(vLLM's `get_token_bin_counts_and_mask`), host work that grows with those sequences' length.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import numpy as np
import torch

from appliance.engine.sampling import SAMPLING_CHUNK_LOGITS
from appliance.engine.sequence import Sequence as EngineSequence

ToDevice = Callable[[list[int] | list[float] | np.ndarray, torch.dtype], torch.Tensor]
"""Copies host values to the batch's device without waiting (the model runner's)."""


class SamplingControls:
    """The controls of one batch's sampling rows, as device tensors; `None` from `build` when no
    row uses one. `apply` adjusts a step's logits (out of place: the raw logits stay for the
    log-probabilities); `record` counts the tokens sampled from them, so that the next step's
    `build` (or the next step of a burst) can carry the counts on."""

    def __init__(
        self,
        min_tokens: _MinTokens | None,
        logit_bias: _LogitBias | None,
        penalties: _Penalties | None,
    ):
        self._min_tokens = min_tokens
        self._logit_bias = logit_bias
        self._penalties = penalties

    @classmethod
    def build(
        cls,
        seqs: Sequence[EngineSequence],
        eos_token_ids: Collection[int],
        vocab_size: int,
        to_device: ToDevice,
        previous: SamplingControls | None = None,
    ) -> SamplingControls | None:
        """Controls for sampling the next token of each of `seqs` (row i is `seqs[i]`); the
        token counts of `previous` (the last step's, given up to this one) are carried on when
        they still count exactly these sequences' outputs."""
        min_tokens = _MinTokens.build(seqs, eos_token_ids, to_device)
        logit_bias = _LogitBias.build(seqs, to_device)
        carried = previous._penalties if previous is not None else None
        penalties = _Penalties.build(seqs, vocab_size, to_device, carried)
        if min_tokens is None and logit_bias is None and penalties is None:
            return None
        return cls(min_tokens, logit_bias, penalties)

    @staticmethod
    def adjusts(seq: EngineSequence) -> bool:
        """Whether any control may change `seq`'s next logits (so `build` over it could give
        controls): min_tokens not yet reached, a logit bias or a penalty."""
        params = seq.params
        return (
            params.min_tokens > seq.num_scheduled_output_tokens
            or bool(params.logit_bias)
            or params.penalizes
        )

    def apply(self, logits: torch.Tensor, step: int = 0) -> torch.Tensor:
        """logits: [N, V] -> adjusted [N, V], for the token sampled `step` steps after `build`:
        one copy of the logits ([N, V] float32), every control then changing it in place."""
        adjusted = logits.clone()
        if self._min_tokens is not None:
            self._min_tokens.apply_(adjusted, step)
        if self._logit_bias is not None:
            self._logit_bias.apply_(adjusted)
        if self._penalties is not None:
            self._penalties.apply_(adjusted)
        return adjusted

    def record(self, token_ids: torch.Tensor) -> None:
        """Count the tokens just sampled (token_ids: [N]) into the penalized rows' counts."""
        if self._penalties is not None:
            self._penalties.record(token_ids)


class _MinTokens:
    """Forbids each row's stop tokens (its stop_token_ids, and EOS unless it ignores EOS) while
    it has produced fewer than min_tokens tokens."""

    def __init__(self, rows: torch.Tensor, token_ids: torch.Tensor, num_steps: torch.Tensor):
        self.rows = rows  # [M]: one entry per (row, stop token) still forbidden
        self.token_ids = token_ids  # [M]
        self.num_steps = num_steps  # [M]: for how many more steps it stays forbidden

    @classmethod
    def build(
        cls, seqs: Sequence[EngineSequence], eos_token_ids: Collection[int], to_device: ToDevice
    ) -> _MinTokens | None:
        rows: list[int] = []
        token_ids: list[int] = []
        num_steps: list[int] = []
        for row, seq in enumerate(seqs):
            params = seq.params
            remaining = params.min_tokens - seq.num_scheduled_output_tokens
            if remaining <= 0:
                continue
            stops = set(params.stop_token_ids)
            if not params.ignore_eos:
                stops |= set(eos_token_ids)
            rows.extend([row] * len(stops))
            token_ids.extend(sorted(stops))
            num_steps.extend([remaining] * len(stops))
        if not rows:
            return None
        return cls(*(to_device(v, torch.int64) for v in (rows, token_ids, num_steps)))

    def apply_(self, logits: torch.Tensor, step: int) -> None:
        current = logits[self.rows, self.token_ids]
        masked = torch.where(self.num_steps > step, float("-inf"), current)
        logits.index_put_((self.rows, self.token_ids), masked)


class _LogitBias:
    def __init__(self, rows: torch.Tensor, token_ids: torch.Tensor, biases: torch.Tensor):
        self.rows = rows  # [M]: one entry per (row, biased token)
        self.token_ids = token_ids  # [M]
        self.biases = biases  # [M] float32

    @classmethod
    def build(cls, seqs: Sequence[EngineSequence], to_device: ToDevice) -> _LogitBias | None:
        rows: list[int] = []
        token_ids: list[int] = []
        biases: list[float] = []
        for row, seq in enumerate(seqs):
            for token_id, bias in seq.params.logit_bias:
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
        if not rows:
            return None
        return cls(
            to_device(rows, torch.int64),
            to_device(token_ids, torch.int64),
            to_device(biases, torch.float32),
        )

    def apply_(self, logits: torch.Tensor) -> None:
        # A row's token ids are distinct (SamplingParams checks), so accumulating only adds.
        logits.index_put_(
            (self.rows, self.token_ids), self.biases.to(logits.dtype), accumulate=True
        )


class _Penalties:
    """Repetition, frequency and presence penalties of the rows that set one (vLLM's
    `apply_penalties`): repetition scales the logits of tokens seen in the prompt or the
    output, frequency and presence subtract by the output's counts."""

    def __init__(
        self,
        rows: torch.Tensor,
        repetition: torch.Tensor,
        frequency: torch.Tensor,
        presence: torch.Tensor,
        output_counts: torch.Tensor,
        prompt_mask: torch.Tensor | None,
        seqs: list[EngineSequence],
        num_counted: list[int],
    ):
        self.rows = rows  # [P]: the batch rows that set a penalty
        self.repetition = repetition  # [P, 1] float32
        self.frequency = frequency  # [P, 1] float32
        self.presence = presence  # [P, 1] float32
        self.output_counts = output_counts  # [P, V] float32: occurrences in the output so far
        self.prompt_mask = prompt_mask  # [P, V] bool: in the prompt; None without repetition
        # Whose tokens the counts hold, and how many of each one's output tokens.
        self.seqs = seqs
        self.num_counted = num_counted

    @classmethod
    def build(
        cls,
        seqs: Sequence[EngineSequence],
        vocab_size: int,
        to_device: ToDevice,
        previous: _Penalties | None,
    ) -> _Penalties | None:
        rows = [row for row, seq in enumerate(seqs) if seq.params.penalizes]
        if not rows:
            return None
        penalized = [seqs[row] for row in rows]
        if previous is not None and previous._counts_outputs_of(penalized):
            # The same sequences (so the same parameters): only their rows may have moved.
            return cls(
                to_device(rows, torch.int64),
                previous.repetition,
                previous.frequency,
                previous.presence,
                previous.output_counts,
                previous.prompt_mask,
                previous.seqs,
                previous.num_counted,
            )
        params = [seq.params for seq in penalized]
        repetition = [p.repetition_penalty for p in params]
        outputs = [seq.output_token_ids for seq in penalized]
        prompt_mask = None
        if any(r != 1.0 for r in repetition):
            prompts = [seq.token_ids[: seq.num_prompt_tokens] for seq in penalized]
            prompt_mask = _token_counts(prompts, vocab_size, to_device) > 0
        return cls(
            to_device(rows, torch.int64),
            to_device(repetition, torch.float32)[:, None],
            to_device([p.frequency_penalty for p in params], torch.float32)[:, None],
            to_device([p.presence_penalty for p in params], torch.float32)[:, None],
            _token_counts(outputs, vocab_size, to_device),
            prompt_mask,
            penalized,
            [len(tokens) for tokens in outputs],
        )

    def _counts_outputs_of(self, seqs: list[EngineSequence]) -> bool:
        """Whether the counts are exactly those of `seqs`' outputs: the same sequences, in the
        same order, each with as many output tokens as were counted (a sequence's tokens never
        change once appended, so equal numbers mean equal tokens)."""
        return len(seqs) == len(self.seqs) and all(
            seq is counted and seq.num_output_tokens == num
            for seq, counted, num in zip(seqs, self.seqs, self.num_counted, strict=True)
        )

    def apply_(self, logits: torch.Tensor) -> None:
        # A piece of the penalized rows at a time, as the sampler takes them: each needs about
        # five [rows, V] float32 temporaries.
        num_rows = max(1, SAMPLING_CHUNK_LOGITS // logits.shape[-1])
        for start in range(0, self.rows.shape[0], num_rows):
            self._apply_rows(logits, slice(start, start + num_rows))

    def _apply_rows(self, logits: torch.Tensor, piece: slice) -> None:
        rows, counts = self.rows[piece], self.output_counts[piece]
        sub = logits[rows]  # [p, V], a copy of these penalized rows
        in_output = counts > 0
        if self.prompt_mask is not None:
            seen = self.prompt_mask[piece] | in_output
            repetition = self.repetition[piece]
            # Dividing a positive logit and multiplying a negative one both make the token
            # less likely for a penalty above 1 (CTRL, Keskar et al. 2019, as vLLM applies it).
            scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
            sub = torch.where(seen, scaled, sub)
            del seen, scaled
        sub.sub_(self.frequency[piece] * counts)
        sub.sub_(self.presence[piece] * in_output)
        logits.index_put_((rows,), sub)

    def record(self, token_ids: torch.Tensor) -> None:
        sampled = token_ids[self.rows]
        num_rows = self.rows.shape[0]
        ones = torch.ones(num_rows, dtype=self.output_counts.dtype, device=sampled.device)
        rows = torch.arange(num_rows, device=sampled.device)
        self.output_counts.index_put_((rows, sampled), ones, accumulate=True)
        self.num_counted = [num + 1 for num in self.num_counted]


def _token_counts(
    token_lists: list[list[int]], vocab_size: int, to_device: ToDevice
) -> torch.Tensor:
    """[len(token_lists), vocab_size] float32 counts of each list's tokens (exact: far below
    2**24), ready to scale logits: the lists padded with `vocab_size` (a column dropped after
    counting), one transfer, one `scatter_add_`."""
    width = max((len(tokens) for tokens in token_lists), default=0)
    padded = np.full((len(token_lists), width), vocab_size, dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        padded[row, : len(tokens)] = tokens
    index = to_device(padded, torch.int64)
    counts = torch.zeros(len(token_lists), vocab_size + 1, device=index.device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=index.device))
    return counts[:, :vocab_size]
