"""gpt-oss's harmony format as users see it: OpenAI's own client against the real server
(uvicorn, TLS), serving a tiny gpt-oss directory (tests/appliance/api/harmony_model.py) whose
network is scripted (scripted_model.py) to answer with harmony token ids, so the server picks
harmony by architecture, renders the prompt with the library and parses the output's tokens
through chat completions and the Responses API, whole and streamed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from openai_harmony import HarmonyEncoding, HarmonyEncodingName, load_harmony_encoding

from appliance.api.harmony import HarmonyFormat
from appliance.api.models import ServedModel
from appliance.api.schemas import ChatMessage, FunctionTool
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import ModelLoadError
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.harmony_model import write_harmony_model
from tests.appliance.api.scripted_model import ScriptedModel
from tests.appliance.api.test_tool_calls import RESPONSES_WEATHER_TOOL, WEATHER_TOOL

QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user wants the weather in Paris."
ANSWER = "It is sunny in Paris."
ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
FINAL = f"<|start|>assistant<|channel|>final<|message|>{ANSWER}<|return|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Paris"}<|call|>'
)


@pytest.fixture(scope="module")
def encoding() -> HarmonyEncoding:
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


@pytest.fixture(scope="module")
def gpt_oss_dir(encoding: HarmonyEncoding, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_harmony_model(encoding, tmp_path_factory.mktemp("gpt-oss"))


@pytest.fixture(scope="module")
def scripted(gpt_oss_dir: Path) -> ScriptedModel:
    return ScriptedModel(gpt_oss_dir, Tokenizer.from_model_dir(gpt_oss_dir))


@pytest.fixture(scope="module")
def server(
    gpt_oss_dir: Path, scripted: ScriptedModel, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    config = EngineConfig(
        model_dir=gpt_oss_dir,
        max_model_len=1024,
        num_kv_blocks=128,
        enable_prefix_caching=False,  # the scripted model needs every prompt from position 0
        num_cpu_threads=len(os.sched_getaffinity(0)),
    )
    engine = Engine.build(config, scripted, scripted._tokenizer)  # type: ignore[arg-type]
    settings = make_settings(tmp_path_factory.mktemp("tls-harmony"), gpt_oss_dir)
    with running_server(settings, engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _say(scripted: ScriptedModel, encoding: HarmonyEncoding, *replies: str) -> None:
    scripted.say_tokens(*(encoding.encode(r, allowed_special="all") for r in replies))


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", QUESTION)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def _prompt_length(
    encoding: HarmonyEncoding,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    effort: Any = None,
) -> int:
    """The length of the prompt the harmony library renders for a request (today's date)."""
    return len(
        HarmonyFormat(encoding).render(
            [ChatMessage.model_validate(m) for m in messages],
            tools=None if tools is None else [FunctionTool.model_validate(t) for t in tools],
            reasoning_effort=effort,
            today=datetime.now(UTC).date(),
            param="messages",
        )
    )


# Chat completions.


def test_the_analysis_channel_comes_back_as_reasoning_and_the_final_one_as_content(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + FINAL)
    response = _chat(client, reasoning_effort="high")
    [choice] = response.choices
    assert (choice.message.reasoning, choice.message.content) == (THOUGHT, ANSWER)
    assert choice.finish_reason == "stop"
    assert response.usage.prompt_tokens == _prompt_length(encoding, QUESTION, effort="high")
    reply = encoding.encode(ANALYSIS + FINAL, allowed_special="all")
    assert response.usage.completion_tokens == len(reply)


def test_a_call_comes_back_as_tool_calls_and_its_result_goes_back_to_the_model(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + CALL, FINAL)
    first = _chat(client, tools=[WEATHER_TOOL])
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.reasoning == THOUGHT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert first.usage.prompt_tokens == _prompt_length(encoding, QUESTION, [WEATHER_TOOL])

    conversation = [
        *QUESTION,
        {"role": "assistant", "content": None, "reasoning": THOUGHT,
         "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]  # fmt: skip
    second = _chat(client, messages=conversation, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == ANSWER
    # The server rendered the whole conversation (thought, call, result) as the library does.
    assert second.usage.prompt_tokens == _prompt_length(encoding, conversation, [WEATHER_TOOL])


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], str | None]:
    deltas, finish_reason = [], None
    for chunk in _chat(client, stream=True, **kwargs):
        [choice] = chunk.choices
        deltas.append(choice.delta)
        finish_reason = choice.finish_reason or finish_reason
    return deltas, finish_reason


def test_a_stream_sends_reasoning_deltas_then_content_deltas(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + FINAL)
    deltas, finish_reason = _streamed(client)
    reasoning = [d.reasoning for d in deltas if getattr(d, "reasoning", None)]
    content = [d.content for d in deltas if d.content]
    assert "".join(reasoning) == THOUGHT and len(reasoning) > 1
    assert "".join(content) == ANSWER and len(content) > 1
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(i < first_answer for i, d in enumerate(deltas) if getattr(d, "reasoning", None))
    assert finish_reason == "stop"


def test_a_stream_sends_a_call_whole_once_it_is_complete(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + CALL)
    deltas, finish_reason = _streamed(client, tools=[WEATHER_TOOL])
    parts = [part for d in deltas for part in d.tool_calls or ()]
    assert parts[0].function.name == "get_weather" and parts[0].id.startswith("call_")
    assert json.loads("".join(p.function.arguments or "" for p in parts)) == {"city": "Paris"}
    assert not any(d.content for d in deltas)
    assert finish_reason == "tool_calls"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}},
         "chat_template_kwargs"),
    ],
    ids=["unknown-effort", "forced-call", "structure", "logprobs", "template-kwargs"],
)  # fmt: skip
def test_what_the_harmony_format_cannot_honour_is_refused_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, **fields)
    assert refused.value.body["param"] == param  # type: ignore[index]


