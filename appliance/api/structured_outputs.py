"""The request fields that constrain an output to a structure, as the engine's StructuredOutput.

OpenAI's `response_format` (`json_object`; `json_schema`, applied whether `strict` or not: the
grammar always holds), the Responses API's `text.format` (the same, flattened), and vLLM's
`structured_outputs` extension with its older `guided_*` names: `json`, `regex`, `choice`,
`grammar` (Lark, or GBNF as llama.cpp writes it) and `json_object`. A request gives at most one.
Compilation, and with it every error inside a schema, regex or grammar, is the engine's
(appliance.engine.structured_output), when the request is taken: a 400 before anything runs.
"""

from __future__ import annotations

import json

from appliance.api.errors import APIError, unsupported
from appliance.api.schemas import ResponseFormat, SamplingFields, StructuredOutputsParams
from appliance.engine.sampling_params import (
    MAX_STRUCTURE_CHARS,
    StructuredOutput,
    StructureKind,
)
from appliance.json_limits import parse_json

# vLLM's structured_outputs options that change what the grammar allows: refused rather than
# silently ignored.
_REFUSED_OPTIONS = {
    "whitespace_pattern": "JSON is always written compactly; no whitespace pattern applies",
    "disable_additional_properties": "the schema's own additionalProperties is what applies",
    "structural_tag": "structural tags are not supported; use tools or a json schema",
}


def structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The one structure `body` constrains its output to, None for free text. Raises a 400
    naming the field for a malformed or conflicting one."""
    given: list[tuple[str, StructuredOutput]] = []
    if body.response_format is not None:
        output = response_format_output(body.response_format, param="response_format")
        if output is not None:
            given.append(("response_format", output))
    if body.structured_outputs is not None:
        given.extend(_from_structured_outputs(body.structured_outputs))
    if body.guided_whitespace_pattern is not None:
        raise unsupported("guided_whitespace_pattern", _REFUSED_OPTIONS["whitespace_pattern"])
    guided = {
        "guided_json": ("json_schema", body.guided_json),
        "guided_regex": ("regex", body.guided_regex),
        "guided_choice": ("choice", body.guided_choice),
        "guided_grammar": ("grammar", body.guided_grammar),
    }
    for param, (kind, value) in guided.items():
        if value is not None:
            given.append((param, _output(kind, value, param)))
    if len(given) > 1:
        names = ", ".join(param for param, _ in given)
        raise APIError(
            400, f"give one output structure; the request gives {names}", param=given[1][0]
        )
    return given[0][1] if given else None


def response_format_output(fmt: ResponseFormat, *, param: str) -> StructuredOutput | None:
    """Chat's `response_format`: None for text."""
    schema = fmt.json_schema.schema_ if fmt.json_schema is not None else None
    return format_output(fmt.type, schema, param=param, schema_param=f"{param}.json_schema.schema")


def format_output(
    kind: str, schema: dict[str, object] | None, *, param: str, schema_param: str
) -> StructuredOutput | None:
    """An OpenAI output format (chat's `response_format`, the Responses API's `text.format`)
    of type `kind`: None for text; any JSON object for json_object or a json_schema without a
    schema; else that schema (`schema_param` names it in errors)."""
    if kind == "text":
        return None
    if kind == "json_object" or schema is None:
        return StructuredOutput("json_object", param=param)
    return _output("json_schema", schema, schema_param)


def json_schema_output(schema: dict[str, object], *, param: str) -> StructuredOutput:
    """A JSON-schema structure (tool calls forced by tool_choice use it too)."""
    return _output("json_schema", schema, param)


def _from_structured_outputs(params: StructuredOutputsParams) -> list[tuple[str, StructuredOutput]]:
    for option, why in _REFUSED_OPTIONS.items():
        if getattr(params, option) is not None:
            raise unsupported(f"structured_outputs.{option}", why)
    fields: dict[str, tuple[StructureKind, object]] = {
        "json": ("json_schema", params.json_),
        "regex": ("regex", params.regex),
        "choice": ("choice", params.choice),
        "grammar": ("grammar", params.grammar),
    }
    given = [
        (f"structured_outputs.{name}", _output(kind, value, f"structured_outputs.{name}"))
        for name, (kind, value) in fields.items()
        if value is not None
    ]
    if params.json_object:
        param = "structured_outputs.json_object"
        given.append((param, StructuredOutput("json_object", param=param)))
    if not given:
        raise APIError(
            400,
            "structured_outputs: give one of json, regex, choice, grammar or json_object",
            param="structured_outputs",
        )
    return given


def _output(kind: StructureKind, value: object, param: str) -> StructuredOutput:
    if kind == "json_schema":
        spec = _schema_text(value, param)
    elif kind == "choice":
        assert isinstance(value, list)
        if any(not choice for choice in value):
            raise APIError(400, f"{param}: every choice must be a non-empty string", param=param)
        spec = json.dumps(value, ensure_ascii=False)
    else:
        assert isinstance(value, str)
        if not value.strip():
            raise APIError(400, f"{param}: must not be empty", param=param)
        spec = value
    if len(spec) > MAX_STRUCTURE_CHARS:
        raise APIError(
            400, f"{param}: {len(spec)} characters, over the limit of {MAX_STRUCTURE_CHARS}",
            param=param,
        )  # fmt: skip
    return StructuredOutput(kind, spec, param)


def _schema_text(value: object, param: str) -> str:
    """A JSON schema as compact JSON text, its properties in the order given (the order the
    output will have). A schema sent as a string is parsed within the request-body limits."""
    if isinstance(value, str):

        def error(why: str) -> APIError:
            return APIError(400, f"{param}: {why}", param=param)

        value = parse_json(value, what="the schema", error=error, max_bytes=MAX_STRUCTURE_CHARS * 4)
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: a JSON schema is a JSON object", param=param)
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
