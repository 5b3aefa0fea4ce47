"""Running one API request on the engine: its choices (n per prompt) as concurrent engine
requests, their outputs merged in arrival order, their latencies recorded.

Every engine request is validated before any is submitted, so a bad request is refused with a
status code before a response starts. Closing the merged stream (a client that disconnects)
aborts every engine request still running and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from appliance.api.errors import APIError
from appliance.api.metrics import ServerMetrics
from appliance.api.schemas import PromptTokensDetails, SamplingFields, Usage
from appliance.engine.async_engine import AsyncEngine
from appliance.engine.generation_config import SamplingDefaults
from appliance.engine.outputs import RequestOutput, TokenLogprob
from appliance.engine.sampling_params import SamplingParams, StructuredOutput
from appliance.engine.tokenizer import Tokenizer

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Choice:
    """One engine request of an API request: choice `index` samples prompt `prompt_index`."""

    index: int
    prompt_index: int
    prompt_token_ids: list[int]
    params: SamplingParams


def choice_params(
    body: SamplingFields,
    index: int,
    *,
    defaults: SamplingDefaults,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
    structured: StructuredOutput | None = None,
    format_stop_token_ids: tuple[int, ...] = (),
    skip_special_tokens: bool = True,
) -> SamplingParams:
    """The engine's sampling parameters for choice `index` of a request; a sampling field the
    request leaves out takes the model's `defaults`. With a seed, choice i uses seed + i, so
    the choices differ from each other and each is reproducible. `format_stop_token_ids` end
    the output besides the request's own (the harmony format's end of an action);
    `skip_special_tokens` False keeps them in the text, for a parser whose markers are special
    tokens (Gemma 4's)."""
    seed = None if body.seed is None else (body.seed + index) % 2**63
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        **sampling_in_force(
            defaults,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
        ),
        seed=seed,
        stop=stop,
        stop_token_ids=(*(body.stop_token_ids or ()), *format_stop_token_ids),
        ignore_eos=body.ignore_eos,
        min_tokens=body.min_tokens,
        logit_bias=tuple(
            (int(token_id), bias) for token_id, bias in (body.logit_bias or {}).items()
        ),
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        skip_special_tokens=skip_special_tokens,
    )


def default_max_tokens(room: int, defaults: SamplingDefaults) -> int:
    """The output length of a request that gives none: the `room` left in the context (as
    OpenAI has it), at most the model's `max_new_tokens` (as vLLM has it)."""
    room = max(room, 1)
    return room if defaults.max_tokens is None else min(room, defaults.max_tokens)


def sampling_in_force(
    defaults: SamplingDefaults,
    *,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
) -> dict[str, Any]:
    """The sampling fields of SamplingParams: each the request's value, or when it leaves the
    field out (None) the model's default, else the API's own (1, 1, 0 for off, 0, 1)."""
    return {
        "temperature": _or_default(temperature, defaults.temperature, 1.0),
        "top_p": _or_default(top_p, defaults.top_p, 1.0),
        "top_k": _or_default(top_k, defaults.top_k, 0),
        "min_p": _or_default(min_p, defaults.min_p, 0.0),
        "repetition_penalty": _or_default(repetition_penalty, defaults.repetition_penalty, 1.0),
    }


def _or_default(requested: T | None, model_default: T | None, fallback: T) -> T:
    if requested is not None:
        return requested
    return fallback if model_default is None else model_default


def require_tokenizer(engine: AsyncEngine) -> Tokenizer:
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise APIError(400, "this model is served without a tokenizer: text cannot be handled")
    return tokenizer


def verify_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(
            400, "stream_options is only allowed when stream is true", param="stream_options"
        )


def cut_off_error() -> APIError:
    """For a request the engine aborted on its own: only a shutdown does that."""
    return APIError(
        503, "the request was cut off: the server is shutting down; retry", type="server_error"
    )


@dataclass(slots=True)
class CollectedChoice:
    """Everything one choice produced, for a response that is not streamed."""

    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # One entry per prompt token (the first None), when prompt log-probabilities were asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


