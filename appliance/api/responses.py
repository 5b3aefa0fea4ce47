"""`POST /v1/responses`: OpenAI's Responses API, stateless.

A request's `input` (a text, or message, `function_call` and `function_call_output` items) and
`instructions` become a conversation in the model's chat template, exactly as a chat
completion's messages do (appliance.api.tools renders both), and the answer is `message`
(`output_text`) and `function_call` output items, whole or as OpenAI's typed stream events
(`response.created` ... `response.completed`). The request takes the shared path of every
inference route (appliance.api.serving): the same roles, limits, admission, audit entries and
metrics as chat.

The appliance keeps no conversation state: `store: true` and `previous_response_id` are refused
(400), and a response is never stored (`store: false` in every response). Other standard
fields this server does not honour are refused by name with the reason (`_REFUSED`).
"""

from __future__ import annotations

import functools
import json
import uuid
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, RootModel, model_validator

from appliance.api.errors import APIError, api_error_for, unsupported
from appliance.api.generation import (
    Choice,
    CollectedChoice,
    Generation,
    cut_off_error,
    default_max_tokens,
    sampling_in_force,
)
from appliance.api.harmony import REASONING_EFFORTS, ReasoningEffortName, verify_harmony_request
from appliance.api.models import ServedModel
from appliance.api.parsed_output import OutputParser, ParsedOutput
from appliance.api.reasoning_parsers import Reasoning
from appliance.api.schemas import (
    CalledFunction,
    ChatMessage,
    FunctionDefinition,
    FunctionTool,
    NamedToolChoice,
    StreamOptions,
    Text,
    ToolCall,
    ToolCallId,
    ToolChoiceFunction,
    ToolName,
)
from appliance.api.serving import GENERATION_RESPONSES, Serving
from appliance.api.streaming import EventStreamResponse, StreamHead
from appliance.api.structured_outputs import format_output
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
from appliance.engine.errors import EngineError
from appliance.engine.outputs import RequestOutput
from appliance.engine.sampling_params import SamplingParams, StructuredOutput
from appliance.engine.tokenizer import Tokenizer
from audit.canonical import JsonValue

router = APIRouter()

MAX_INPUT_ITEMS = 1024
"""Most items one request's `input` may hold."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# Request.


class InputText(_Body):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back
    text: Text
    annotations: list[object] | None = None  # of an output_text sent back; unused
    logprobs: list[object] | None = None


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | Annotated[list[InputText], Field(min_length=1)]
    id: Text | None = None  # of an output item sent back
    status: Text | None = None


class FunctionCallItem(_Body):
    type: Literal["function_call"]
    call_id: ToolCallId
    name: ToolName
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: ToolCallId
    output: Text
    id: Text | None = None
    status: Text | None = None


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(_Body):
    """A reasoning output item sent back: its thought goes to the assistant turn after it."""

    type: Literal["reasoning"]
    content: list[ReasoningText] | None = None
    summary: list[object] | None = None  # this server writes none; accepted and unused
    encrypted_content: None = None
    id: Text | None = None
    status: Text | None = None


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
    Field(union_mode="left_to_right"),
]


class ResponsesFunctionTool(_Body):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ResponsesNamedToolChoice(_Body):
    type: Literal["function"]
    name: ToolName


class TextFormat(_Body):
    """`text.format`: chat's `response_format`, its json_schema fields flattened."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: Text | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _fields_fit_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format has a name and a schema")
        if self.type != "json_schema" and (self.name, self.schema_) != (None, None):
            raise ValueError("name and schema belong to the json_schema format")
        return self

    def structure(self) -> StructuredOutput | None:
        return format_output(
            self.type, self.schema_, param="text.format", schema_param="text.format.schema"
        )


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: object = None


# Standard fields this server does not honour, and why; each may be absent or null only.
_REFUSED = {
    "include": "no extra output data is available",
    "background": "responses are answered in the request; none run in the background",
    "conversation": "the appliance keeps no conversation state",
    "prompt": "the appliance stores no prompt templates",
    "max_tool_calls": "the number of calls is bounded by parallel_tool_calls only",
    "top_logprobs": "log-probabilities are not available from this endpoint",
    "prompt_cache_key": "prefix caching is isolated per caller by the server (cache_salt)",
    "service_tier": "the appliance has one service tier",
    "safety_identifier": "not used by this appliance",
}


