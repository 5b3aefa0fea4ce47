"""`POST /v1/chat/completions`: a conversation in the model's chat template, answered whole or
streamed as OpenAI streams it."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request

from appliance.api.errors import APIError, unsupported
from appliance.api.generation import (
    Choice,
    CollectedChoice,
    Generation,
    choice_params,
    cut_off_error,
    verify_stream_options,
)
from appliance.api.logprobs import chat_logprobs
from appliance.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)
from appliance.api.serving import GENERATION_RESPONSES, Serving
from appliance.api.streaming import ChatChunkChoice, ChatDelta, EventStreamResponse, StreamHead
from appliance.engine.outputs import RequestOutput
from appliance.engine.tokenizer import Tokenizer
from audit.canonical import JsonValue

router = APIRouter()


@router.post(
    "/v1/chat/completions", response_model=ChatCompletionResponse, responses=GENERATION_RESPONSES
)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, server: Serving
) -> ChatCompletionResponse | EventStreamResponse:
    return await server.serve(request, _ChatEndpoint(body))


class _ChatEndpoint:
    path = "/v1/chat/completions"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"
    prompt_param = "messages"

    def __init__(self, body: ChatCompletionRequest):
        self.body = body

    def verify_supported(self) -> None:
        _verify_supported(self.body)

    def choices(self, tokenizer: Tokenizer, max_model_len: int) -> list[Choice]:
        body = self.body
        prompt = tokenizer.encode_chat([_template_message(m) for m in body.messages])
        # Unset: up to the end of the context, as OpenAI does.
        max_tokens = body.max_completion_tokens or body.max_tokens
        max_tokens = max_tokens or max(max_model_len - len(prompt), 1)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return [
            Choice(i, 0, prompt, choice_params(body, i, max_tokens=max_tokens, logprobs=logprobs))
            for i in range(body.n)
        ]

    def prompt_record(self) -> JsonValue:
        return [message.model_dump(exclude_none=True) for message in self.body.messages]

    def output(self, tokenizer: Tokenizer, choices: list[Choice]) -> _ChatOutput:
        return _ChatOutput(tokenizer, choices, with_logprobs=self.body.logprobs)


def _verify_supported(body: ChatCompletionRequest) -> None:
    verify_stream_options(body)
    if body.response_format is not None and body.response_format.type != "text":
        raise unsupported(
            "response_format",
            f"{body.response_format.type!r} needs constrained decoding, which this server does "
            "not do; ask for JSON in the prompt and validate the reply",
        )
    if body.store:
        raise unsupported(
            "store",
            "this appliance stores no completions (a request leaves only its audit entries, "
            "which hold commitments, not content); send false or leave it out",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def _template_message(message: ChatMessage) -> dict[str, str]:
    if isinstance(message.content, str):
        content = message.content
    else:
        content = "\n".join(part.text for part in message.content)
    # "developer" is the newer name of "system"; chat templates know only the older one.
    role = "system" if message.role == "developer" else message.role
    rendered = {"role": role, "content": content}
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


class _ChatOutput:
    """OpenAI's chunk sequence per choice: the role with empty content, the content deltas, an
    empty delta with the finish reason. Whole, one assistant message per choice."""

    def __init__(self, tokenizer: Tokenizer, choices: list[Choice], *, with_logprobs: bool):
        self.tokenizer = tokenizer
        self.choices = choices
        self.with_logprobs = with_logprobs

    def opening(self) -> Iterator[ChatChunkChoice]:
        for choice in self.choices:
            yield ChatChunkChoice(choice.index, ChatDelta(role="assistant", content=""))

    def chunks(self, index: int, out: RequestOutput) -> Iterator[ChatChunkChoice]:
        logprobs = None
        if self.with_logprobs and out.logprobs:
            logprobs = {"content": chat_logprobs(self.tokenizer, out.logprobs)}
        if out.text or logprobs:
            yield ChatChunkChoice(index, ChatDelta(content=out.text), logprobs)
        if out.finish_reason == "abort":
            raise cut_off_error()
        if out.finished:
            yield ChatChunkChoice(index, ChatDelta(), finish_reason=out.finish_reason)

    def response(
        self, head: StreamHead, generation: Generation, results: list[CollectedChoice]
    ) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=head.id,
            created=head.created,
            model=head.model,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=AssistantMessage(content=result.text),
                    logprobs=ChatChoiceLogprobs(
                        content=chat_logprobs(self.tokenizer, result.logprobs)
                    )
                    if self.with_logprobs
                    else None,
                    finish_reason=result.finish_reason,
                )
                for choice, result in zip(generation.choices, results, strict=True)
            ],
            usage=generation.usage(),
        )