class Generation:
    """The engine requests of one API request. Build it (which validates every choice), then
    iterate `outputs()` once."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: ServerMetrics,
        request_id: str,
        choices: list[Choice],
        *,
        arrival_s: float,
        cache_salt: str,
    ):
        self.choices = choices
        self._metrics = metrics
        self._arrival_s = arrival_s
        # Validates each choice; raises InvalidRequestError before anything is submitted.
        self._streams = [
            engine.generate(
                f"{request_id}-{c.index}", c.prompt_token_ids, c.params, cache_salt=cache_salt
            )
            for c in choices
        ]
        self.last_outputs: dict[int, RequestOutput] = {}
        # What each choice has generated so far, for the audit log's response commitment.
        self._text_parts: dict[int, list[str]] = {c.index: [] for c in choices}
        # The error that ended the outputs early, if one did (the audit log records its class).
        self.error: Exception | None = None

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) in the order the engine produces them."""
        timed = [self._timed(c, s) for c, s in zip(self.choices, self._streams, strict=True)]
        merged = timed[0] if len(timed) == 1 else _merge(timed)
        async with aclosing(merged) as items:
            try:
                async for index, out in items:
                    self.last_outputs[index] = out
                    self._text_parts[index].append(out.text)
                    yield index, out
            except Exception as exc:
                self.error = exc
                raise

    async def collect(self) -> list[CollectedChoice]:
        """Run every choice to its end; the results in choice order. Raises 503 for a choice cut
        off by a shutdown."""
        collected = {choice.index: CollectedChoice() for choice in self.choices}
        async for index, out in self.outputs():
            result = collected[index]
            result.text_parts.append(out.text)
            result.token_ids.extend(out.token_ids)
            if out.logprobs:
                result.logprobs.extend(out.logprobs)
            if out.prompt_logprobs is not None:
                result.prompt_logprobs = out.prompt_logprobs
            result.finish_reason = out.finish_reason
        if any(result.finish_reason == "abort" for result in collected.values()):
            raise cut_off_error()
        return [collected[choice.index] for choice in self.choices]

    def texts(self) -> list[str]:
        """Each choice's generated text so far, in choice order."""
        return ["".join(self._text_parts[choice.index]) for choice in self.choices]

    def finish_reasons(self) -> list[str | None]:
        """Each choice's finish reason, in choice order; None while it runs."""
        outputs = [self.last_outputs.get(choice.index) for choice in self.choices]
        return [None if out is None else out.finish_reason for out in outputs]

    def usage(self) -> Usage:
        """Token counts so far; each prompt counts once however many choices sample it."""
        num_prompt = num_cached = 0
        counted: set[int] = set()
        for choice in self.choices:
            if choice.prompt_index in counted:
                continue
            counted.add(choice.prompt_index)
            num_prompt += len(choice.prompt_token_ids)
            last = self.last_outputs.get(choice.index)
            num_cached += last.num_cached_tokens if last is not None else 0
        num_completion = sum(out.num_output_tokens for out in self.last_outputs.values())
        return Usage(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
        )

    async def _timed(
        self, choice: Choice, stream: AsyncIterator[RequestOutput]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        first_token_s: float | None = None
        last: RequestOutput | None = None
        try:
            async with aclosing(stream) as outputs:  # type: ignore[type-var]
                async for out in outputs:
                    if first_token_s is None and out.token_ids:
                        first_token_s = time.monotonic()
                    last = out
                    yield choice.index, out
        finally:
            if last is not None:
                self._metrics.observe_request(
                    ttft_s=None if first_token_s is None else first_token_s - self._arrival_s,
                    e2e_s=time.monotonic() - self._arrival_s,
                    num_prompt_tokens=last.num_prompt_tokens,
                    num_output_tokens=last.num_output_tokens,
                    finish_reason=last.finish_reason or "abort",
                    times=last.times,
                )


_DONE = object()


async def _merge(
    streams: list[AsyncIterator[tuple[int, RequestOutput]]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave `streams` as items arrive. Closing the result cancels every stream."""
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[tuple[int, RequestOutput]]) -> None:
        try:
            async with aclosing(stream) as items:  # type: ignore[type-var]
                async for item in items:
                    queue.put_nowait(item)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)
        queue.put_nowait(_DONE)

    tasks = [asyncio.create_task(pump(stream)) for stream in streams]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if item is _DONE:
                num_running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def cancel_on_disconnect(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """Run `work` (a whole non-streamed generation); if the client disconnects first, cancel
    it, which aborts its engine requests, and answer nothing (the 499 of nginx)."""
    task = asyncio.create_task(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # let it abort its engine requests
    if task.cancelled():
        raise APIError(499, "the client closed the connection")
    return task.result()


async def _disconnected(request: Request) -> None:
    """Return when the client has gone (the request body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