class ResponsesRequest(_Body):
    model: str
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    instructions: Text | None = None
    tools: Annotated[list[ResponsesFunctionTool], Field(max_length=64)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesNamedToolChoice | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    # Left out: the model's generation_config.json value, else 1 (as in chat).
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: Text | None = None
    metadata: Annotated[dict[str, Text], Field(max_length=16)] | None = None
    user: Text | None = None
    text: TextConfig | None = None
    truncation: Literal["disabled", "auto"] | None = None
    cache_salt: Annotated[Text, Field(min_length=1)] | None = None
    include: object = None
    reasoning: object = None
    background: object = None
    conversation: object = None
    prompt: object = None
    max_tool_calls: object = None
    top_logprobs: object = None
    prompt_cache_key: object = None
    service_tier: object = None
    safety_identifier: object = None

    # What the shared path reads of every body: one choice, no chunk options.
    @property
    def n(self) -> int:
        return 1

    @property
    def stream_options(self) -> StreamOptions | None:
        return None


class ResponseObject(RootModel[dict[str, Any]]):
    """OpenAI's Response object (built by `_ResponsesOutput`)."""


@router.post("/v1/responses", response_model=ResponseObject, responses=GENERATION_RESPONSES)
async def create_response(
    body: ResponsesRequest, request: Request, server: Serving
) -> ResponseObject | EventStreamResponse:
    return await server.serve(request, _ResponsesEndpoint(body))


def _reasoning_effort(reasoning: object, *, harmony_served: bool) -> ReasoningEffortName | None:
    """The reasoning effort `reasoning` (the request's field) asks for: gpt-oss takes
    `{"effort": "low" | "medium" | "high"}`; other models, and summaries, have no such control.
    Raises a 400 naming the field."""
    if reasoning is None:
        return None
    if not harmony_served:
        raise unsupported(
            "reasoning", "the served model has no reasoning effort or summary controls"
        )
    if (
        not isinstance(reasoning, dict)
        or not set(reasoning) <= {"effort", "summary"}
        or reasoning.get("summary") is not None
    ):
        raise unsupported(
            "reasoning", "gpt-oss takes reasoning.effort (low, medium or high) only, no summary"
        )
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise APIError(
            400,
            f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}",
            param="reasoning.effort",
        )
    return effort


def _echoed_effort(reasoning: object) -> object:
    """The reasoning effort a request gave, as OpenAI echoes it (a model that has none refuses
    the field before a response is made)."""
    return reasoning.get("effort") if isinstance(reasoning, dict) else None


def _verify_supported(body: ResponsesRequest) -> None:
    if body.store:
        raise unsupported(
            "store",
            "the appliance keeps no conversation state, so responses cannot be stored; send "
            "store: false (or leave it out) and pass the whole conversation as input",
        )
    if body.previous_response_id is not None:
        raise unsupported(
            "previous_response_id",
            "the appliance keeps no conversation state, so no earlier response can be "
            "continued; pass the whole conversation as input",
        )
    for field, why in _REFUSED.items():
        value = getattr(body, field)
        if value is not None and value != []:
            raise unsupported(field, why)
    if body.text is not None and body.text.verbosity is not None:
        raise unsupported("text.verbosity", "the served model has no verbosity control")
    if body.truncation == "auto":
        raise unsupported("truncation", "'auto' is not supported; an input too long is refused")
    for key, value in (body.metadata or {}).items():
        if len(key) > 64 or len(value) > 512:
            raise APIError(
                400, "metadata: keys are at most 64 characters, values 512", param="metadata"
            )


def _conversation(body: ResponsesRequest) -> list[ChatMessage]:
    """The input as chat messages: instructions first as a system message, consecutive
    function calls as one assistant message with tool calls, each output as a tool message;
    a reasoning item's thought as the reasoning of the assistant message that follows it
    (dropped when none does)."""
    messages: list[ChatMessage] = []
    if body.instructions is not None:
        messages.append(ChatMessage(role="system", content=body.instructions))
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else []
    thought: str | None = None
    for item in items or body.input:  # type: ignore[union-attr]
        if isinstance(item, ReasoningItem):
            thought = "".join(part.text for part in item.content or ())
            continue
        reasoning = thought if item.type != "function_call_output" else None
        thought = None
        if isinstance(item, MessageItem):
            content = item.content
            if not isinstance(content, str):
                content = "\n".join(part.text for part in content)
            if item.role != "assistant":
                reasoning = None
            messages.append(ChatMessage(role=item.role, content=content, reasoning=reasoning))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(
                id=item.call_id,
                type="function",
                function=CalledFunction(name=item.name, arguments=item.arguments),
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)
            else:
                messages.append(
                    ChatMessage(role="assistant", tool_calls=[call], reasoning=reasoning)
                )
        else:
            messages.append(
                ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id)
            )
    return messages


