"""A stand-in for the network that answers with scripted text, so that the API's tool-call
path can be tested end to end (engine, scheduler, detokenizer, parser, server, client) with a
model output known in advance: the embedded 135M model rarely writes a tool call by itself.

It is honest about what it replaces: only the transformer's arithmetic. Each request's prompt
(a forward pass that starts at position 0) takes the next scripted reply; each sampled
position then gets a one-hot logit row for the reply's next token, then end-of-sequence.
Requests must run one at a time, with prefix caching off (a cached prompt would not start at
position 0).
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from torch import nn

from appliance.engine.models.config import ModelConfig
from appliance.engine.tokenizer import Tokenizer


class ScriptedModel(nn.Module):
    def __init__(self, model_dir: Path, tokenizer: Tokenizer):
        super().__init__()
        self.config = ModelConfig.from_model_dir(model_dir)
        self._tokenizer = tokenizer
        [self._eos] = sorted(tokenizer.eos_token_ids)[:1]
        self._replies: deque[list[int]] = deque()
        self._reply: list[int] = []
        self._starting = False
        self._start = 0

    def say(self, *replies: str) -> None:
        """Answer the next requests with `replies`, in order (then end-of-sequence at once)."""
        self._replies.extend(self._tokenizer.encode(reply) for reply in replies)

    def say_tokens(self, *replies: list[int]) -> None:
        """Answer the next requests with `replies` as token ids (a format whose tokens the
        tokenizer's encoding of their text would not give, such as harmony's)."""
        self._replies.extend(replies)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: object,
        meta: object,
        states: object = (),
        state_meta: object = None,
    ) -> torch.Tensor:
        if int(positions[0]) == 0:
            self._reply = self._replies.popleft() if self._replies else []
            self._starting = True
        return positions.to(torch.float32).unsqueeze(-1)  # each row's "hidden state": [T, 1]

    def compute_logits(self, hidden: torch.Tensor, *, float32: bool = True) -> torch.Tensor:
        """CausalLM's: float32 logits (`float32=False` allows the projection's dtype, which
        here is float32 too)."""
        positions = hidden[:, 0].long().tolist()
        if self._starting:  # the first sampled row is the prompt's last token
            self._start, self._starting = positions[0] + 1, False
        logits = torch.full((len(positions), self.config.vocab_size), -1e9)
        for row, position in enumerate(positions):
            step = position + 1 - self._start
            token = self._reply[step] if step < len(self._reply) else self._eos
            logits[row, token] = 0.0
        return logits
