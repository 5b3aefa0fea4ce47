"""A reasoning model's thinking as users see it: OpenAI's own client against the real server
(uvicorn, TLS), on an engine whose network is scripted (tests/appliance/api/scripted_model.py)
and whose chat template is Qwen3's (tests/appliance/api/chat_templates/qwen3.jinja), so the
`qwen3` reasoning parser and the Hermes tool parser are chosen automatically. SmolLM2's
vocabulary has no `<think>` token: the tags arrive split over several tokens, as a stream
delivers them piece by piece."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.api.chat_templates import with_chat_template
from tests.appliance.api.conftest import MODEL_NAME, RunningServer, make_settings, running_server
from tests.appliance.api.scripted_model import ScriptedModel
from tests.appliance.api.test_audit_trail import AuditDatabase
from tests.appliance.api.test_tool_calls import WEATHER_TOOL

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]
THOUGHT = "The user asks for a sum.\nTwo and two make four."
ANSWER = "It is 4."
THINKING_REPLY = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(smollm2_dir, "qwen3.jinja", tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def tokenizer(qwen3_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(qwen3_dir)


@pytest.fixture(scope="module")
def scripted(qwen3_dir: Path, tokenizer: Tokenizer) -> ScriptedModel:
    return ScriptedModel(qwen3_dir, tokenizer)


@pytest.fixture(scope="module")
def server(
    qwen3_dir: Path,
    scripted: ScriptedModel,
    tokenizer: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningServer]:
    config = EngineConfig(
        model_dir=qwen3_dir,
        max_model_len=1024,
        num_kv_blocks=256,
        enable_prefix_caching=False,  # the scripted model needs every prompt from position 0
        num_cpu_threads=len(os.sched_getaffinity(0)),
    )
    engine = Engine.build(config, scripted, tokenizer)  # type: ignore[arg-type]
    settings = make_settings(tmp_path_factory.mktemp("tls-reasoning"), qwen3_dir)
    with running_server(settings, engine) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return server.client()


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    kwargs.setdefault("messages", QUESTION)
    return client.chat.completions.create(model=MODEL_NAME, **kwargs)


def _prompt_tokens(tokenizer: Tokenizer, messages: list[dict[str, Any]], **options: Any) -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, **options)))


def _streamed(client: openai.OpenAI, **kwargs: Any) -> tuple[list[Any], str | None]:
    """The deltas of a streamed chat, and its finish reason."""
    deltas, finish_reason = [], None
    for chunk in _chat(client, stream=True, **kwargs):
        [choice] = chunk.choices
        deltas.append(choice.delta)
        finish_reason = choice.finish_reason or finish_reason
    return deltas, finish_reason


def _joined(deltas: list[Any], field: str) -> str:
    return "".join(getattr(delta, field, None) or "" for delta in deltas)


# Chat completions.


def test_qwen3_thinking_comes_back_as_reasoning_apart_from_the_answer(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(THINKING_REPLY)
    choice = _chat(client).choices[0]
    assert choice.message.reasoning == THOUGHT
    assert choice.message.content == ANSWER
    assert choice.finish_reason == "stop"


def test_a_stream_sends_the_thought_as_reasoning_deltas_with_tags_split_across_tokens(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    assert len(tokenizer.encode("</think>")) > 1  # the tag is split over several outputs
    scripted.say(THINKING_REPLY)
    deltas, finish_reason = _streamed(client)
    assert _joined(deltas, "reasoning") == THOUGHT
    assert _joined(deltas, "content") == ANSWER
    assert finish_reason == "stop"
    reasoning_deltas = [d for d in deltas if getattr(d, "reasoning", None)]
    assert len(reasoning_deltas) > 1  # streamed as it is written, not held to the end
    assert not any("think>" in (d.content or "") for d in deltas)
    # Every reasoning delta comes before the first piece of the answer.
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(i < first_answer for i, d in enumerate(deltas) if getattr(d, "reasoning", None))


def test_an_output_cut_off_mid_thought_is_all_reasoning(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(THINKING_REPLY)
    choice = _chat(client, max_tokens=6).choices[0]
    assert choice.finish_reason == "length"
    assert THOUGHT.startswith(choice.message.reasoning)
    assert choice.message.content == ""


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_all_content(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(ANSWER)
    kwargs = {"enable_thinking": False}
    response = _chat(client, extra_body={"chat_template_kwargs": kwargs})
    assert response.choices[0].message.content == ANSWER
    assert getattr(response.choices[0].message, "reasoning", None) is None
    # Qwen3's template closes an empty thought in the prompt when thinking is off.
    prompt = tokenizer.apply_chat_template(QUESTION, template_kwargs=kwargs)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert response.usage.prompt_tokens > _prompt_tokens(tokenizer, QUESTION)


def test_the_audit_log_commits_to_the_template_kwargs_as_part_of_the_prompt(
    server: RunningServer, scripted: ScriptedModel
) -> None:
    scripted.say(ANSWER)
    kwargs = {"enable_thinking": False}
    body = {"model": MODEL_NAME, "messages": QUESTION, "chat_template_kwargs": kwargs}
    with server.http() as http:
        response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    _, index, _ = response.headers["audit-entry"].split(" ")
    db = AuditDatabase(server)
    prompt = {"messages": QUESTION, "chat_template_kwargs": kwargs}
    commitment = db.entry(int(index))["details"]["prompt_commitment"]
    assert db.committer.matches("prompt", prompt, commitment)


def test_thinking_then_a_tool_call_then_the_thought_sent_back_reaches_the_template(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(f"<think>\n{THOUGHT}\n</think>\n\n{CALL}", THINKING_REPLY)
    first = _chat(client, tools=[WEATHER_TOOL]).choices[0]
    assert first.finish_reason == "tool_calls"
    assert first.message.reasoning == THOUGHT
    assert first.message.content is None
    [call] = first.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )

    # The client's own message object goes back (with its `reasoning`), then the result.
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'}
    final = _chat(client, messages=[*QUESTION, first.message, result], tools=[WEATHER_TOOL])
    assert final.choices[0].message.content == ANSWER
    assistant = {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
                 "tool_calls": [{"id": call.id, "type": "function",
                                 "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]}  # fmt: skip
    messages = [*QUESTION, assistant, result]
    prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL])
    # Qwen3 shows the thought of the turn still in progress (after the last user question).
    assert f"<think>\n{THOUGHT}\n</think>" in prompt
    assert final.usage.prompt_tokens == len(tokenizer.encode(prompt))


def test_a_streamed_thought_and_tool_call(client: openai.OpenAI, scripted: ScriptedModel) -> None:
    scripted.say(f"<think>\n{THOUGHT}\n</think>\n\n{CALL}")
    deltas, finish_reason = _streamed(client, tools=[WEATHER_TOOL])
    assert finish_reason == "tool_calls"
    assert _joined(deltas, "reasoning") == THOUGHT
    assert _joined(deltas, "content") == ""
    calls = [call for delta in deltas for call in delta.tool_calls or ()]
    assert calls[0].function.name == "get_weather"
    assert json.loads(calls[1].function.arguments) == {"city": "Paris"}


def test_reasoning_content_is_accepted_on_input_as_vllm_does(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    earlier = {"role": "assistant", "content": ANSWER, "reasoning_content": THOUGHT}
    follow_up = {"role": "user", "content": "And 3 + 3?"}
    scripted.say(ANSWER)
    with_thought = _chat(client, messages=[*QUESTION, earlier, follow_up])
    # An earlier turn's thought is dropped by Qwen3's template: the prompt is the same as
    # without it, and the request is accepted under either name.
    scripted.say(ANSWER)
    renamed = {"role": "assistant", "content": ANSWER, "reasoning": THOUGHT}
    assert _chat(client, messages=[*QUESTION, renamed, follow_up]).usage == with_thought.usage
    assert with_thought.usage.prompt_tokens == _prompt_tokens(
        tokenizer, [*QUESTION, {"role": "assistant", "content": ANSWER}, follow_up]
    )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"messages": []}, "may not set messages"),
        ({"add_generation_prompt": False}, "may not set add_generation_prompt"),
        ({"enable_thinking": {"a": {"b": {"c": {"d": {}}}}}}, "nested deeper than 4"),
        ({"enable_thinking": "x" * 5000}, "larger than 4096 bytes"),
    ],
)
def test_chat_template_kwargs_breaking_a_rule_are_refused_naming_the_field(
    client: openai.OpenAI, kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, extra_body={"chat_template_kwargs": kwargs})
    error = refused.value.body
    assert error["param"] == "chat_template_kwargs"  # type: ignore[index]
    assert words in error["message"]  # type: ignore[index]


def test_reasoning_on_an_assistant_message_only(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Hi", "reasoning": THOUGHT}]
    with pytest.raises(openai.BadRequestError) as refused:
        _chat(client, messages=messages)
    assert "only an assistant message carries reasoning" in str(refused.value)


# The Responses API.


def test_responses_refuse_a_reasoning_effort_the_model_has_no_control_of(
    client: openai.OpenAI,
) -> None:
    """Qwen3's thinking is switched, not graded (gpt-oss takes an effort: test_harmony_api)."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL_NAME, input="Hi", reasoning={"effort": "low"})
    assert refused.value.body["param"] == "reasoning"  # type: ignore[index]


