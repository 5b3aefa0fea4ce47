"""`POST /v1/chat/completions`: a conversation in the model's chat template, answered whole or
streamed as OpenAI streams it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Request

from appliance.api.errors import APIError, unsupported
from appliance.api.generation import (
    Choice,
    CollectedChoice,
    Generation,
    choice_params,
    cut_off_error,
    default_max_tokens,
    verify_stream_options,
)
from appliance.api.harmony import REASONING_EFFORTS, verify_harmony_request
from appliance.api.logprobs import chat_logprobs
from appliance.api.models import ServedModel
from appliance.api.parsed_output import OutputParser, ParsedOutput
from appliance.api.reasoning_parsers import Reasoning, ReasoningParser
from appliance.api.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
    FunctionCallOut,
    ToolCallOut,
)
from appliance.api.serving import GENERATION_RESPONSES, Serving
from appliance.api.streaming import ChatChunkChoice, ChatDelta, EventStreamResponse, StreamHead
from appliance.api.structured_outputs import structured_output
from appliance.api.tool_parsers import Content
from appliance.api.tools import (
    ChoiceCalls,
    IdentifiedCall,
    ToolUse,
    plan_tool_use,
    structure_with_tools,
    template_message,
    verify_tool_messages,
)
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
        self.tool_use: ToolUse | None = None
        self.parser: Callable[[], OutputParser] | None = None  # None: the text as it comes

    @property
    def uses_tools(self) -> bool:
        return self.tool_use is not None

    def verify_supported(self) -> None:
        _verify_supported(self.body)

    def choices(self, model: ServedModel, tokenizer: Tokenizer, max_model_len: int) -> list[Choice]:
        body = self.body
        harmony = model.harmony
        renders_tools = harmony is not None or tokenizer.chat_template_reads_tools
        verify_tool_messages(
            body.messages, renders_tools=renders_tools, model_name=body.model, param="messages"
        )
        if harmony is None:
            if body.reasoning_effort is not None:
                raise unsupported("reasoning_effort", _NO_REASONING_EFFORT)
        else:
            _verify_harmony_request(body)
        conventions = model.conventions(tokenizer)
        self.tool_use = plan_tool_use(
            body.tools,
            body.tool_choice,
            parallel=body.parallel_tool_calls,
            renders_tools=renders_tools,
            model_name=body.model,
            tool_format=conventions.tool_format,
        )
        structured = structure_with_tools(structured_output(body), self.tool_use)
        if self.tool_use is not None and body.logprobs:
            raise unsupported(
                "logprobs",
                "not available with tools: tool-call text is held back and parsed, so its "
                "tokens' log-probabilities would match no content",
            )
        template_kwargs = body.chat_template_kwargs or {}
        stop_token_ids: tuple[int, ...] = ()
        if harmony is None:
            reasoning = conventions.reasoning(template_kwargs, constrained=structured is not None)
            self.parser = _text_parser(self.tool_use, reasoning)
            prompt = tokenizer.encode_chat(
                [template_message(m) for m in body.messages],
                tools=None if self.tool_use is None else self.tool_use.definitions,
                template_kwargs=template_kwargs,
            )
        else:
            self.parser = functools.partial(harmony.output, self.tool_use)
            prompt = harmony.render(
                body.messages,
                tools=None if self.tool_use is None else body.tools,
                reasoning_effort=body.reasoning_effort,  # type: ignore[arg-type]
                today=datetime.now(UTC).date(),
                param="messages",
            )
            stop_token_ids = harmony.stop_token_ids
        # Unset: up to the end of the context, as OpenAI does.
        max_tokens = body.max_completion_tokens or body.max_tokens
        max_tokens = max_tokens or default_max_tokens(max_model_len - len(prompt), model.defaults)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return [
            Choice(
                i,
                0,
                prompt,
                choice_params(
                    body,
                    i,
                    defaults=model.defaults,
                    max_tokens=max_tokens,
                    logprobs=logprobs,
                    structured=structured,
                    format_stop_token_ids=stop_token_ids,
                    skip_special_tokens=not conventions.keeps_special_tokens,
                ),
            )
            for i in range(body.n)
        ]

    def prompt_record(self) -> JsonValue:
        messages: JsonValue = [m.model_dump(exclude_none=True) for m in self.body.messages]
        kwargs = self.body.chat_template_kwargs
        effort = self.body.reasoning_effort
        if self.tool_use is None and not kwargs and effort is None:
            return messages
        # The tools, the template's variables and the reasoning effort are part of the prompt
        # the model saw.
        record: dict[str, JsonValue] = {"messages": messages}
        if self.tool_use is not None:
            record["tools"] = self.tool_use.definitions  # type: ignore[assignment]
        if kwargs:
            record["chat_template_kwargs"] = kwargs  # type: ignore[assignment]
        if effort is not None:
            record["reasoning_effort"] = effort  # type: ignore[assignment]
        return record

    def output(self, tokenizer: Tokenizer, choices: list[Choice]) -> _ChatOutput:
        return _ChatOutput(tokenizer, choices, with_logprobs=self.body.logprobs, parser=self.parser)


# Standard fields this server does not honour, and why; each may be absent or null only
# (`modalities: ["text"]` and `service_tier: "auto"` or `"default"` ask for what it does).
_REFUSED = {
    "audio": "the served model writes text only",
    "modalities": "the served model writes text only",
    "prediction": "predicted outputs (speculative decoding) are not supported",
    "service_tier": "the appliance has one service tier",
    "web_search_options": "the appliance has no network access and searches nothing",
    "functions": "deprecated by OpenAI: use tools",
    "function_call": "deprecated by OpenAI: use tool_choice",
    "verbosity": "the served model has no verbosity control",
    "prompt_cache_key": "prefix caching is isolated per caller by the server (see cache_salt)",
    "safety_identifier": "not used by this appliance",
}
_ACCEPTED = {"modalities": (["text"],), "service_tier": ("auto", "default")}


_NO_REASONING_EFFORT = (
    "the served model has no reasoning effort control (a Qwen3 model's thinking is switched "
    "with chat_template_kwargs.enable_thinking; gpt-oss takes low, medium or high)"
)

# What constrains an output to a structure: a grammar holds from the first token, which would
# forbid the harmony format's headers and reasoning.
_STRUCTURE_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")  # fmt: skip


def _verify_harmony_request(body: ChatCompletionRequest) -> None:
    """Refuse, by name, what a request cannot have of gpt-oss's harmony format."""
    if body.reasoning_effort is not None and body.reasoning_effort not in REASONING_EFFORTS:
        raise APIError(
            400,
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}",
            param="reasoning_effort",
        )
    structure_field = None
    if structured_output(body) is not None:
        structure_field = next(f for f in _STRUCTURE_FIELDS if getattr(body, f) is not None)
    verify_harmony_request(body.tool_choice, structure_field)
    if body.logprobs:
        raise unsupported(
            "logprobs",
            "not available for gpt-oss: its output's tokens carry the harmony format's headers "
            "and reasoning, parsed out of the answer, so their log-probabilities would match "
            "no content",
        )
    if body.chat_template_kwargs:
        raise unsupported(
            "chat_template_kwargs",
            "gpt-oss's prompt is rendered by the harmony library, not a chat template "
            "(reasoning_effort sets its reasoning effort)",
        )


