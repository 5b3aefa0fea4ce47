"""`POST /v1/completions`: plain continuation of one or more prompts (text or token ids), with
`echo` and `logprobs` giving the prompt tokens' log-probabilities (as evaluation harnesses use
it)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from fastapi import APIRouter, Request

from appliance.api.admission import AdmissionControl
from appliance.api.audit_trail import Trail, sampling_record
from appliance.api.cache_domains import PrefixCacheDomain
from appliance.api.errors import ERROR_RESPONSES, APIError, api_error_for, unsupported
from appliance.api.generation import (
    Choice,
    CollectedChoice,
    Generation,
    choice_params,
    cut_off_error,
    require_tokenizer,
    verify_stream_options,
)
from appliance.api.limits import Limits
from appliance.api.logprobs import completion_logprobs
from appliance.api.metrics import Metrics
from appliance.api.models import Model
from appliance.api.readiness import ReadyEngine
from appliance.api.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from appliance.api.serving import AdmittedRequest
from appliance.api.streaming import DONE, ChunkWriter, EventStreamResponse, event
from appliance.engine.errors import EngineError
from appliance.engine.model_runner import TokenLogprob
from appliance.engine.tokenizer import Tokenizer

router = APIRouter()


@router.post(
    "/v1/completions",
    response_model=CompletionResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "with stream: true"},
        **ERROR_RESPONSES,
    },
)
async def create_completion(
    body: CompletionRequest,
    request: Request,
    engine: ReadyEngine,
    model: Model,
    admission: AdmissionControl,
    limits: Limits,
    metrics: Metrics,
    audit: Trail,
    cache: PrefixCacheDomain,
) -> CompletionResponse | EventStreamResponse:
    arrival_s = time.monotonic()
    model.verify(body.model)
    _verify_supported(body)
    tokenizer = require_tokenizer(engine)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    prompt_logprobs = body.logprobs if body.echo else None
    try:
        prompts = _prompt_token_ids(body.prompt, tokenizer)
        choices = [
            Choice(
                index,
                prompt_index,
                prompt,
                choice_params(
                    body,
                    index,
                    max_tokens=body.max_tokens,
                    logprobs=body.logprobs,
                    prompt_logprobs=prompt_logprobs,
                ),
            )
            for prompt_index, prompt in enumerate(prompts)
            for index in range(prompt_index * body.n, (prompt_index + 1) * body.n)
        ]
        generation = Generation(
            engine,
            metrics,
            response_id,
            choices,
            arrival_s=arrival_s,
            cache_salt=cache.salt(body.cache_salt),
        )
    except EngineError as exc:
        raise api_error_for(exc, prompt_param="prompt") from exc
    admitted = await AdmittedRequest.admit(
        request,
        generation,
        limits,
        admission,
        audit,
        request_id=response_id,
        endpoint="/v1/completions",
        prompt=body.prompt,
        sampling=sampling_record(choices[0].params, n=body.n, stream=body.stream),
        arrival_s=arrival_s,
    )
    texts = _prompt_texts(body.prompt, prompts, tokenizer)
    output = _Output(tokenizer, texts, echo=body.echo, with_logprobs=body.logprobs is not None)
    head = {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model.card.id,
        "system_fingerprint": None,
    }
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        writer = ChunkWriter(head, include_usage=include_usage)
        return admitted.stream(_events(generation, writer, output))
    results = await admitted.collect()
    return CompletionResponse(
        id=response_id,
        created=head["created"],
        model=model.card.id,
        choices=[
            output.choice(choice, result)
            for choice, result in zip(generation.choices, results, strict=True)
        ],
        usage=generation.usage(),
    )


def _verify_supported(body: CompletionRequest) -> None:
    verify_stream_options(body)
    if body.suffix:
        raise unsupported("suffix", "insertion (fill in the middle) is not supported")
    if body.best_of not in (None, 1):
        raise unsupported("best_of", "only best_of = 1 is supported; use n for several choices")


def _prompt_token_ids(
    prompt: str | list[str] | list[int] | list[list[int]], tokenizer: Tokenizer
) -> list[list[int]]:
    """The token ids of each prompt of the request (a text, texts, ids or lists of ids)."""
    if isinstance(prompt, str) or (prompt and all(isinstance(t, int) for t in prompt)):
        batch: list[str | list[int]] = [prompt]  # type: ignore[list-item]
    else:
        batch = prompt  # type: ignore[assignment]
    return [
        tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        for item in batch
    ]


def _prompt_texts(
    prompt: str | list[str] | list[int] | list[list[int]],
    token_ids: list[list[int]],
    tokenizer: Tokenizer,
) -> list[str]:
    """Each prompt's text, for echo: as given, or decoded from ids (once the engine has
    validated them)."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)  # type: ignore[arg-type]
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in token_ids]