# The Responses API.


def test_responses_give_a_reasoning_item_and_a_message(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + FINAL)
    response = client.responses.create(model=MODEL_NAME, input="What is the weather in Paris?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [p.text for p in reasoning.content] == [THOUGHT]
    assert message.type == "message" and response.output_text == ANSWER


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [RESPONSES_WEATHER_TOOL], "tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
    ],
    ids=["forced-call", "structure"],
)
def test_responses_refuse_by_name_what_the_harmony_format_cannot_honour(
    client: openai.OpenAI, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_NAME, input="What is the weather?", **fields)
    assert refused.value.body["param"] == param  # type: ignore[index]


def test_responses_stream_a_call_and_take_its_output_back(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + CALL, FINAL)
    events = list(
        client.responses.create(
            model=MODEL_NAME, input=QUESTION, tools=[RESPONSES_WEATHER_TOOL], stream=True
        )
    )
    reasoning, call = events[-1].response.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    final = client.responses.create(
        model=MODEL_NAME,
        input=[*QUESTION, reasoning, call, result],  # type: ignore[list-item]
        tools=[RESPONSES_WEATHER_TOOL],  # type: ignore[list-item]
    )
    assert final.output_text == ANSWER


# Settings.


@pytest.mark.parametrize("field", ["tool_parser", "reasoning_parser"])
def test_a_parser_setting_for_gpt_oss_is_refused_at_start(
    gpt_oss_dir: Path, tmp_path: Path, field: str
) -> None:
    settings = make_settings(tmp_path, gpt_oss_dir).model
    value = {"tool_parser": "hermes", "reasoning_parser": "qwen3"}[field]
    with pytest.raises(ModelLoadError, match=rf"model\.{field} is '{value}'.*harmony"):
        ServedModel.from_settings(MODEL_NAME, settings.model_copy(update={field: value}), 0)


def test_responses_take_the_reasoning_effort(
    client: openai.OpenAI, scripted: ScriptedModel, encoding: HarmonyEncoding
) -> None:
    _say(scripted, encoding, ANALYSIS + FINAL)
    response = client.responses.create(
        model=MODEL_NAME, input=QUESTION, reasoning={"effort": "low"}
    )
    assert response.reasoning is not None and response.reasoning.effort == "low"
    assert response.usage is not None
    assert response.usage.input_tokens == _prompt_length(encoding, QUESTION, effort="low")
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_NAME, input=QUESTION, reasoning={"effort": "max"})  # type: ignore[typeddict-item]
    assert refused.value.body["param"] == "reasoning.effort"  # type: ignore[index]
