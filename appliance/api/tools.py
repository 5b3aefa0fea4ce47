"""Tool calling for a request: which tools it offers the model, how they and the conversation
reach the chat template, and the parser of the model's calls.

What this server does and refuses (docs/ARCHITECTURE.md, "Tool calling and the Responses API"):

- `tool_choice` `auto` (the default with tools) renders the tools through the model's own chat
  template and parses the calls the model writes; `none` leaves the tools out of the prompt, so
  the model cannot call them, and parses nothing.
- `required` and a named function force calls, as vLLM does: the tools are rendered the same
  way, and the output is constrained by a grammar (appliance.api.structured_outputs) to a JSON
  array of `{"name", "parameters"}` calls (one at most without `parallel_tool_calls`) or to the
  named function's arguments, so the arguments always match the function's parameter schema.
- A model whose chat template does not read `tools`, or writes calls in a format no parser here
  reads, has its tools refused (400) rather than silently dropped.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from appliance.api.errors import APIError, unsupported
from appliance.api.schemas import ChatMessage, FunctionTool, ToolChoice
from appliance.api.structured_outputs import json_schema_output
from appliance.api.tool_parsers import (
    INVALID_JSON,
    PARSERS,
    Call,
    Content,
    ForcedCallsParser,
    ToolCallParser,
    decode_json,
)
from appliance.engine.sampling_params import StructuredOutput

MAX_SCHEMA_BYTES = 16 * 1024
"""Largest JSON schema of one function's parameters, as compact JSON."""

MAX_SCHEMA_DEPTH = 16
"""Deepest nesting of objects and arrays in one function's parameters."""


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The tools a request lets the model call, in the template's form, and the format the
    model writes its calls in."""

    definitions: list[dict[str, Any]]
    names: frozenset[str]
    format: str | None  # None when the calls are forced (chat_conventions.ChatConventions)
    parallel: bool
    # tool_choice `required` or a named function: the grammar of the forced calls, and the
    # function named (None for `required`).
    forced: StructuredOutput | None = None
    forced_function: str | None = None

    def parser(self) -> ToolCallParser:
        if self.forced is not None:
            return ForcedCallsParser(self.names, self.forced_function)
        assert self.format in PARSERS, "harmony's calls are parsed by appliance.api.harmony"
        return PARSERS[self.format](self.names)


def plan_tool_use(
    tools: Sequence[FunctionTool] | None,
    tool_choice: ToolChoice | None,
    *,
    parallel: bool,
    renders_tools: bool,
    model_name: str,
    tool_format: str | None,
    param: str = "tools",
) -> ToolUse | None:
    """The request's tool use, None when it offers no tool or says `none`; the model's prompt
    shows tools when `renders_tools` (a chat template that reads them, or harmony), and the
    model writes its calls in `tool_format` (appliance.api.chat_conventions), None when no
    parser reads them. Raises a 400 naming the field for what this server cannot honour."""
    if tool_choice is not None and not tools:
        raise APIError(400, "tool_choice is only allowed when tools are given", param="tool_choice")
    if not tools or tool_choice == "none":
        return None
    verify_tool_definitions(tools, param=param)
    if not renders_tools:
        raise unsupported(param, f"the chat template of model {model_name!r} has no tool support")
    definitions = [
        tool.model_dump(exclude_none=True, exclude={"function": {"strict"}}) for tool in tools
    ]
    names = frozenset(tool.function.name for tool in tools)
    if tool_choice is not None and tool_choice != "auto":
        function = None if tool_choice == "required" else tool_choice.function.name
        forced = forced_calls(tools, function, parallel=parallel, param=param)
        return ToolUse(definitions, names, None, parallel, forced, function)
    if tool_format is None:
        raise unsupported(
            param,
            f"model {model_name!r} writes tool calls in a format this server does not parse "
            f"(it parses: {', '.join(sorted(PARSERS))}; model.tool_parser names one)",
        )
    return ToolUse(definitions, names, tool_format, parallel)


def structure_with_tools(
    requested: StructuredOutput | None, tool_use: ToolUse | None
) -> StructuredOutput | None:
    """The structure the output follows: the one requested, or the calls tool_choice forces.
    A requested structure would forbid the calls of tools the model may call (`auto`), and
    cannot be combined with forced ones."""
    if tool_use is None:
        return requested
    if requested is None:
        return tool_use.forced
    raise APIError(
        400,
        "an output structure (response_format, text.format or structured_outputs) and tools "
        "the model may call cannot be combined: the structure would forbid the calls; give "
        "tool_choice 'none', or force the calls with 'required' or a named function and no "
        "structure",
        param="tool_choice",
    )


def forced_calls(
    tools: Sequence[FunctionTool], function: str | None, *, parallel: bool, param: str
) -> StructuredOutput:
    """The grammar of calls that `tool_choice` forces: the named `function`'s arguments, or
    (None: `required`) an array of calls to any of `tools` (one at most unless `parallel`)."""
    schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
    if function is not None:
        if function not in schemas:
            raise APIError(
                400,
                f"tool_choice names function {function!r}, which the request's tools do not define",
                param="tool_choice",
            )
        return json_schema_output(schemas[function], param=f"{param}.{function}.parameters")
    call_schemas = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    calls: dict[str, object] = {"type": "array", "items": {"anyOf": call_schemas}, "minItems": 1}
    if not parallel:
        calls["maxItems"] = 1
    return json_schema_output(calls, param=param)


def verify_tool_definitions(tools: Sequence[FunctionTool], *, param: str) -> None:
    """Unique names; each parameters schema within MAX_SCHEMA_BYTES and MAX_SCHEMA_DEPTH."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise APIError(
                400, f"{param}[{index}]: function {name!r} is defined twice", param=param
            )
        seen.add(name)
        schema = tool.function.parameters
        if schema is None:
            continue
        if _depth(schema) > MAX_SCHEMA_DEPTH:
            raise APIError(
                400,
                f"{param}[{index}].parameters: nested deeper than {MAX_SCHEMA_DEPTH} levels",
                param=param,
            )
        if len(json.dumps(schema, separators=(",", ":"))) > MAX_SCHEMA_BYTES:
            raise APIError(
                400,
                f"{param}[{index}].parameters: larger than {MAX_SCHEMA_BYTES} bytes as JSON",
                param=param,
            )