def _chat_tools(body: ResponsesRequest) -> list[FunctionTool] | None:
    if body.tools is None:
        return None
    return [
        FunctionTool(
            type="function",
            function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters
            ),
        )
        for tool in body.tools
    ]


class _ResponsesEndpoint:
    path = "/v1/responses"
    id_prefix = "resp"
    chunk_object = "response"
    prompt_param = "input"

    def __init__(self, body: ResponsesRequest):
        self.body = body
        self.tool_use: ToolUse | None = None
        self._messages: list[ChatMessage] = []
        self._parser: Callable[[], OutputParser] = lambda: ParsedOutput(None, None)
        self._params: SamplingParams | None = None  # set by `choices`, which runs first

    @property
    def uses_tools(self) -> bool:
        return self.tool_use is not None

    def verify_supported(self) -> None:
        _verify_supported(self.body)

    def choices(self, model: ServedModel, tokenizer: Tokenizer, max_model_len: int) -> list[Choice]:
        body = self.body
        harmony = model.harmony
        self._messages = _conversation(body)
        renders_tools = harmony is not None or tokenizer.chat_template_reads_tools
        verify_tool_messages(
            self._messages,
            renders_tools=renders_tools,
            model_name=body.model,
            param="input",
            indexed=False,
        )
        conventions = model.conventions(tokenizer)
        choice = body.tool_choice
        if isinstance(choice, ResponsesNamedToolChoice):
            choice = NamedToolChoice(type="function", function=ToolChoiceFunction(name=choice.name))
        requested = body.text.format.structure() if body.text and body.text.format else None
        effort = _reasoning_effort(body.reasoning, harmony_served=harmony is not None)
        if harmony is not None:
            verify_harmony_request(choice, None if requested is None else "text.format")
        self.tool_use = plan_tool_use(
            _chat_tools(body),
            choice,
            parallel=body.parallel_tool_calls,
            renders_tools=renders_tools,
            model_name=body.model,
            tool_format=conventions.tool_format,
        )
        structured = structure_with_tools(requested, self.tool_use)
        stop_token_ids: tuple[int, ...] = ()
        if harmony is None:
            reasoning = conventions.reasoning({}, constrained=structured is not None)
            self._parser = lambda: ParsedOutput(
                None if reasoning is None else reasoning(),
                None if self.tool_use is None else ChoiceCalls(self.tool_use),
            )
            prompt = tokenizer.encode_chat(
                [template_message(m) for m in self._messages],
                tools=None if self.tool_use is None else self.tool_use.definitions,
            )
        else:
            self._parser = functools.partial(harmony.output, self.tool_use)
            prompt = harmony.render(
                self._messages,
                tools=None if self.tool_use is None else _chat_tools(body),
                reasoning_effort=effort,
                today=datetime.now(UTC).date(),
                param="input",
            )
            stop_token_ids = harmony.stop_token_ids
        max_tokens = body.max_output_tokens or default_max_tokens(
            max_model_len - len(prompt), model.defaults
        )
        self._params = SamplingParams(
            max_tokens=max_tokens,
            **sampling_in_force(model.defaults, temperature=body.temperature, top_p=body.top_p),
            stop_token_ids=stop_token_ids,
            structured=structured,
            skip_special_tokens=not conventions.keeps_special_tokens,
        )
        return [Choice(0, 0, prompt, self._params)]

    def prompt_record(self) -> JsonValue:
        record: dict[str, JsonValue] = {
            "messages": [m.model_dump(exclude_none=True) for m in self._messages]  # type: ignore[misc]
        }
        if self.tool_use is not None:
            record["tools"] = self.tool_use.definitions  # type: ignore[assignment]
        if self.body.reasoning is not None:
            record["reasoning"] = self.body.reasoning  # type: ignore[assignment]
        return record

    def output(self, tokenizer: Tokenizer, choices: list[Choice]) -> _ResponsesOutput:
        parsed = self._parser()
        assert self._params is not None, "the shared path plans the choices first"
        return _ResponsesOutput(self.body, self._params, parsed, tokenizer)


