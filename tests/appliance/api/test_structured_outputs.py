"""Structured outputs and forced tool calls as applications send them: OpenAI's own client
(`parse` with a Pydantic model, streams, the Responses API) and LangChain's `ChatOpenAI`, against
the real server (uvicorn, TLS) on the embedded model, whose output the grammar must hold to."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from appliance.engine.engine import Engine
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server


class Painting(BaseModel):
    title: str = Field(max_length=40)
    year: int = Field(ge=1400, le=1600)
    medium: Literal["oil", "tempera", "fresco"]


# As OpenAI's client sends a Pydantic model (`strict`): no properties beyond the model's.
STRICT_PAINTING = {**Painting.model_json_schema(), "additionalProperties": False}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": WEATHER_PARAMETERS,
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The current time in a time zone.",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def served(
    smollm2_engine: Any, qwen_template_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    engine: Engine = smollm2_engine(max_model_len=768, num_kv_blocks=512)
    # The engine's tokenizer is the template's (the weights are the embedded model's).
    engine.tokenizer = Tokenizer.from_model_dir(qwen_template_dir)
    settings = make_settings(tmp_path_factory.mktemp("tls-structured"), qwen_template_dir)
    with running_server(settings, engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(served: RunningServer) -> openai.OpenAI:
    return served.client()


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", [{"role": "user", "content": "A famous painting, as JSON."}])
    kwargs.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def _refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.body  # type: ignore[return-value]


# response_format.


def test_parse_with_a_pydantic_model_returns_the_parsed_object(client: openai.OpenAI) -> None:
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Describe the Mona Lisa."}],
            response_format=Painting,
            max_tokens=120,
            temperature=1.0,
            seed=seed,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Painting)
        assert Painting.model_validate_json(message.content) == message.parsed


def test_streamed_json_schema_output_adds_up_to_a_valid_object(client: openai.OpenAI) -> None:
    schema = STRICT_PAINTING
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "painting", "schema": schema, "strict": True},
    }
    stream = _chat(client, response_format=response_format, stream=True, temperature=0.8, seed=7)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([p for p in pieces if p]) > 3  # streamed in pieces, not held back
    jsonschema.validate(json.loads("".join(pieces)), schema)


def test_json_object_output_is_a_json_object(client: openai.OpenAI) -> None:
    reply = _chat(client, response_format={"type": "json_object"}, temperature=0.7, seed=3)
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_vllm_extensions_constrain_chat_and_completions(client: openai.OpenAI) -> None:
    choice = _chat(client, extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert choice.message.content in ("yes", "no")
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    structured = {"structured_outputs": {"regex": pattern}}
    reply = _chat(client, extra_body=structured, temperature=1.0, seed=1)
    assert re.fullmatch(pattern, reply.choices[0].message.content)
    completion = client.completions.create(
        model=MODEL_NAME,
        prompt="The painting's data:",
        max_tokens=100,
        extra_body={"guided_json": STRICT_PAINTING},
    )
    Painting.model_validate_json(completion.choices[0].text)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {"guided_regex": "a+", "structured_outputs": {"choice": ["a"]}},
            "guided_regex",
            "give one output structure",
        ),
        ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
        ({"structured_outputs": {}}, "structured_outputs", "give one of json"),
        (
            {"structured_outputs": {"json_object": True, "whitespace_pattern": " *"}},
            "structured_outputs.whitespace_pattern",
            "compactly",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_json": "[1]"}, "guided_json", "a JSON schema is a JSON object"),
        ({"guided_grammar": "start: missing"}, "guided_grammar", "missing"),
    ],
)
def test_bad_or_conflicting_structures_are_refused_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    error = _refusal(lambda: _chat(client, extra_body=extra))
    assert error["param"] == param
    assert words in error["message"]


def test_structured_requests_are_counted_and_compile_time_is_measured(
    client: openai.OpenAI, served: RunningServer
) -> None:
    def count() -> float:
        return served.metric(
            "inferno:structured_output_requests_total",
            endpoint="/v1/chat/completions",
            kind="regex",
        )

    before = count()
    compiles_before = served.metric("inferno:grammar_compile_seconds_count")
    _chat(client, extra_body={"guided_regex": "counted-[0-9]"}, max_tokens=8)
    _chat(client, extra_body={"guided_regex": "counted-[0-9]"}, max_tokens=8)  # cached
    assert count() == before + 2
    assert served.metric("inferno:grammar_compile_seconds_count") == compiles_before + 1


# Tool calls forced by tool_choice.


def test_named_tool_choice_round_trip_with_arguments_that_match_the_schema(
    client: openai.OpenAI,
) -> None:
    first = _chat(
        client,
        messages=QUESTION,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=1.0,
        seed=5,
    ).choices[0]
    assert first.finish_reason == "tool_calls"
    [call] = first.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)
    # The client's message goes back with the tool's result; the model answers in text.
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}
    final = _chat(
        client, messages=[*QUESTION, first.message, result], tools=[WEATHER_TOOL], max_tokens=30
    ).choices[0]
    assert final.message.tool_calls is None
    assert final.message.content


def test_required_tool_choice_calls_offered_functions_one_at_most_unless_parallel(
    client: openai.OpenAI,
) -> None:
    tools = [WEATHER_TOOL, TIME_TOOL]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(4):
        reply = _chat(
            client,
            messages=QUESTION,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=150,
        ).choices[0]
        assert reply.finish_reason == "tool_calls"
        [call] = reply.message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_forced_call_is_assembled_by_the_client(client: openai.OpenAI) -> None:
    stream = _chat(
        client,
        messages=QUESTION,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    name, arguments, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or ():
            assert call.index == 0
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, finish) == ("get_weather", "tool_calls")
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)


def test_a_structure_with_tools_the_model_may_call_is_refused(client: openai.OpenAI) -> None:
    error = _refusal(
        lambda: _chat(
            client, messages=QUESTION, tools=[WEATHER_TOOL], response_format={"type": "json_object"}
        )
    )
    assert error["param"] == "tool_choice"
    assert "cannot be combined" in error["message"]


def test_a_named_function_that_is_not_offered_is_refused(client: openai.OpenAI) -> None:
    error = _refusal(
        lambda: _chat(
            client,
            messages=QUESTION,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "function", "function": {"name": "launch"}},
        )
    )
    assert error["param"] == "tool_choice"
    assert "'launch'" in error["message"]


# The Responses API.


def test_responses_text_format_json_schema_streamed_and_not(client: openai.OpenAI) -> None:
    schema = STRICT_PAINTING
    text = {"format": {"type": "json_schema", "name": "painting", "schema": schema}}
    whole = client.responses.create(
        model=MODEL_NAME, input="Describe a painting.", text=text, max_output_tokens=120
    )
    jsonschema.validate(json.loads(whole.output_text), schema)
    assert whole.text.format.type == "json_schema"
    events = list(
        client.responses.create(
            model=MODEL_NAME,
            input="Describe a painting.",
            text=text,
            max_output_tokens=120,
            stream=True,
        )
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    jsonschema.validate(json.loads(deltas), schema)
    parsed = client.responses.parse(
        model=MODEL_NAME, input="Describe a painting.", text_format=Painting, max_output_tokens=120
    )
    assert isinstance(parsed.output_parsed, Painting)


def test_responses_forced_function_call(client: openai.OpenAI) -> None:
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    response = client.responses.create(
        model=MODEL_NAME,
        input="Weather in Oslo?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=80,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


# LangChain, a second real client.


def test_langchain_structured_output_and_bound_tools(served: RunningServer) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=MODEL_NAME,
        base_url=f"{served.url}/v1",
        api_key=served.token(),
        max_retries=0,
        max_tokens=120,
        http_client=httpx.Client(verify=served.tls_context()),
    )
    painting = llm.with_structured_output(Painting, method="json_schema").invoke(
        "Describe the Mona Lisa."
    )
    assert isinstance(painting, Painting)
    bound = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    message = bound.invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER_PARAMETERS)