def _depth(value: object) -> int:
    """Nesting depth of a JSON value, iteratively (a hostile schema cannot exhaust the stack);
    stops counting once past the limit."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, depth)
            if depth > MAX_SCHEMA_DEPTH:
                return depth
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return deepest


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A chat message as chat templates read it (transformers' conventions): "developer" as
    "system", text parts joined, an assistant's call arguments as the JSON object they spell
    (templates write them with `tojson`) and its reasoning, as vLLM passes them."""
    content = None if message.content is None else message_text(message)
    role = "system" if message.role == "developer" else message.role
    rendered: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_calls is not None:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments_value(call.function.arguments),
                },
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:
        # Under both names, as vLLM passes it: Qwen3's template reads the older one.
        rendered["reasoning"] = rendered["reasoning_content"] = reasoning
    return rendered


def message_text(message: ChatMessage) -> str:
    """A message's text: its content, text parts joined by newlines ("" for none)."""
    if isinstance(message.content, list):
        return "\n".join(part.text for part in message.content)
    return message.content or ""


def _arguments_value(arguments: str) -> object:
    value = decode_json(arguments)
    return arguments if value is INVALID_JSON else value


def verify_tool_messages(
    messages: Sequence[ChatMessage],
    *,
    renders_tools: bool,
    model_name: str,
    param: str,
    indexed: bool = True,
) -> None:
    """Refuse tool calls and tool results in a conversation for a model whose prompt cannot
    show them (`renders_tools` false: a template that would render them as if they were
    ordinary text, or fail). `param[i]` names the message when `indexed` (the messages are
    the request's own)."""
    if renders_tools:
        return
    for index, message in enumerate(messages):
        if message.role == "tool" or message.tool_calls:
            raise unsupported(
                f"{param}[{index}]" if indexed else param,
                f"tool calls and results need tool support, which the chat template of model "
                f"{model_name!r} does not have",
            )


@dataclass(frozen=True, slots=True)
class IdentifiedCall:
    """A parsed call with the id the response gives it (`call_<random>`, as OpenAI's)."""

    id: str
    name: str
    arguments: str

    @classmethod
    def of(cls, call: Call) -> IdentifiedCall:
        return cls(f"call_{uuid.uuid4().hex[:24]}", call.name, call.arguments)


class ChoiceCalls:
    """One choice's output under tool use, piece by piece: its content and its calls, in
    order. Whitespace alone before, between or after calls is not content (OpenAI sends
    none); whitespace after text is. Without `parallel_tool_calls`, calls after the first
    are dropped."""

    def __init__(self, tool_use: ToolUse):
        self._parser = tool_use.parser()
        self._parallel = tool_use.parallel
        self._held_space: list[str] = []  # whitespace not sent yet, in pieces
        self._text_since_call = False
        self.calls: list[IdentifiedCall] = []

    def events(self, text: str, *, finished: bool) -> list[Content | IdentifiedCall]:
        """What `text`, the choice's next output, adds; `finished` for its last."""
        parsed = self._parser.feed(text) if text else []
        if finished:
            parsed += self._parser.finish()
        events: list[Content | IdentifiedCall] = []
        for event in parsed:
            if isinstance(event, Call):
                self._held_space, self._text_since_call = [], False
                if self.calls and not self._parallel:
                    continue
                call = IdentifiedCall.of(event)
                self.calls.append(call)
                events.append(call)
                continue
            # Only the new piece can end a run of whitespace: what is held is all whitespace.
            if self._text_since_call or event.text.strip():
                self._text_since_call = True
                events.append(Content("".join([*self._held_space, event.text])))
                self._held_space = []
            else:
                self._held_space.append(event.text)
        if finished and any(self._held_space) and not self.calls:
            events.append(Content("".join(self._held_space)))
        return events