def _format_record(body: ResponsesRequest) -> dict[str, Any]:
    """`text.format` as OpenAI echoes it."""
    if body.text is None or body.text.format is None:
        return {"type": "text"}
    return body.text.format.model_dump(by_alias=True, exclude_none=True)


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content if status == "completed" else []}  # fmt: skip


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [],
            "content": content, "encrypted_content": None}  # fmt: skip


def _call_item(call: IdentifiedCall, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_{call.id.removeprefix('call_')}",
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


class _ResponsesOutput:
    """The Response object, whole, or its typed events as OpenAI streams them: a reasoning item
    (the model's thought, when it reasons), a message item (its text) and function_call items,
    in the order the model wrote them."""

    def __init__(
        self,
        body: ResponsesRequest,
        params: SamplingParams,
        parsed: OutputParser,
        tokenizer: Tokenizer,
    ):
        self._body = body
        self._params = params  # the sampling in force, the model's defaults included
        self._parsed = parsed
        self._tokenizer = tokenizer

    # A Responses stream is `events`, not chunks: the chunk methods of `Output` give none.
    def opening(self) -> list[Any]:
        return []

    def chunks(self, index: int, out: RequestOutput) -> list[Any]:
        return []

    def response(
        self, head: StreamHead, generation: Generation, results: list[CollectedChoice]
    ) -> ResponseObject:
        [result] = results
        whole = self._parsed.whole(result.text, result.token_ids)
        output = []
        if whole.reasoning:
            output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", whole.reasoning, "completed"))
        if whole.content:
            output.append(_message_item(f"msg_{uuid.uuid4().hex}", whole.content, "completed"))
        output += [_call_item(call, "completed") for call in whole.calls]
        return ResponseObject(self._object(head, generation, output, result.finish_reason))

    def _object(
        self,
        head: StreamHead,
        generation: Generation | None,
        output: list[dict[str, Any]],
        finish_reason: str | None,
    ) -> dict[str, Any]:
        """OpenAI's Response object; in progress while `finish_reason` is None."""
        body = self._body
        status = {None: "in_progress", "length": "incomplete"}.get(finish_reason, "completed")
        usage = None
        if generation is not None and finish_reason is not None:
            counts = generation.usage()
            usage = {
                "input_tokens": counts.prompt_tokens,
                "input_tokens_details": {
                    "cached_tokens": counts.prompt_tokens_details.cached_tokens
                },
                "output_tokens": counts.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens(output)},
                "total_tokens": counts.total_tokens,
            }
        choice = body.tool_choice
        return {
            "id": head.id,
            "object": "response",
            "created_at": head.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": head.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": _echoed_effort(body.reasoning), "summary": None},
            "store": False,
            "temperature": self._params.temperature,
            "text": {"format": _format_record(body)},
            "tool_choice": choice.model_dump()
            if isinstance(choice, BaseModel)
            else choice or "auto",
            "tools": [tool.model_dump() for tool in body.tools or ()],
            "top_p": self._params.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def _reasoning_tokens(self, output: list[dict[str, Any]]) -> int:
        """The thought's length in tokens, as the tokenizer encodes its text (the tags and the
        newlines around it, which the parser drops, not counted)."""
        return sum(
            len(self._tokenizer.encode(part["text"]))
            for item in output
            if item["type"] == "reasoning"
            for part in item["content"]
        )

    def is_final(self, event: bytes) -> bool:
        return event.startswith((b"event: response.completed\n", b"event: response.incomplete\n"))

    async def events(self, head: StreamHead, generation: Generation) -> AsyncGenerator[bytes, None]:
        """response.created, in_progress, then each output item's added, delta(s), done events,
        then response.completed (or .incomplete at max_output_tokens) with the usage."""
        stream = _EventWriter()
        output: list[dict[str, Any]] = []
        yield stream.event("response.created", response=self._object(head, None, [], None))
        yield stream.event("response.in_progress", response=self._object(head, None, [], None))
        open_item: _OpenItem | None = None  # the reasoning or message item being written
        finish_reason: str | None = None
        try:
            async for _, out in generation.outputs():
                if out.finish_reason == "abort":
                    raise cut_off_error()
                for piece in self._parsed.events(out.text, out.token_ids, finished=out.finished):
                    kind = _TEXT_ITEMS.get(type(piece))
                    if open_item is not None and open_item.kind is not kind:
                        for event in open_item.close(stream, output):
                            yield event
                        open_item = None
                    if isinstance(piece, IdentifiedCall):
                        for event in _call_events(stream, piece, len(output)):
                            yield event
                        output.append(_call_item(piece, "completed"))
                        continue
                    if open_item is None:
                        open_item = _OpenItem(kind, len(output))  # type: ignore[arg-type]
                        for event in open_item.open(stream):
                            yield event
                    yield open_item.delta(stream, piece.text)
                if out.finished:
                    finish_reason = out.finish_reason
            if open_item is not None:
                for event in open_item.close(stream, output):
                    yield event
        except APIError as exc:
            yield stream.event("error", **_error_fields(exc))
            return
        except EngineError as exc:
            yield stream.event("error", **_error_fields(api_error_for(exc)))
            return
        final = self._object(head, generation, output, finish_reason)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield stream.event(kind, response=final)


