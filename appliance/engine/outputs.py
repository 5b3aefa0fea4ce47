"""What a request emits: text deltas, tokens, log-probabilities, and when and why it stops.

Stop strings are found in the detokenized text, across token boundaries. Text that could still
turn out to be the start of a stop string is held back (at most the longest stop string less one
character), so a stream never shows text that the final output does not contain.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from appliance.engine.detokenizer import Detokenizer
from appliance.engine.sequence import RequestId, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
"""Bounds of the grammar compile-time histogram, in seconds (Prometheus `le` bounds)."""


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot of the engine's load and cache counters (for metrics). Counters only grow."""

    num_running: int
    num_waiting: int
    # Fraction of KV blocks referenced by a request, 0 to 1: of the full group's pool when the
    # model's windowed layers have one of their own (appliance.engine.kv_cache), whose usage
    # is then `window_kv_cache_usage` (None: one pool).
    kv_cache_usage: float
    num_preemptions: int
    # Prompt tokens looked up in the prefix cache at admission, and those found there.
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    # Structured outputs' grammar compilations: cumulative counts per bucket of
    # GRAMMAR_COMPILE_BUCKETS (the last, +inf, counts them all) and their total seconds.
    grammar_compile_counts: tuple[int, ...] = ()
    grammar_compile_seconds: float = 0.0
    # A hybrid model's recurrent-state slots held by a sequence, 0 to 1 (None: no such model).
    recurrent_state_usage: float | None = None
    window_kv_cache_usage: float | None = None
    # CUDA graphs the engine has yet to capture while idle (EngineConfig.capture_graphs_when_idle).
    num_pending_graphs: int = 0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's log-probability and the `top` most likely alternatives at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class RequestTimes:
    """Where a finished request's time went in the engine, in seconds (vLLM's request phases):
    `queued_s` from its submission to the engine to its first scheduling (to its end, if it was
    never scheduled), `prefill_s` from then to its first token, `decode_s` from its first token
    to its end; None for a phase the request never reached."""

    queued_s: float
    prefill_s: float | None
    decode_s: float | None


@dataclass(slots=True)
class RequestOutput:
    """One update of a request; the deltas of all its updates add up to the whole output.
    Never changed once made (not frozen only because a frozen dataclass's constructor sets
    each field through `object.__setattr__`, 4x the cost, and the engine makes one per running
    request per step)."""

    request_id: RequestId
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    # On the first update only, when asked for: one entry per prompt token (the first is None).
    prompt_logprobs: list[TokenLogprob | None] | None
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    stop_reason: str | int | None  # the stop string or stop token id that ended it, if any
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    times: RequestTimes | None = None  # on the finished output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This update and the `later` one of the same request as one update."""
        logprobs = None
        if self.logprobs is not None or later.logprobs is not None:
            logprobs = [*(self.logprobs or ()), *(later.logprobs or ())]
        # Built directly: dataclasses.replace inspects the fields on every call, and a stream
        # that fell behind merges one output per token it missed.
        return RequestOutput(
            request_id=later.request_id,
            text=self.text + later.text,
            token_ids=self.token_ids + later.token_ids,
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs
            if self.prompt_logprobs is not None
            else later.prompt_logprobs,
            finish_reason=later.finish_reason,
            stop_reason=later.stop_reason,
            num_prompt_tokens=later.num_prompt_tokens,
            num_output_tokens=later.num_output_tokens,
            num_cached_tokens=later.num_cached_tokens,
            times=later.times,
        )