def test_responses_returns_the_thought_as_a_reasoning_item_before_the_message(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(THINKING_REPLY)
    response = client.responses.create(model=MODEL_NAME, input="What is 2 + 2?")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_")
    assert [part.text for part in reasoning.content] == [THOUGHT]
    assert message.type == "message"
    assert response.output_text == ANSWER
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == len(tokenizer.encode(THOUGHT))


def test_responses_streams_the_reasoning_item_then_the_message(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(THINKING_REPLY)
    events = list(client.responses.create(model=MODEL_NAME, input="What is 2 + 2?", stream=True))
    kinds = [event.type for event in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == THOUGHT
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output_text == ANSWER
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0


def test_responses_takes_a_reasoning_item_back_as_the_next_turns_thought(
    client: openai.OpenAI, scripted: ScriptedModel, tokenizer: Tokenizer
) -> None:
    scripted.say(f"<think>\n{THOUGHT}\n</think>\n\n{CALL}", THINKING_REPLY)
    tools = [{"type": "function", **WEATHER_TOOL["function"]}]
    first = client.responses.create(model=MODEL_NAME, input="Weather in Paris?", tools=tools)
    reasoning, call = first.output
    assert call.type == "function_call"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items = [{"role": "user", "content": "Weather in Paris?"}, reasoning, call, result]
    final = client.responses.create(model=MODEL_NAME, input=items, tools=tools)  # type: ignore[arg-type]
    assert final.output_text == ANSWER
    assistant = {"role": "assistant", "content": None, "reasoning_content": THOUGHT,
                 "tool_calls": [{"id": call.call_id, "type": "function",
                                 "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}}]}  # fmt: skip
    messages = [{"role": "user", "content": "Weather in Paris?"}, assistant,
                {"role": "tool", "content": "sunny", "tool_call_id": call.call_id}]  # fmt: skip
    prompt = tokenizer.apply_chat_template(messages, tools=[WEATHER_TOOL])
    assert f"<think>\n{THOUGHT}\n</think>" in prompt
    assert final.usage.input_tokens == len(tokenizer.encode(prompt))