def _text_parser(
    tool_use: ToolUse | None, reasoning: Callable[[], ReasoningParser] | None
) -> Callable[[], OutputParser] | None:
    """What makes a choice's parser of reasoning and calls in text; None when neither."""
    if tool_use is None and reasoning is None:
        return None
    return lambda: ParsedOutput(
        None if reasoning is None else reasoning(),
        None if tool_use is None else ChoiceCalls(tool_use),
    )


def _verify_supported(body: ChatCompletionRequest) -> None:
    verify_stream_options(body)
    for field, why in _REFUSED.items():
        value = getattr(body, field)
        if value is not None and value not in _ACCEPTED.get(field, ()):
            raise unsupported(field, why)
    if body.store:
        raise unsupported(
            "store",
            "this appliance stores no completions (a request leaves only its audit entries, "
            "which hold commitments, not content); send false or leave it out",
        )
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


class _ChatOutput:
    """OpenAI's chunk sequence per choice: the role with empty content, the reasoning, content
    and tool-call deltas, an empty delta with the finish reason. Whole, one assistant message
    per choice."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        choices: list[Choice],
        *,
        with_logprobs: bool,
        parser: Callable[[], OutputParser] | None = None,
    ):
        self.tokenizer = tokenizer
        self.choices = choices
        self.with_logprobs = with_logprobs
        # A choice whose output is parsed (reasoning, tool calls, harmony) has its parser.
        self._parsed: dict[int, OutputParser] = {}
        if parser is not None:
            self._parsed = {c.index: parser() for c in choices}

    def opening(self) -> Iterator[ChatChunkChoice]:
        for choice in self.choices:
            yield ChatChunkChoice(choice.index, ChatDelta(role="assistant", content=""))

    def chunks(self, index: int, out: RequestOutput) -> Iterator[ChatChunkChoice]:
        logprobs = None
        if self.with_logprobs and out.logprobs:
            logprobs = {"content": chat_logprobs(self.tokenizer, out.logprobs)}
        parsed = self._parsed.get(index)
        if parsed is not None:
            yield from _parsed_chunks(index, parsed, out, logprobs)
        elif out.text or logprobs:
            yield ChatChunkChoice(index, ChatDelta(content=out.text), logprobs)
        if out.finish_reason == "abort":
            raise cut_off_error()
        if out.finished:
            reason = _finish_reason(out.finish_reason, parsed)
            yield ChatChunkChoice(index, ChatDelta(), finish_reason=reason)

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
                    message=self._message(choice.index, result.text, result.token_ids),
                    logprobs=ChatChoiceLogprobs(
                        content=chat_logprobs(self.tokenizer, result.logprobs)
                    )
                    if self.with_logprobs
                    else None,
                    finish_reason=_finish_reason(  # type: ignore[arg-type]
                        result.finish_reason, self._parsed.get(choice.index)
                    ),
                )
                for choice, result in zip(generation.choices, results, strict=True)
            ],
            usage=generation.usage(),
        )

    def _message(self, index: int, text: str, token_ids: list[int]) -> AssistantMessage:
        parsed = self._parsed.get(index)
        if parsed is None:
            return AssistantMessage(content=text)
        whole = parsed.whole(text, token_ids)
        return AssistantMessage(
            content=whole.content,
            reasoning=whole.reasoning,
            tool_calls=[_tool_call_out(c) for c in whole.calls],
        )


def _tool_call_out(call: IdentifiedCall) -> ToolCallOut:
    return ToolCallOut(
        id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments)
    )


def _finish_reason(reason: str | None, parsed: OutputParser | None) -> str | None:
    """OpenAI's "tool_calls" for a choice that stopped after calling tools."""
    if reason == "stop" and parsed is not None and parsed.calls:
        return "tool_calls"
    return reason


