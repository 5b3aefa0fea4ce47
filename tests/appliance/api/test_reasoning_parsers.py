"""The `qwen3` reasoning parser on what Qwen3 writes, whole and fed in pieces of every size
(a stream splits the tags anywhere), and the automatic choice of each model's tool-call and
reasoning formats from its chat template and architecture.

The templates are vendored in tests/appliance/api/chat_templates/ (each names its source)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from appliance.api.chat_conventions import ChatConventions, choose_conventions
from appliance.api.parsed_output import ParsedOutput
from appliance.api.reasoning_parsers import (
    Gemma4ChannelParser,
    Reasoning,
    ReasoningEvent,
    ThinkTagParser,
)
from appliance.api.tool_parsers import Content
from appliance.api.tools import ChoiceCalls, ToolUse
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.api.chat_templates import TEMPLATES, with_chat_template

THOUGHT = "Two and two.\n\nThat makes four."
ANSWER = "It is 4.\n"


def _parse(
    text: str, size: int, *, thinking: bool = True, parser_class: type = ThinkTagParser
) -> list[ReasoningEvent]:
    """`text` fed in pieces of `size` characters, then finished; adjacent events of one kind
    joined (how they are split depends on the pieces, what they say must not)."""
    parser = parser_class(thinking=thinking)
    events = [e for i in range(0, len(text), size) for e in parser.feed(text[i : i + size])]
    joined: list[ReasoningEvent] = []
    for event in [*events, *parser.finish()]:
        if joined and type(joined[-1]) is type(event):
            joined[-1] = type(event)(joined[-1].text + event.text)
        else:
            joined.append(event)
    return joined


SIZES = [1, 2, 3, 5, 8, 10_000]


@pytest.mark.parametrize("size", SIZES)
def test_a_thought_and_its_answer_are_split_without_tags_or_template_newlines(size: int) -> None:
    text = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"
    assert _parse(text, size) == [Reasoning(THOUGHT), Content(ANSWER)]


@pytest.mark.parametrize("size", SIZES)
def test_a_thought_opened_in_the_prompt_needs_only_its_closing_tag(size: int) -> None:
    # Qwen3-Thinking-2507 and QwQ: the template ends the prompt with `<think>\n`.
    assert _parse(f"{THOUGHT}\n</think>\n\n{ANSWER}", size) == [
        Reasoning(THOUGHT),
        Content(ANSWER),
    ]


@pytest.mark.parametrize("size", SIZES)
def test_an_output_cut_off_before_the_thought_closes_is_all_reasoning(size: int) -> None:
    assert _parse(f"<think>\n{THOUGHT}\n</thi", size) == [Reasoning(f"{THOUGHT}\n</thi")]


@pytest.mark.parametrize("text", ["", "\n", "<thi", "<think>", "<think>\n\n"])
def test_an_output_cut_off_before_any_thought_gives_nothing(text: str) -> None:
    assert _parse(text, 1) == []


@pytest.mark.parametrize("size", SIZES)
def test_with_thinking_off_everything_is_the_answer(size: int) -> None:
    assert _parse(f"\n\n{ANSWER}", size, thinking=False) == [Content(ANSWER)]


def test_an_empty_thought_gives_only_the_answer() -> None:
    assert _parse(f"<think>\n\n</think>\n\n{ANSWER}", 1) == [Content(ANSWER)]


def test_tags_inside_the_answer_are_the_answers_text() -> None:
    answer = "Write <think> and </think> around it."
    assert _parse(f"<think>{THOUGHT}</think>{answer}", 4) == [
        Reasoning(THOUGHT),
        Content(answer),
    ]


def test_the_thought_streams_as_it_is_written_holding_back_only_a_possible_tag() -> None:
    parser = ThinkTagParser(thinking=True)
    assert parser.feed("<think>\nTwo") == [Reasoning("Two")]
    assert parser.feed(" and two.\n</th") == [Reasoning(" and two.")]
    assert parser.feed("ink>\n\nFour") == [Content("Four")]
    assert parser.finish() == []


# The format each family writes, chosen automatically.


def _template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize(
    ("architectures", "template", "expected"),
    [
        (["Qwen3ForCausalLM"], "qwen3.jinja", ChatConventions("hermes", "qwen3")),
        (["Qwen2ForCausalLM"], "qwen2_5_instruct.jinja", ChatConventions("hermes", None)),
        (["LlamaForCausalLM"], "llama3_1_instruct.jinja", ChatConventions("llama3_json", None)),
        (["GraniteForCausalLM"], "granite_3_1_instruct.jinja", ChatConventions("granite", None)),
        (["Phi3ForCausalLM"], "phi4_mini_tools.jinja", ChatConventions("phi4_mini_json", None)),
        (["Gemma4ForCausalLM"], "gemma4_tools_minimal.jinja", ChatConventions("gemma4", "gemma4")),
    ],
)
def test_each_familys_formats_are_chosen_from_its_template(
    architectures: list[str], template: str, expected: ChatConventions
) -> None:
    assert choose_conventions(architectures, _template(template)) == expected


PHI4_MINI_OWN_TEMPLATE = (  # microsoft/Phi-4-mini-instruct's tokenizer_config.json
    "{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
    "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + "
    "'<|tool|>' + message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + "
    "message['role'] + '|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if "
    "add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)


def test_an_architecture_decides_when_its_template_names_no_format() -> None:
    chosen = choose_conventions(["Phi3ForCausalLM"], PHI4_MINI_OWN_TEMPLATE)
    assert chosen == ChatConventions("phi4_mini_json", None)
    assert choose_conventions(["MistralForCausalLM"], PHI4_MINI_OWN_TEMPLATE).tool_format is None


def test_the_settings_override_the_automatic_choice() -> None:
    qwen3 = _template("qwen3.jinja")
    assert choose_conventions(
        ["Qwen3ForCausalLM"], qwen3, tool_parser="none", reasoning_parser="none"
    ) == ChatConventions(None, None)
    # A model that always thinks, whose template has no switch, is named in the settings.
    assert choose_conventions(
        ["Qwen2ForCausalLM"], _template("qwen2_5_instruct.jinja"), reasoning_parser="qwen3"
    ) == ChatConventions("hermes", "qwen3")


def test_thinking_is_off_only_when_the_request_says_enable_thinking_false() -> None:
    conventions = ChatConventions("hermes", "qwen3")
    for kwargs, thinking in (({}, True), ({"enable_thinking": True}, True),
                             ({"enable_thinking": False}, False)):  # fmt: skip
        make = conventions.reasoning(kwargs, constrained=False)
        assert make is not None
        assert make().feed("Four") == [Reasoning("Four") if thinking else Content("Four")]
    # A grammar constrains the output from its first token: there is no thought to parse.
    assert conventions.reasoning({}, constrained=True) is None
    assert ChatConventions("hermes", None).reasoning({}, constrained=False) is None


@pytest.mark.parametrize("size", [1, 4, 10_000])
def test_a_thought_then_calls_as_qwen3s_template_renders_them_parse_into_both(
    smollm2_dir: Path, tmp_path: Path, size: int
) -> None:
    """What Qwen3's own template writes for an assistant turn that thought, then called two
    tools: the text the model learnt to generate, through both parsers in turn."""
    tokenizer = Tokenizer.from_model_dir(with_chat_template(smollm2_dir, "qwen3.jinja", tmp_path))
    tools = [{"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
             for name in ("get_weather", "get_time")]  # fmt: skip
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Zürich"})]
    assistant = {
        "role": "assistant",
        "content": None,
        "reasoning_content": THOUGHT,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    question = [{"role": "user", "content": "Weather and time in Paris?"}]
    prompt = tokenizer.apply_chat_template(question, tools=tools)
    whole = tokenizer.apply_chat_template(
        [*question, assistant], add_generation_prompt=False, tools=tools
    )
    reply = whole.removeprefix(prompt).removesuffix("<|im_end|>\n")
    assert reply.startswith("<think>\n") and "</think>\n\n<tool_call>" in reply

    parsed = ParsedOutput(
        ThinkTagParser(thinking=True),
        ChoiceCalls(ToolUse(tools, frozenset({"get_weather", "get_time"}), "hermes", True)),
    )
    events = [e for i in range(0, len(reply), size) for e in parsed.events(
        reply[i : i + size], (), finished=i + size >= len(reply))]  # fmt: skip
    thought = "".join(e.text for e in events if isinstance(e, Reasoning))
    assert thought == THOUGHT
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert not [e for e in events if isinstance(e, Content)]


def _gemma4(text: str, size: int) -> list[ReasoningEvent]:
    return _parse(text, size, parser_class=Gemma4ChannelParser)


@pytest.mark.parametrize("size", SIZES)
def test_gemma4_thought_channel_and_answer_are_split_without_tags_or_label(size: int) -> None:
    # What Gemma 4 writes with enable_thinking after its generation prompt, `<|turn>model\n`.
    text = f"<|channel>thought\n{THOUGHT}<channel|>{ANSWER}"
    assert _gemma4(text, size) == [Reasoning(THOUGHT), Content(ANSWER)]


@pytest.mark.parametrize("size", SIZES)
def test_gemma4_output_without_a_channel_is_all_answer(size: int) -> None:
    # Thinking off: the prompt closes an empty channel, and the output is the answer; text
    # that only looks like the tag later on is the answer's.
    text = f"{ANSWER}<|channel>thought\n"
    assert _gemma4(text, size) == [Content(text)]


@pytest.mark.parametrize("size", SIZES)
def test_gemma4_empty_thought_gives_only_the_answer(size: int) -> None:
    assert _gemma4(f"<|channel>thought\n<channel|>{ANSWER}", size) == [Content(ANSWER)]


@pytest.mark.parametrize("size", SIZES)
def test_gemma4_output_cut_off_in_the_thought_is_all_reasoning(size: int) -> None:
    assert _gemma4(f"<|channel>thought\n{THOUGHT}<chan", size) == [Reasoning(f"{THOUGHT}<chan")]


@pytest.mark.parametrize("text", ["", "<|chan", "<|channel>", "<|channel>tho"])
def test_gemma4_output_cut_off_before_any_thought_gives_nothing(text: str) -> None:
    assert _gemma4(text, 1) == []


def test_gemma4_thought_streams_as_it_is_written_holding_back_only_a_possible_tag() -> None:
    parser = Gemma4ChannelParser(thinking=True)
    assert parser.feed("<|channel>thou") == []
    assert parser.feed("ght\nStep one. <chan") == [Reasoning("Step one. ")]
    assert parser.feed("nel|>It is") == [Content("It is")]
    assert parser.feed(" 4.") == [Content(" 4.")]
    assert parser.finish() == []


def test_gemma4_formats_decode_with_special_tokens_kept_and_others_do_not() -> None:
    """Gemma 4's markers are special tokens: chosen by architecture, its formats ask for them
    to stay in the decoded text; no other format does."""
    gemma4 = choose_conventions(["Gemma4ForConditionalGeneration"], None)
    assert gemma4 == ChatConventions("gemma4", "gemma4")
    assert gemma4.keeps_special_tokens
    assert ChatConventions("gemma4", None).keeps_special_tokens
    assert not choose_conventions(
        ["Qwen3ForCausalLM"], _template("qwen3.jinja")
    ).keeps_special_tokens