@dataclass
class RequestState:
    """The output side of one request: detokenizer, stop checks, what is not yet emitted."""

    seq: Sequence
    # None for an engine without a tokenizer: token ids only, no text and no stop strings.
    detokenizer: Detokenizer | None
    eos_token_ids: frozenset[int]
    max_model_len: int
    # The text not yet emitted (emitted text is final, so only this tail is searched for stop
    # strings and kept: the work per token does not grow with the output).
    unemitted: str = ""
    pending_token_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False
    # time.monotonic at the request's first token.
    first_token_s: float | None = None
    stop_reason: str | int | None = None
    _holdback: int = field(init=False)
    # Whether a token can end the request by itself: a grammar, stop tokens or EOS (most
    # requests of a benchmark have none, and add_tokens skips those checks for them).
    _stops_on_token: bool = field(init=False)
    # The sequence's length (prompt included) at which max_tokens or the context ends it.
    _max_len: int = field(init=False)

    def __post_init__(self) -> None:
        seq, params = self.seq, self.seq.params
        # Text that could still begin a stop string is held back: the longest one less a char.
        self._holdback = max((len(s) for s in params.stop), default=1) - 1
        self._stops_on_token = bool(
            seq.grammar is not None
            or params.stop_token_ids
            or (not params.ignore_eos and self.eos_token_ids)
        )
        self._max_len = min(seq.num_prompt_tokens + params.max_tokens, self.max_model_len)
        if seq.wants_prompt_logprobs:
            self.prompt_logprobs = [None]

    def add_prompt_logprobs(self, logprobs: list[TokenLogprob], first_position: int) -> None:
        """Record prompt log-probabilities predicted from `first_position` on (a recompute after
        preemption repeats positions already recorded; those are ignored)."""
        assert self.prompt_logprobs is not None
        skip = len(self.prompt_logprobs) - 1 - first_position
        self.prompt_logprobs.extend(logprobs[max(skip, 0) :])

    def add_tokens(
        self, token_ids: list[int], logprob: TokenLogprob | None
    ) -> SequenceStatus | None:
        """Append a step's sampled tokens in order, up to the one that finishes the request
        (those after it are dropped); returns the finished status if the request is now done.
        Runs for every token the engine makes: what does not change per token is looked up
        once per call."""
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        seq_token_ids = self.seq.token_ids
        pending_token_ids = self.pending_token_ids
        detokenizer = self.detokenizer
        stop = self.seq.params.stop
        for token_id in token_ids:
            seq_token_ids.append(token_id)
            pending_token_ids.append(token_id)
            if logprob is not None:
                self.pending_logprobs.append(logprob)
            if self._stops_on_token:
                finish = self._stop_token(token_id)
                if finish is not None:
                    return finish
            if detokenizer is not None:  # stop strings, like all text, need one
                start = len(self.unemitted) - self._holdback
                self.unemitted += detokenizer.add(token_id)
                # As in vLLM, no stop string ends a request before it has more than min_tokens
                # tokens (the sampler holds stop tokens back until then).
                if (
                    stop
                    and self.seq.num_output_tokens > self.seq.params.min_tokens
                    and self._find_stop_string(max(start, 0))
                ):
                    return SequenceStatus.FINISHED_STOPPED
            if len(seq_token_ids) >= self._max_len:
                return self._finish(SequenceStatus.FINISHED_LENGTH)
        return None

    def _stop_token(self, token_id: int) -> SequenceStatus | None:
        """The finish that `token_id` makes by itself: a token the grammar refuses, a stop
        token or EOS."""
        seq, params = self.seq, self.seq.params
        if seq.grammar is not None and not seq.grammar.accept(token_id):
            # The sampler allowed only what the grammar allows: a refused token means the two
            # disagree, and the output could no longer be trusted to match. Cut it off.
            logger.error("request %s sampled a token its grammar refuses", seq.request_id)
            return self._finish(SequenceStatus.FINISHED_ABORTED)
        if token_id in params.stop_token_ids:
            self.stop_reason = token_id
            return self._finish(SequenceStatus.FINISHED_STOPPED)
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return self._finish(SequenceStatus.FINISHED_STOPPED)
        return None

    def _find_stop_string(self, start: int) -> bool:
        """Truncate the text at the earliest stop string found at or after `start` (an index
        into the unemitted text)."""
        text = self.unemitted
        found = [(i, s) for s in self.seq.params.stop if (i := text.find(s, start)) != -1]
        if not found:
            return False
        index, stop = min(found)
        keep = index + len(stop) if self.seq.params.include_stop_str_in_output else index
        self.unemitted = text[:keep]
        self.stop_reason = stop
        return True

    def _finish(self, status: SequenceStatus) -> SequenceStatus:
        if self.detokenizer is not None:
            self.unemitted += self.detokenizer.flush()
        return status

    def make_output(self, finish: SequenceStatus | None) -> RequestOutput:
        """Everything new since the previous output; all remaining text once finished."""
        text = self.unemitted
        if finish is None and self._holdback:
            emit = max(len(text) - self._holdback, 0)
            delta, self.unemitted = text[:emit], text[emit:]
        else:
            delta, self.unemitted = text, ""
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs = self.prompt_logprobs
            self.prompt_logprobs_sent = True
        token_ids, self.pending_token_ids = self.pending_token_ids, []
        seq = self.seq
        logprobs = None
        if seq.params.logprobs is not None:
            logprobs, self.pending_logprobs = self.pending_logprobs, []
        return RequestOutput(
            request_id=seq.request_id,
            text=delta,
            token_ids=token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            finish_reason=finish.value if finish is not None else None,
            stop_reason=self.stop_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=seq.num_output_tokens,
            num_cached_tokens=seq.num_cached_tokens,
            times=None if finish is None else self._times(),
        )

    def _times(self) -> RequestTimes:
        """The phases of a request ending now."""
        now = time.monotonic()
        queued_s, scheduled_s = self.seq.queued_at_s, self.seq.first_scheduled_s
        if scheduled_s is None:
            return RequestTimes(now - queued_s, None, None)
        if self.first_token_s is None:
            return RequestTimes(scheduled_s - queued_s, None, None)
        return RequestTimes(
            scheduled_s - queued_s, self.first_token_s - scheduled_s, now - self.first_token_s
        )