def _parsed_chunks(
    index: int, parsed: OutputParser, out: RequestOutput, logprobs: dict[str, Any] | None
) -> Iterator[ChatChunkChoice]:
    """A choice's reasoning, content and calls as vLLM and OpenAI stream them: reasoning in
    `reasoning` deltas; a call's first delta carries its index, id, type and name (arguments
    empty), the next its arguments. A call is sent once it is complete and valid
    (appliance.api.tool_parsers), so its arguments come whole. The output's log-probabilities
    (never with tools) ride on its first chunk, or an empty one while the text is held back."""
    events = parsed.events(out.text, out.token_ids, finished=out.finished)
    # The calls among `events` are the last of `parsed.calls`, in order: numbered by counting,
    # not by looking each up in all the calls so far (quadratic in a reply of many calls).
    position = len(parsed.calls) - sum(isinstance(e, IdentifiedCall) for e in events)
    for event in events:
        if isinstance(event, Reasoning):
            yield ChatChunkChoice(index, ChatDelta(reasoning=event.text), logprobs)
        elif isinstance(event, Content):
            yield ChatChunkChoice(index, ChatDelta(content=event.text), logprobs)
        else:
            head = {"index": position, "id": event.id, "type": "function"}
            function = {"name": event.name, "arguments": ""}
            yield ChatChunkChoice(index, ChatDelta(tool_calls=[{**head, "function": function}]))
            arguments = {"index": position, "function": {"arguments": event.arguments}}
            yield ChatChunkChoice(index, ChatDelta(tool_calls=[arguments]))
            position += 1
        logprobs = None
    if logprobs is not None:
        yield ChatChunkChoice(index, ChatDelta(), logprobs)
