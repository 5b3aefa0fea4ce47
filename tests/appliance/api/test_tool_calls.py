"""Tool calling and the Responses API as users drive them: OpenAI's own client against the real
server (uvicorn, TLS). The tool-call tests run on an engine whose network is scripted
(tests/appliance/api/scripted_model.py) and whose chat template is Qwen2.5's (Hermes tool
calls), so the model's calls are known in advance: the embedded 135M model rarely writes one
by itself. The last tests run on the embedded model itself, whose template has no tool
support."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.scripted_model import ScriptedModel
from tests.appliance.api.test_audit_trail import AuditDatabase

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
RESPONSES_WEATHER_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is sunny in Paris."


@pytest.fixture(scope="module")
def tokenizer(qwen_template_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(qwen_template_dir)


@pytest.fixture(scope="module")
def scripted(qwen_template_dir: Path, tokenizer: Tokenizer) -> ScriptedModel:
    return ScriptedModel(qwen_template_dir, tokenizer)


@pytest.fixture(scope="module")
def tool_server(
    qwen_template_dir: Path,
    scripted: ScriptedModel,
    tokenizer: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    config = EngineConfig(
        model_dir=qwen_template_dir,
        max_model_len=1024,
        num_kv_blocks=256,
        enable_prefix_caching=False,  # the scripted model needs every prompt from position 0
        num_cpu_threads=len(os.sched_getaffinity(0)),
    )
    engine = Engine.build(config, scripted, tokenizer)  # type: ignore[arg-type]
    settings = make_settings(tmp_path_factory.mktemp("tls-tools"), qwen_template_dir)
    with running_server(settings, engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(tool_server: RunningServer) -> openai.OpenAI:
    return tool_server.client()


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", QUESTION)
    kwargs.setdefault("tools", [WEATHER_TOOL])
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def _refusal(call: Any) -> dict[str, Any]:
    with pytest.raises(openai.BadRequestError) as refused:
        call()
    return refused.value.body  # type: ignore[return-value]


# Chat completions.


def test_tool_call_round_trip_call_then_result_then_final_answer(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(CALL, ANSWER)
    first = _chat(client).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.content is None
    [call] = first.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    # The client's own message object goes back, then the tool's result.
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}
    final = _chat(client, messages=[*QUESTION, first.message, result])
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == ANSWER
    assert final.choices[0].message.tool_calls is None
    # The model saw the tools, its own call and the result, as Qwen2.5's template shows them.
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}  # fmt: skip
    prompt = tokenizer.apply_chat_template(
        [*QUESTION, assistant, result], add_generation_prompt=True, tools=[WEATHER_TOOL]
    )
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in prompt
    assert final.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_streamed_tool_call_deltas_are_assembled_by_the_client(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say("Let me look that up. " + CALL)
    with client.chat.completions.stream(
        model=MODEL_NAME, messages=QUESTION, tools=[WEATHER_TOOL]
    ) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look that up. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    # OpenAI's delta shape: the call's first delta names it, the next carry its arguments.
    tool_deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    [head], *rest = tool_deltas
    assert (head.index, head.id, head.type) == (0, call.id, "function")
    assert (head.function.name, head.function.arguments) == ("get_weather", "")
    assert all(d.id is None and d.function.name is None for [d] in rest)
    assert "".join(d.function.arguments for [d] in rest) == call.function.arguments
    # No piece of the call's markup leaked into the content.
    assert "<tool" not in "".join(c.choices[0].delta.content or "" for c in chunks)


def test_several_calls_are_indexed_and_parallel_tool_calls_false_keeps_the_first(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    second = CALL.replace("Paris", "Oslo")
    scripted.say(CALL + "\n" + second, CALL + "\n" + second)
    both = _chat(client).choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in both] == ["Paris", "Oslo"]
    assert len({c.id for c in both}) == 2
    [first] = _chat(client, parallel_tool_calls=False).choices[0].message.tool_calls
    assert json.loads(first.function.arguments) == {"city": "Paris"}


def test_call_text_that_is_not_a_valid_call_comes_back_as_content(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    malformed = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    unknown = CALL.replace("get_weather", "delete_files")
    for text in (malformed, unknown):
        scripted.say(text, text)
        reply = _chat(client).choices[0]
        assert (reply.finish_reason, reply.message.content) == ("stop", text)
        assert reply.message.tool_calls is None
        streamed = _chat(client, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == text


def test_tool_choice_none_leaves_the_tools_out_and_parses_nothing(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(CALL)
    reply = _chat(client, tool_choice="none")
    assert reply.choices[0].message.content == CALL
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens == len(tokenizer.encode_chat(QUESTION))


def _tool(name: str, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(
    ("tools", "message"),
    [
        ([_tool("f", {}), _tool("f", {})], "function 'f' is defined twice"),
        ([_tool("f", _nested(17))], "tools[0].parameters: nested deeper than 16 levels"),
        ([_tool("f", {"description": "x" * 17_000})], "larger than 16384 bytes"),
        ([_tool(f"f{i}", {}) for i in range(65)], "at most 64 items"),
        ([_tool("no spaces", {})], "should match pattern"),
    ],
    ids=["duplicate", "too_deep", "too_large", "too_many", "bad_name"],
)
def test_tool_definitions_out_of_bounds_are_refused_naming_the_field(
    client: openai.OpenAI, tools: list[dict[str, Any]], message: str
) -> None:
    error = _refusal(lambda: _chat(client, tools=tools))
    assert error["param"].startswith("tools")
    assert message in error["message"]


def test_tool_choice_without_tools_is_refused(client: openai.OpenAI) -> None:
    assert _refusal(lambda: _chat(client, tools=None, tool_choice="auto"))["param"] == "tool_choice"


def test_a_conversation_over_the_message_limit_is_refused(client: openai.OpenAI) -> None:
    error = _refusal(lambda: _chat(client, messages=QUESTION * 1025))
    assert error["param"] == "messages"
    assert "at most 1024 items" in error["message"]


def test_logprobs_with_tools_are_refused(client: openai.OpenAI) -> None:
    assert _refusal(lambda: _chat(client, logprobs=True))["param"] == "logprobs"


def test_tool_messages_must_name_their_call(client: openai.OpenAI) -> None:
    orphan = {"role": "tool", "content": "42"}
    error = _refusal(lambda: _chat(client, messages=[*QUESTION, orphan]))
    assert "tool_call_id" in error["message"]


def test_requests_with_tools_are_counted_by_endpoint(
    client: openai.OpenAI, scripted: ScriptedModel, tool_server: RunningServer
) -> None:
    def count(endpoint: str) -> float:
        return tool_server.metric("inferno:tool_requests_total", endpoint=endpoint)

    before = count("/v1/chat/completions"), count("/v1/responses")
    scripted.say(ANSWER, ANSWER, ANSWER)
    _chat(client)
    _chat(client, tools=None)  # no tools: not counted
    client.responses.create(model=MODEL_NAME, input="Weather?", tools=[RESPONSES_WEATHER_TOOL])
    assert (count("/v1/chat/completions"), count("/v1/responses")) == (before[0] + 1, before[1] + 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("audio", {"voice": "alloy", "format": "mp3"}),
        ("modalities", ["text", "audio"]),
        ("reasoning_effort", "high"),
        ("web_search_options", {}),
        ("functions", [WEATHER_TOOL["function"]]),
        ("service_tier", "flex"),
    ],
)
def test_standard_chat_fields_not_honoured_are_refused_by_name_not_as_unrecognized(
    client: openai.OpenAI, field: str, value: Any
) -> None:
    error = _refusal(lambda: _chat(client, tools=None, **{field: value}))
    assert error["param"] == field
    assert error["code"] == "unsupported_parameter"
    assert "Unrecognized" not in error["message"]


def test_chat_fields_asking_for_what_the_appliance_does_are_accepted(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(ANSWER)
    reply = _chat(client, tools=None, modalities=["text"], service_tier="auto")
    assert reply.choices[0].message.content == ANSWER


# The Responses API.


def test_responses_answers_text_with_usage(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(ANSWER)
    response = client.responses.create(
        model=MODEL_NAME, input="What is the weather?", instructions="Be brief."
    )
    assert response.status == "completed"
    assert response.output_text == ANSWER
    assert response.store is False
    [message] = response.output
    assert (message.type, message.role, message.status) == ("message", "assistant", "completed")
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather?"},
    ]
    assert response.usage.input_tokens == len(tokenizer.encode_chat(conversation))
    assert response.usage.output_tokens == len(tokenizer.encode(ANSWER)) + 1  # and the EOS
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens


def test_responses_stops_incomplete_at_max_output_tokens(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(ANSWER)
    response = client.responses.create(model=MODEL_NAME, input="Weather?", max_output_tokens=2)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_responses_function_call_round_trip_streamed_and_not(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(CALL)
    first = client.responses.create(
        model=MODEL_NAME, input=QUESTION[0]["content"], tools=[RESPONSES_WEATHER_TOOL]
    )
    [call] = first.output
    assert (call.type, call.name, call.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_")

    scripted.say(ANSWER)
    followup = [
        {"role": "user", "content": QUESTION[0]["content"]},
        call.model_dump(exclude_none=True),  # the item as the client got it
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "clear"}'},
    ]
    events = list(
        client.responses.create(
            model=MODEL_NAME, input=followup, tools=[RESPONSES_WEATHER_TOOL], stream=True
        )
    )
    types = [event.type for event in events]
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * types.count("response.output_text.delta"),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed",
    ]  # fmt: skip
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == ANSWER
    assert events[-1].response.output_text == ANSWER
    assert events[-1].response.usage.output_tokens > 0


def test_responses_streams_a_function_call_as_its_item_and_argument_events(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say("Checking. " + CALL)
    events = list(
        client.responses.create(
            model=MODEL_NAME, input="Weather?", tools=[RESPONSES_WEATHER_TOOL], stream=True
        )
    )
    [added] = [
        e for e in events if e.type == "response.output_item.added" and e.item.type != "message"
    ]
    assert added.output_index == 1  # after the message "Checking. "
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Paris"}
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done.arguments == arguments and done.item_id == added.item.id
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"store": True}, "store", "keeps no conversation state"),
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no conversation"),
        ({"reasoning": {"effort": "high"}}, "reasoning", "no reasoning effort or summary controls"),
        ({"truncation": "auto"}, "truncation", "'auto' is not supported"),
        ({"text": {"verbosity": "low"}}, "text.verbosity", "no verbosity control"),
    ],
)
def test_responses_refuses_what_the_appliance_does_not_do_by_name(
    client: openai.OpenAI, fields: dict[str, Any], param: str, words: str
) -> None:
    error = _refusal(lambda: client.responses.create(model=MODEL_NAME, input="Hi", **fields))
    assert error["param"] == param
    assert words in error["message"]


def test_responses_accepts_store_false(client: openai.OpenAI, scripted: ScriptedModel) -> None:
    scripted.say(ANSWER)
    assert client.responses.create(model=MODEL_NAME, input="Hi", store=False).store is False


def test_a_responses_request_is_audited_like_a_chat(
    tool_server: RunningServer, scripted: ScriptedModel
) -> None:
    db = AuditDatabase(tool_server)
    scripted.say(ANSWER)
    with tool_server.http() as http:
        response = http.post("/v1/responses", json={"model": MODEL_NAME, "input": "Hi"})
    assert response.status_code == 200, response.text
    _, index, _ = response.headers["audit-entry"].split(" ")
    accepted = db.entry(int(index))
    assert accepted["action"] == "inference.request"
    assert accepted["details"]["endpoint"] == "/v1/responses"
    assert accepted["request_id"] == response.json()["id"]
    prompt = {"messages": [{"role": "user", "content": "Hi"}]}
    assert db.committer.matches("prompt", prompt, accepted["details"]["prompt_commitment"])
    ending = db.ending(response.json()["id"])
    assert ending["outcome"] == "success"
    assert db.committer.matches("response", [ANSWER], ending["details"]["response_commitment"])


def test_a_chat_with_tools_commits_to_the_tools_and_the_calls_markup(
    tool_server: RunningServer, scripted: ScriptedModel
) -> None:
    db = AuditDatabase(tool_server)
    scripted.say(CALL)
    body = {"model": MODEL_NAME, "messages": QUESTION, "tools": [WEATHER_TOOL]}
    with tool_server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    _, index, _ = response.headers["audit-entry"].split(" ")
    accepted = db.entry(int(index))
    prompt = {"messages": QUESTION, "tools": [WEATHER_TOOL]}
    assert db.committer.matches("prompt", prompt, accepted["details"]["prompt_commitment"])
    ending = db.ending(response.json()["id"])
    # What the model generated, not the parsed call: the record of its output.
    assert db.committer.matches("response", [CALL], ending["details"]["response_commitment"])


def test_a_streamed_response_logs_its_end_before_response_completed(
    tool_server: RunningServer, scripted: ScriptedModel
) -> None:
    db = AuditDatabase(tool_server)
    scripted.say(ANSWER)
    body = {"model": MODEL_NAME, "input": "Hi", "stream": True}
    with tool_server.http() as http, http.stream("POST", "/v1/responses", json=body) as stream:
        assert stream.status_code == 200
        lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
    final = json.loads(lines[-1][6:])
    assert final["type"] == "response.completed"
    assert db.ending(final["response"]["id"], timeout_s=0)["outcome"] == "success"


# The embedded model, whose own template has no tool support.


def test_tools_are_refused_for_a_model_whose_template_cannot_show_them(
    server: RunningServer,
) -> None:
    client = server.client()
    error = _refusal(lambda: _chat(client))
    assert error["param"] == "tools"
    assert f"model {MODEL_NAME!r} has no tool support" in error["message"]
    result = {"role": "tool", "tool_call_id": "call_1", "content": "42"}
    error = _refusal(lambda: _chat(client, tools=None, messages=[*QUESTION, result]))
    assert error["param"] == "messages[1]"
    output = {"type": "function_call_output", "call_id": "call_1", "output": "42"}
    error = _refusal(
        lambda: client.responses.create(model=MODEL_NAME, input=[*QUESTION, output])  # type: ignore[list-item]
    )
    assert error["param"] == "input"
    assert f"model {MODEL_NAME!r}" in error["message"]


def test_responses_on_the_embedded_model(server: RunningServer) -> None:
    response = server.client().responses.create(
        model=MODEL_NAME, input="Name a colour.", max_output_tokens=4, temperature=0
    )
    assert response.status == "incomplete"
    assert response.usage.output_tokens == 4
    assert response.output_text


def test_embeddings_answer_404_naming_what_is_served(server: RunningServer) -> None:
    with server.http() as http:
        response: httpx.Response = http.post(
            "/v1/embeddings", json={"model": MODEL_NAME, "input": "x"}
        )
    assert response.status_code == 404
    message = response.json()["error"]["message"]
    assert "computes no embeddings" in message
    assert "/v1/chat/completions" in message and "/v1/responses" in message