class _Output:
    """Text and log-probabilities of completion choices, streamed or whole. With echo, a
    choice's text starts with its prompt, and its log-probabilities with the prompt's (the first
    prompt token has none)."""

    def __init__(
        self, tokenizer: Tokenizer, prompt_texts: list[str], *, echo: bool, with_logprobs: bool
    ):
        self.tokenizer = tokenizer
        self.prompt_texts = prompt_texts
        self.echo = echo
        self.with_logprobs = with_logprobs
        self._offsets: dict[int, int] = {}

    def piece(
        self,
        choice: Choice,
        text: str,
        logprobs: Sequence[TokenLogprob],
        prompt_logprobs: Sequence[TokenLogprob | None] | None,
        *,
        first: bool,
    ) -> tuple[str, dict[str, Any] | None]:
        """The text and `logprobs` of the next part of a choice's output."""
        if first and self.echo:
            text = self.prompt_texts[choice.prompt_index] + text
        if not self.with_logprobs:
            return text, None
        tokens: list[tuple[int, TokenLogprob | None]] = []
        if first and self.echo:
            assert prompt_logprobs is not None, "echo with logprobs asks for prompt logprobs"
            tokens.extend(zip(choice.prompt_token_ids, prompt_logprobs, strict=True))
        tokens.extend((entry.token_id, entry) for entry in logprobs)
        start = 0 if self.echo else len(self.prompt_texts[choice.prompt_index])
        offset = self._offsets.get(choice.index, start)
        result, self._offsets[choice.index] = completion_logprobs(self.tokenizer, tokens, offset)
        return text, result

    def choice(self, choice: Choice, result: CollectedChoice) -> CompletionChoice:
        text, logprobs = self.piece(
            choice, result.text, result.logprobs, result.prompt_logprobs, first=True
        )
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=CompletionLogprobs(**logprobs) if logprobs is not None else None,
            finish_reason=result.finish_reason,
        )


async def _events(
    generation: Generation, writer: ChunkWriter, output: _Output
) -> AsyncGenerator[bytes, None]:
    """Per choice: text chunks, then an empty chunk with the finish reason; then the usage (if
    asked for) and [DONE]. An error after the status was sent becomes an error event."""
    by_index = {choice.index: choice for choice in generation.choices}
    started: set[int] = set()
    try:
        async for index, out in generation.outputs():
            if out.finish_reason == "abort":
                raise cut_off_error()
            first = index not in started
            started.add(index)
            logprobs = out.logprobs or ()
            choice = by_index[index]
            text, lps = output.piece(choice, out.text, logprobs, out.prompt_logprobs, first=first)
            if text or lps:
                yield writer.chunk(
                    {"index": index, "text": text, "logprobs": lps, "finish_reason": None}
                )
            if out.finished:
                yield writer.chunk(
                    {
                        "index": index,
                        "text": "",
                        "logprobs": None,
                        "finish_reason": out.finish_reason,
                    }
                )
        if writer.include_usage:
            yield writer.usage(generation.usage().model_dump())
    except APIError as exc:
        yield event(exc.body())
    except EngineError as exc:
        yield event(api_error_for(exc).body())
    yield DONE
