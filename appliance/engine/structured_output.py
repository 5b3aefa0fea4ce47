"""Structured outputs: grammars compiled against the model's tokenizer, one matcher per request,
and each step's token bitmask applied to the batch's logits on the device.

The grammar engine is llguidance (chosen by measurement against xgrammar, docs/BENCHMARKS.md,
"Grammar engines"): it needs nothing but its own wheel at run time, bounds the work of every
grammar (`_LIMITS`), and its masks for a batch are computed by Rust threads without the GIL.

A request's `StructuredOutput` is compiled when the request is taken (`GrammarCompiler.grammar`),
so a bad schema is a 400 before anything runs. Compiled matchers are kept in an LRU cache keyed
by the `StructuredOutput`; a request gets a deep copy of the cached one, which carries the lexer
states its predecessors built (a copy and its first mask take ~0.05 ms where compiling takes
1-10 ms). Each step, the model runner launches the forward pass first and computes the masks of
the constrained rows on the host while the GPU runs (`TokenMasks.fill`), then copies them over
and masks the logits (`TokenMasks.apply`); the sampled token is fed back to the request's
matcher as the engine appends it (`Grammar.accept`). Preemption needs nothing: the matcher's
state follows the tokens, which recomputation keeps.
"""

from __future__ import annotations

import bisect
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import llguidance
import torch

from appliance.engine.errors import InvalidRequestError
from appliance.engine.outputs import GRAMMAR_COMPILE_BUCKETS
from appliance.engine.sampling_params import StructuredOutput

# llguidance's resource limits, per grammar. Its defaults except the lexer's states, each
# 1-2 kB: 250,000 could let one request hold 0.5 GB of host memory. The fuel limits bound the
# host time of one mask (~15 ms) whatever the grammar.
_LIMITS = dict(max_lexer_states=50_000)
# JSON is written compactly with the usual separators (`{"a": 1, "b": [2, 3]}`): free
# whitespace lets a small model fill its whole budget with newlines (vLLM's
# `disable_any_whitespace` exists for that reason).
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_CACHE_SIZE = 256


@dataclass(frozen=True, slots=True)
class CompileTimes:
    """How long grammar compilations took: cumulative counts per bucket of GRAMMAR_COMPILE_BUCKETS
    (the last count, for +inf, is all of them) and their sum in seconds."""

    counts: tuple[int, ...]
    sum_s: float


class Grammar:
    """One request's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False if the grammar does not allow it (a token the
        mask excluded: never, unless the mask and the sampler disagree)."""
        return self.matcher.consume_token(token_id)


class GrammarCompiler:
    """Compiles `StructuredOutput`s against one tokenizer; thread-safe (requests are prepared
    on the server's threads). The tokenizer's llguidance form (~0.3 s to build) is made on the
    first structured request, not at start-up."""

    def __init__(
        self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: Collection[int]
    ):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        # The token a complete grammar allows (any of the model's EOS ids ends the request;
        # llguidance 1.6, the newest with wheels for the bundle's glibc 2.28 baseline, takes
        # one).
        self._eos_token_id = min(eos_token_ids, default=0)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._counts = [0] * (len(GRAMMAR_COMPILE_BUCKETS) + 1)
        self._sum_s = 0.0

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for `spec`, from the cache when it was compiled before. Raises
        InvalidRequestError naming what is wrong with the specification."""
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return Grammar(cached.deep_copy())
            tokenizer = self._llg_tokenizer()
        started = time.perf_counter()
        matcher = llguidance.LLMatcher(
            tokenizer, _grammar_text(spec), log_level=0, limits=llguidance.LLParserLimits(**_LIMITS)
        )
        if matcher.is_error():
            raise InvalidRequestError(
                f"the {_NAMES[spec.kind]} cannot be compiled: {_reason(matcher.get_error())}",
                param=spec.param,
            )
        elapsed = time.perf_counter() - started
        with self._lock:
            self._cache[spec] = matcher
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
            for i in range(bisect.bisect_left(GRAMMAR_COMPILE_BUCKETS, elapsed), len(self._counts)):
                self._counts[i] += 1
            self._sum_s += elapsed
        return Grammar(matcher.deep_copy())

    def compile_times(self) -> CompileTimes:
        with self._lock:
            return CompileTimes(tuple(self._counts), self._sum_s)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos_token_id
            )
        return self._tokenizer


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "list of choices",
    "grammar": "grammar",
}


def _grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for `spec`. Raises InvalidRequestError for a malformed one."""
    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_JSON_OPTIONS
            )
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.spec, defaults=_JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.spec)
        if spec.kind == "choice":
            # Lark's string literals are JSON's, so each choice is matched exactly.
            choices = json.loads(spec.spec)
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices)
            )
        return llguidance.grammar_from("grammar", spec.spec)
    except ValueError as exc:
        raise InvalidRequestError(
            f"the {_NAMES[spec.kind]} cannot be compiled: {_reason(str(exc))}",
            param=spec.param,
        ) from None


def _reason(message: str) -> str:
    """llguidance's multi-line error (message, quoted source, caret line, cause) on one line,
    bounded: it goes back to the caller as a 400's message."""
    lines = [line.strip() for line in message.splitlines()]
    kept = [line for line in lines if line and set(line) != {"^"}]
    return " ".join(kept)[:500] or "no reason given"


class TokenMasks:
    """The allowed tokens of a step's constrained rows, computed on the host and applied to
    the logits on the device. One per step; `fill` may run while the GPU computes the step."""

    _executor: llguidance.LLExecutor | None = None

    def __init__(self, rows: list[int], grammars: list[Grammar], vocab_size: int):
        self.rows = rows  # rows of the step's logits that are constrained
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.bitmask = torch.empty(
            (len(rows), -(-vocab_size // 32)),
            dtype=torch.int32,
            pin_memory=torch.cuda.is_available(),
        )

    @classmethod
    def for_rows(cls, grammars: Sequence[Grammar | None], vocab_size: int) -> TokenMasks | None:
        """Masks for the rows whose grammar is not None; None when there are none."""
        rows = [i for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        return cls(rows, [g for g in grammars if g is not None], vocab_size)

    def fill(self) -> None:
        """Compute every row's mask (bit t of word t // 32 set: token t allowed), on llguidance's
        threads for a batch, without the GIL."""
        if TokenMasks._executor is None:
            TokenMasks._executor = llguidance.LLExecutor()
        matchers = [(g.matcher, i) for i, g in enumerate(self.grammars)]
        TokenMasks._executor.unsafe_compute_mask_ptr(
            matchers, self.bitmask.data_ptr(), self.bitmask.shape[1] * 4, len(matchers)
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [N, V] -> [N, V] with every token the grammar forbids at -inf (out of place:
        the raw logits stay for the log-probabilities). Waits for nothing: the bitmask goes
        over from pinned memory behind the step's work."""
        device, vocab = logits.device, logits.shape[-1]
        words = self.bitmask.to(device, non_blocking=True)  # [R, ceil(V / 32)] int32
        bits = torch.arange(32, device=device, dtype=torch.int32)
        allowed = ((words[:, :, None] >> bits) & 1).flatten(1)[:, :vocab].bool()  # [R, V]
        rows = torch.tensor(self.rows).to(device, non_blocking=True)
        constrained = logits[rows].masked_fill(~allowed, float("-inf"))
        return logits.index_copy(0, rows, constrained)
