"""Per-request sampling parameters, validated once when a request is submitted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from appliance.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS = 300
"""OpenAI's bound on `logit_bias` entries; each bias is in [-100, 100] as there."""
MAX_PENALTY = 2.0
"""OpenAI's bound on `frequency_penalty` and `presence_penalty` (in [-2, 2])."""
MAX_STRUCTURE_CHARS = 65_536
"""The longest JSON schema, regex, grammar or list of choices a request may constrain with."""

StructureKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must match, compiled to a grammar when the request is taken
    (appliance.engine.structured_output): `json_schema` (the schema as JSON text), `json_object`
    (any JSON object; `spec` is empty), `regex`, `choice` (a JSON list of the allowed strings)
    or `grammar` (Lark, or GBNF as llama.cpp writes it). Equal kinds and specifications
    compile to the same grammar, so this is also the grammar cache's key."""

    kind: StructureKind
    spec: str = ""
    # The request field it came from, for errors (not part of the cache key).
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in ("json_schema", "json_object", "regex", "choice", "grammar"):
            raise _bad(self.param, f"unknown kind {self.kind!r}")
        if (self.kind == "json_object") != (not self.spec):
            raise _bad(
                self.param,
                f"{self.kind} needs a specification"
                if not self.spec
                else "json_object takes no specification",
            )
        if len(self.spec) > MAX_STRUCTURE_CHARS:
            raise _bad(
                self.param,
                f"the {self.kind} has {len(self.spec)} characters; at most {MAX_STRUCTURE_CHARS}",
            )


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy decoding. `top_k == 0` and `top_p == 1` and `min_p == 0` disable
    those filters. `logprobs` asks for the log-probability of every generated token plus that many
    alternatives (0: the chosen token only; None: nothing); `prompt_logprobs` does the same for the
    prompt tokens (the first prompt token has none). Log-probabilities are those of the model's
    own distribution, before temperature and filtering, as OpenAI reports them.

    The controls below change the logits before any of that, with vLLM's meanings (its
    `SamplingParams` and `apply_penalties`), in vLLM's order (min_tokens, logit_bias, then the
    penalties): `min_tokens` forbids EOS and `stop_token_ids` until that many tokens are out;
    `logit_bias` adds to the logits of the tokens it names; `repetition_penalty` divides the
    positive logits (multiplies the negative ones) of every token of the prompt or the output;
    `frequency_penalty` subtracts itself once per occurrence of a token in the output, and
    `presence_penalty` once for a token that occurs in it. Log-probabilities stay those of the
    model's own distribution (vLLM's default `logprobs_mode`, "raw_logprobs").

    `structured` constrains every token to keep the output inside a grammar, after the
    controls above and before temperature and the filters; once the grammar is complete only
    EOS is allowed. It ends with EOS, so it cannot be combined with `ignore_eos` or with
    `min_tokens` (which forbids EOS while the grammar may allow nothing else).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    structured: StructuredOutput | None = None

    def __post_init__(self) -> None:
        self._verify()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether a penalty depends on the tokens so far (so the sampler must count them)."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def verify_token_ids(self, vocab_size: int) -> None:
        """The token ids named by `stop_token_ids` and `logit_bias` are in the vocabulary
        (checked when the vocabulary is known, as the engine takes the request)."""
        biased = [t for t, _ in self.logit_bias]
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", biased)):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise _bad(name, f"token id {bad} is outside the vocabulary [0, {vocab_size})")

    def _verify(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise _bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise _bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise _bad("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise _bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", "every stop string must be a non-empty string")
        if len(self.stop) > 16:
            raise _bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", "every stop token id must be a non-negative integer")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise _bad(
                "stop_token_ids",
                f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}",
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise _bad(
                "min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        self._verify_logit_bias()
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise _bad(
                "repetition_penalty",
                f"must be a number > 0 (1 disables it), got {self.repetition_penalty!r}",
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _bad(name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        if self.structured is not None:
            for name in ("ignore_eos", "min_tokens"):
                if getattr(self, name):
                    raise _bad(
                        name,
                        "not available with structured outputs: the output ends with EOS as soon "
                        "as its grammar is complete",
                    )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS
            ):
                raise _bad(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")

    def _verify_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise _bad(
                "logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"
            )
        token_ids = [t for t, _ in self.logit_bias]
        if any(not isinstance(t, int) or t < 0 for t in token_ids):
            raise _bad("logit_bias", "every key must be a non-negative token id")
        if len(set(token_ids)) != len(token_ids):
            raise _bad("logit_bias", "a token id appears more than once")
        for _, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0:
                raise _bad("logit_bias", f"every bias must be in [-100, 100], got {bias!r}")


def _bad(name: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid sampling parameter {name!r}: {why}", param=name)