def _error_fields(exc: APIError) -> dict[str, Any]:
    body = exc.body()
    return {"code": exc.code, "message": exc.message, "param": exc.param, **body}


class _EventWriter:
    """`event: <type>` / `data: <JSON>` pairs, numbered in order (`sequence_number`)."""

    def __init__(self) -> None:
        self._sequence_number = 0

    def event(self, type_: str, **fields: Any) -> bytes:
        data = {"type": type_, "sequence_number": self._sequence_number, **fields}
        self._sequence_number += 1
        data_json = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return f"event: {type_}\ndata: {data_json}\n\n".encode()


@dataclass(frozen=True, slots=True)
class _TextItem:
    """An output item written as text: its id prefix, part type, event names and item."""

    id_prefix: str
    part_type: str
    event_prefix: str
    item: Callable[[str, str, str], dict[str, Any]]
    logprobs: bool  # whether its events carry (empty) logprobs


_MESSAGE = _TextItem("msg", "output_text", "response.output_text", _message_item, True)
_REASONING = _TextItem("rs", "reasoning_text", "response.reasoning_text", _reasoning_item, False)
_TEXT_ITEMS: dict[type, _TextItem] = {Content: _MESSAGE, Reasoning: _REASONING}


class _OpenItem:
    """A message or reasoning output item being streamed: its text so far."""

    def __init__(self, kind: _TextItem, output_index: int):
        self.kind = kind
        self.id = f"{kind.id_prefix}_{uuid.uuid4().hex}"
        self.output_index = output_index
        self.parts: list[str] = []

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.id, "output_index": self.output_index, "content_index": 0}

    def _logprobs(self) -> dict[str, Any]:
        return {"logprobs": []} if self.kind.logprobs else {}

    def open(self, stream: _EventWriter) -> list[bytes]:
        part = {"type": self.kind.part_type, "text": "", **self._logprobs()}
        if self.kind.logprobs:
            part["annotations"] = []
        return [
            stream.event(
                "response.output_item.added",
                output_index=self.output_index,
                item=self.kind.item(self.id, "", "in_progress"),
            ),
            stream.event("response.content_part.added", **self._where(), part=part),
        ]

    def delta(self, stream: _EventWriter, text: str) -> bytes:
        self.parts.append(text)
        return stream.event(
            f"{self.kind.event_prefix}.delta", **self._where(), delta=text, **self._logprobs()
        )

    def close(self, stream: _EventWriter, output: list[dict[str, Any]]) -> list[bytes]:
        text = "".join(self.parts)
        item = self.kind.item(self.id, text, "completed")
        output.append(item)
        return [
            stream.event(
                f"{self.kind.event_prefix}.done", **self._where(), text=text, **self._logprobs()
            ),
            stream.event("response.content_part.done", **self._where(), part=item["content"][0]),
            stream.event("response.output_item.done", output_index=self.output_index, item=item),
        ]


def _call_events(stream: _EventWriter, call: IdentifiedCall, output_index: int) -> list[bytes]:
    """A complete call's item events; its arguments come whole (appliance.api.tool_parsers)."""
    item = _call_item(call, "completed")
    where = {"item_id": item["id"], "output_index": output_index}
    return [
        stream.event(
            "response.output_item.added",
            output_index=output_index,
            item=_call_item(call, "in_progress"),
        ),
        stream.event("response.function_call_arguments.delta", **where, delta=call.arguments),
        stream.event(
            "response.function_call_arguments.done",
            **where,
            name=call.name,
            arguments=call.arguments,
        ),
        stream.event("response.output_item.done", output_index=output_index, item=item),
    ]
