"""Per-request sampling parameters, validated once when a request is submitted."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    `temperature == 0` is greedy decoding. `top_k == 0` and `top_p == 1` and `min_p == 0` disable
    those filters. `logprobs` asks for the log-probability of every generated token plus that many
    alternatives (0: the chosen token only; None: nothing); `prompt_logprobs` does the same for the
    prompt tokens (the first prompt token has none). Log-probabilities are those of the model's
    own distribution, before temperature and filtering, as OpenAI reports them.
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

    def __post_init__(self) -> None:
        self._verify()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _verify(self) -> None:
        def bad(name: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter {name!r}: {why}")

        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0 or self.temperature != self.temperature:
            raise bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise bad("seed", f"must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "every stop string must be a non-empty string")
        if len(self.stop) > 16:
            raise bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "every stop token id must be a non-negative integer")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int) and 0 <= value <= MAX_TOP_LOGPROBS
            ):
                raise bad(name, f"must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}")
