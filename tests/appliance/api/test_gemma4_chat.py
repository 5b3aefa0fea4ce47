"""Gemma 4's reasoning and tool calls as users see them: OpenAI's own client against the real
server, on an engine whose network is scripted (tests/appliance/api/scripted_model.py). The
tokenizer is SmolLM2's with Gemma 4's markers added as special tokens, as Gemma 4's own
tokenizer has them, and the chat template writes Gemma 4's notation
(chat_templates/gemma4_tools_minimal.jinja). The settings name the `gemma4` formats (the model
directory is SmolLM2's Llama; a Gemma 4 architecture chooses them by itself,
test_reasoning_parsers.py), so the output must be decoded with special tokens kept: the usual
decode drops every marker, and nothing could be parsed."""

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
from tests.appliance.api.chat_templates import TEMPLATES
from tests.appliance.api.conftest import MODEL_NAME, make_settings, running_server
from tests.appliance.api.scripted_model import ScriptedModel
from tests.appliance.api.test_tool_calls import WEATHER_TOOL

MARKERS = ("<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
           '<|"|>', "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>")  # fmt: skip
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
THOUGHT = "The user wants the weather.\nI should call the tool."
REPLY = (
    f"<|channel>thought\n{THOUGHT}<channel|>"
    '<|tool_call>call:get_weather{city:<|"|>Paris, France<|"|>}<tool_call|>'
)


@pytest.fixture(scope="module")
def gemma4_dir(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's directory with Gemma 4's markers as added special tokens (ids past its
    vocabulary, which config.json's vocab_size then covers) and the Gemma 4 template."""
    out = tmp_path_factory.mktemp("gemma4-chat")
    edited = ("tokenizer.json", "tokenizer_config.json", "config.json")
    for item in smollm2_dir.iterdir():
        if item.name not in edited:
            (out / item.name).symlink_to(item)
    tokenizer = json.loads((smollm2_dir / "tokenizer.json").read_text())
    config = json.loads((smollm2_dir / "config.json").read_text())
    first_id = config["vocab_size"]
    tokenizer["added_tokens"] += [
        {"id": first_id + i, "content": marker, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, marker in enumerate(MARKERS)
    ]  # fmt: skip
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    config["vocab_size"] = first_id + len(MARKERS)
    (out / "config.json").write_text(json.dumps(config))
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = (TEMPLATES / "gemma4_tools_minimal.jinja").read_text()
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return out


@pytest.fixture(scope="module")
def tokenizer(gemma4_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(gemma4_dir)


@pytest.fixture(scope="module")
def scripted(gemma4_dir: Path, tokenizer: Tokenizer) -> ScriptedModel:
    return ScriptedModel(gemma4_dir, tokenizer)


@pytest.fixture(scope="module")
def client(
    gemma4_dir: Path,
    scripted: ScriptedModel,
    tokenizer: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[openai.OpenAI]:
    config = EngineConfig(
        model_dir=gemma4_dir,
        max_model_len=1024,
        num_kv_blocks=256,
        enable_prefix_caching=False,  # the scripted model needs every prompt from position 0
        num_cpu_threads=len(os.sched_getaffinity(0)),
    )
    engine = Engine.build(config, scripted, tokenizer)  # type: ignore[arg-type]
    settings = make_settings(tmp_path_factory.mktemp("tls-gemma4"), gemma4_dir)
    formats = {"tool_parser": "gemma4", "reasoning_parser": "gemma4"}
    settings = settings.model_copy(update={"model": settings.model.model_copy(update=formats)})
    with running_server(settings, engine) as running:
        yield running.client()


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=QUESTION, tools=[WEATHER_TOOL], **kwargs
    )


def test_the_markers_are_special_tokens_the_usual_decode_drops(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode(REPLY)
    assert "<|tool_call>" not in tokenizer.decode(ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == REPLY


def test_gemma4_thought_and_call_come_back_as_reasoning_and_a_tool_call(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(REPLY)
    choice = _chat(client).choices[0]
    assert choice.message.reasoning == THOUGHT
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris, France"}
    assert not choice.message.content
    assert choice.finish_reason == "tool_calls"


def test_a_gemma4_stream_sends_reasoning_then_the_call(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say(REPLY)
    deltas = []
    for chunk in _chat(client, stream=True):
        deltas += [choice.delta for choice in chunk.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == THOUGHT
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    arguments = "".join(call.function.arguments or "" for call in calls)
    assert json.loads(arguments) == {"city": "Paris, France"}
    assert not "".join(d.content or "" for d in deltas)


def test_a_gemma4_answer_without_a_thought_is_all_content(
    client: openai.OpenAI, scripted: ScriptedModel
) -> None:
    scripted.say("It is sunny in Paris.")
    choice = _chat(client).choices[0]
    assert choice.message.content == "It is sunny in Paris."
    assert not getattr(choice.message, "reasoning", None)
    assert not choice.message.tool_calls
