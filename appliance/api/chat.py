"""`POST /v1/chat/completions`: a conversation in the model's chat template, answered whole or
streamed as OpenAI streams it."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request

from appliance.api.admission import AdmissionControl
from appliance.api.audit_trail import Trail, sampling_record
from appliance.api.cache_domains import PrefixCacheDomain
from appliance.api.errors import ERROR_RESPONSES, APIError, api_error_for, unsupported
from appliance.api.generation import (
    Choice,
    Generation,
    choice_params,
    cut_off_error,
    require_tokenizer,
    verify_stream_options,
)
from appliance.api.limits import Limits
from appliance.api.logprobs import chat_logprobs
from appliance.api.metrics import Metrics
from appliance.api.models import Model
from appliance.api.readiness import ReadyEngine
from appliance.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)
from appliance.api.serving import AdmittedRequest
from appliance.api.streaming import DONE, ChunkWriter, EventStreamResponse, event
from appliance.engine.errors import EngineError
from appliance.engine.tokenizer import Tokenizer

router = APIRouter()


@router.post(
    "/v1/chat/completions",
    response_model=ChatCompletionResponse,
    responses={
        200: {"content": {"text/event-stream": {}}, "description": "with stream: true"},
        **ERROR_RESPONSES,
    },
)
async def create_chat_completion(
    body: ChatCompletionRequest,
    request: Request,
    engine: ReadyEngine,
    model: Model,
    admission: AdmissionControl,
    limits: Limits,
    metrics: Metrics,
    audit: Trail,
    cache: PrefixCacheDomain,
) -> ChatCompletionResponse | EventStreamResponse:
    arrival_s = time.monotonic()
    model.verify(body.model)
    _verify_supported(body)
    tokenizer = require_tokenizer(engine)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    try:
        prompt = tokenizer.encode_chat([_template_message(m) for m in body.messages])
        # Unset: up to the end of the context, as OpenAI does.
        max_tokens = body.max_completion_tokens or body.max_tokens
        max_tokens = max_tokens or max(engine.engine.max_model_len - len(prompt), 1)
        choices = [
            Choice(i, 0, prompt, choice_params(body, i, max_tokens=max_tokens, logprobs=logprobs))
            for i in range(body.n)
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
        raise api_error_for(exc, prompt_param="messages") from exc
    admitted = await AdmittedRequest.admit(
        request,
        generation,
        limits,
        admission,
        audit,
        request_id=response_id,
        endpoint="/v1/chat/completions",
        prompt=[message.model_dump(exclude_none=True) for message in body.messages],
        sampling=sampling_record(choices[0].params, n=body.n, stream=body.stream),
        arrival_s=arrival_s,
    )
    head = {
        "id": response_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model.card.id,
        "system_fingerprint": None,
    }
    if body.stream:
        include_usage = body.stream_options is not None and body.stream_options.include_usage
        writer = ChunkWriter(head, include_usage=include_usage)
        return admitted.stream(_events(generation, writer, tokenizer, with_logprobs=body.logprobs))
    results = await admitted.collect()
    return ChatCompletionResponse(
        id=response_id,
        created=head["created"],
        model=model.card.id,
        choices=[
            ChatChoice(
                index=choice.index,
                message=AssistantMessage(content=result.text),
                logprobs=ChatChoiceLogprobs(content=chat_logprobs(tokenizer, result.logprobs))
                if body.logprobs
                else None,
                finish_reason=result.finish_reason,
            )
            for choice, result in zip(generation.choices, results, strict=True)
        ],
        usage=generation.usage(),
    )


def _verify_supported(body: ChatCompletionRequest) -> None:
    verify_stream_options(body)
    if body.response_format is not None and body.response_format.type != "text":
        raise unsupported(
            "response_format",
            f"{body.response_format.type!r} needs constrained decoding, which this server does "
            "not do; ask for JSON in the prompt and validate the reply",
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


async def _events(
    generation: Generation, writer: ChunkWriter, tokenizer: Tokenizer, *, with_logprobs: bool
) -> AsyncGenerator[bytes, None]:
    """OpenAI's chunk sequence per choice: the role with empty content, the content deltas, an
    empty delta with the finish reason; then the usage (if asked for) and [DONE]. An error after
    the status was sent becomes an error event."""
    for choice in generation.choices:
        opening = {"role": "assistant", "content": "", "refusal": None}
        yield writer.chunk(
            {"index": choice.index, "delta": opening, "logprobs": None, "finish_reason": None}
        )
    try:
        async for index, out in generation.outputs():
            logprobs = None
            if with_logprobs and out.logprobs:
                logprobs = {"content": chat_logprobs(tokenizer, out.logprobs)}
            if out.text or logprobs:
                delta = {"content": out.text}
                yield writer.chunk(
                    {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}
                )
            if out.finish_reason == "abort":
                raise cut_off_error()
            if out.finished:
                yield writer.chunk(
                    {
                        "index": index,
                        "delta": {},
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
