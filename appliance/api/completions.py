"""`POST /v1/completions`: plain continuation of one or more prompts (text or token ids), with
`echo` and `logprobs` giving the prompt tokens' log-probabilities (as evaluation harnesses use
it)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from fastapi import APIRouter, Request

from appliance.api.errors import unsupported
from appliance.api.generation import (
    Choice,
    CollectedChoice,
    Generation,
    choice_params,
    cut_off_error,
    verify_stream_options,
)
from appliance.api.logprobs import completion_logprobs
from appliance.api.models import ServedModel
from appliance.api.schemas import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from appliance.api.serving import GENERATION_RESPONSES, Serving
from appliance.api.streaming import CompletionChunkChoice, EventStreamResponse, StreamHead
from appliance.api.structured_outputs import structured_output
from appliance.engine.outputs import RequestOutput, TokenLogprob
from appliance.engine.tokenizer import Tokenizer
from audit.canonical import JsonValue

router = APIRouter()


@router.post("/v1/completions", response_model=CompletionResponse, responses=GENERATION_RESPONSES)
async def create_completion(
    body: CompletionRequest, request: Request, server: Serving
) -> CompletionResponse | EventStreamResponse:
    return await server.serve(request, _CompletionEndpoint(body))


class _CompletionEndpoint:
    path = "/v1/completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"
    prompt_param = "prompt"
    uses_tools = False

    def __init__(self, body: CompletionRequest):
        self.body = body

    def verify_supported(self) -> None:
        _verify_supported(self.body)

    def choices(self, model: ServedModel, tokenizer: Tokenizer, max_model_len: int) -> list[Choice]:
        body = self.body
        prompt_logprobs = body.logprobs if body.echo else None
        prompts = _prompt_token_ids(body.prompt, tokenizer)
        structured = structured_output(body)
        return [
            Choice(
                index,
                prompt_index,
                prompt,
                choice_params(
                    body,
                    index,
                    defaults=model.defaults,
                    max_tokens=body.max_tokens,
                    logprobs=body.logprobs,
                    prompt_logprobs=prompt_logprobs,
                    structured=structured,
                ),
            )
            for prompt_index, prompt in enumerate(prompts)
            for index in range(prompt_index * body.n, (prompt_index + 1) * body.n)
        ]

    def prompt_record(self) -> JsonValue:
        return self.body.prompt

    def output(self, tokenizer: Tokenizer, choices: list[Choice]) -> _CompletionOutput:
        body = self.body
        # The first choice of each prompt holds its token ids (n choices per prompt, in order).
        prompts = [choice.prompt_token_ids for choice in choices[:: body.n]]
        with_logprobs = body.logprobs is not None
        # Only echo and the log-probabilities' text offsets read the prompts' texts: decoding
        # ids the client sent is work on the event loop per request.
        texts = _prompt_texts(body.prompt, prompts, tokenizer) if body.echo or with_logprobs else []
        return _CompletionOutput(
            tokenizer, choices, texts, echo=body.echo, with_logprobs=with_logprobs
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


class _CompletionOutput:
    """Text and log-probabilities of completion choices, streamed or whole. With echo, a
    choice's text starts with its prompt, and its log-probabilities with the prompt's (the first
    prompt token has none)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        choices: list[Choice],
        prompt_texts: list[str],
        *,
        echo: bool,
        with_logprobs: bool,
    ):
        self.tokenizer = tokenizer
        self._by_index = {choice.index: choice for choice in choices}
        self._started: set[int] = set()
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

    def opening(self) -> tuple[()]:
        return ()

    def chunks(self, index: int, out: RequestOutput) -> Iterator[CompletionChunkChoice]:
        """Text chunks, then an empty chunk with the finish reason."""
        if out.finish_reason == "abort":
            raise cut_off_error()
        first = index not in self._started
        self._started.add(index)
        choice = self._by_index[index]
        text, logprobs = self.piece(
            choice, out.text, out.logprobs or (), out.prompt_logprobs, first=first
        )
        if text or logprobs:
            yield CompletionChunkChoice(index, text, logprobs)
        if out.finished:
            yield CompletionChunkChoice(index, "", finish_reason=out.finish_reason)

    def response(
        self, head: StreamHead, generation: Generation, results: list[CollectedChoice]
    ) -> CompletionResponse:
        return CompletionResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=[
                self._choice(choice, result)
                for choice, result in zip(generation.choices, results, strict=True)
            ],
            usage=generation.usage(),
        )

    def _choice(self, choice: Choice, result: CollectedChoice) -> CompletionChoice:
        text, logprobs = self.piece(
            choice, result.text, result.logprobs, result.prompt_logprobs, first=True
        )
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=CompletionLogprobs(**logprobs) if logprobs is not None else None,
            finish_reason=result.finish_reason,
        )
