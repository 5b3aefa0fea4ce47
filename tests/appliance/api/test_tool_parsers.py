"""The tool-call parsers on the replies each chat template itself renders for an assistant's
tool calls (the format the model was trained to write), whole and fed in pieces, and on a
hostile corpus: whatever the model writes, parsing gives calls or content and never fails.

The templates are vendored in tests/appliance/api/chat_templates/ (each names its source);
they are rendered by the server's own Tokenizer, with SmolLM2's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from appliance.api.tool_parsers import (
    PARSERS,
    Call,
    Content,
    Event,
    Gemma4Parser,
    GraniteParser,
    HermesParser,
    Llama3JsonParser,
    Phi4MiniJsonParser,
    ToolCallParser,
    format_of_template,
)
from appliance.engine.tokenizer import Tokenizer
from tests.appliance.api.chat_templates import TEMPLATES, with_chat_template

NAMES = frozenset({"get_weather", "get_time"})
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in sorted(NAMES)
]
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tokenizers(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Tokenizer]:
    """SmolLM2's tokenizer with each vendored template (only the rendered text matters here),
    and with its own (None)."""
    made: dict[str | None, Tokenizer] = {None: Tokenizer.from_model_dir(smollm2_dir)}
    for path in TEMPLATES.glob("*.jinja"):
        out = with_chat_template(smollm2_dir, path.name, tmp_path_factory.mktemp(path.stem))
        made[path.name] = Tokenizer.from_model_dir(out)
    return made  # type: ignore[return-value]


def _rendered_reply(tokenizer: Tokenizer, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """What the template shows as the assistant's turn making `calls`, after the generation
    prompt and before the end-of-turn token: the text the model learnt to generate."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tools=TOOLS)
    whole = tokenizer.apply_chat_template(
        [*QUESTION, assistant], add_generation_prompt=False, tools=TOOLS
    )
    assert whole.startswith(prompt), "the template renders the call after its generation prompt"
    reply = whole[len(prompt) :]
    for end_of_turn in ("<|im_end|>\n", "<|eot_id|>"):
        reply = reply.removesuffix(end_of_turn)
    return reply


def _parse(parser: ToolCallParser, pieces: list[str]) -> list[Event]:
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    merged: list[Event] = []
    for event in events:  # adjacent content pieces read as one text
        if isinstance(event, Content) and merged and isinstance(merged[-1], Content):
            merged[-1] = Content(merged[-1].text + event.text)
        else:
            merged.append(event)
    return merged


def _pieces(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_hermes_parser_reads_the_calls_qwen2_5_renders(
    tokenizers: dict[str, Tokenizer], size: int
) -> None:
    tokenizer = tokenizers["qwen2_5_instruct.jinja"]
    assert tokenizer.chat_template_reads_tools
    assert format_of_template(tokenizer.chat_template or "") == "hermes"
    calls = [("get_weather", {"city": "Paris"}), ("get_time", {"city": "Zürich"})]
    reply = _rendered_reply(tokenizer, calls)
    assert reply.startswith("<tool_call>")
    events = _parse(HermesParser(NAMES), _pieces(reply, size))
    parsed = [e for e in events if isinstance(e, Call)]
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls
    # Only the newline between the two calls is left as content.
    assert all(e.text.isspace() for e in events if isinstance(e, Content))


@pytest.mark.parametrize("size", [1, 2, 5, 10_000])
def test_llama3_json_parser_reads_the_call_llama3_1_renders(
    tokenizers: dict[str, Tokenizer], size: int
) -> None:
    tokenizer = tokenizers["llama3_1_instruct.jinja"]
    assert tokenizer.chat_template_reads_tools
    assert format_of_template(tokenizer.chat_template or "") == "llama3_json"
    reply = _rendered_reply(tokenizer, [("get_weather", {"city": "Paris"})])
    assert reply == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    for text in (reply, "<|python_tag|>" + reply):
        events = _parse(Llama3JsonParser(NAMES), _pieces(text, size))
        assert events == [Call("get_weather", '{"city": "Paris"}')]


GRANITE_CALLS = (
    '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
    '{"name": "get_time", "arguments": {}}]'
)


@pytest.mark.parametrize("size", [1, 2, 5, 10_000])
@pytest.mark.parametrize("marker", ["<|tool_call|>", "<tool_call>", ""])
def test_granite_parser_reads_the_json_list_its_template_asks_for(
    tokenizers: dict[str, Tokenizer], marker: str, size: int
) -> None:
    # Granite 3's template renders no calls; its system message asks for "<|tool_call|>
    # followed by a JSON list", and the decoded text drops that special token.
    tokenizer = tokenizers["granite_3_1_instruct.jinja"]
    assert tokenizer.chat_template_reads_tools
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS)
    assert "respond with <|tool_call|> followed by a JSON list" in prompt
    assert format_of_template(tokenizer.chat_template or "") == "granite"
    events = _parse(GraniteParser(NAMES), _pieces(f"{marker}{GRANITE_CALLS}", size))
    assert events == [Call("get_weather", '{"city": "Paris"}'), Call("get_time", "{}")]


@pytest.mark.parametrize("size", [1, 3, 10_000])
def test_phi4_mini_json_parser_reads_the_functools_list_its_template_asks_for(
    tokenizers: dict[str, Tokenizer], size: int
) -> None:
    tokenizer = tokenizers["phi4_mini_tools.jinja"]
    assert tokenizer.chat_template_reads_tools
    prompt = tokenizer.apply_chat_template(QUESTION, tools=TOOLS)
    assert 'formatted as functools[{"name": [function name], "arguments"' in prompt
    assert format_of_template(tokenizer.chat_template or "") == "phi4_mini_json"
    text = 'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
    events = _parse(Phi4MiniJsonParser(NAMES), _pieces(text, size))
    assert events == [Call("get_weather", '{"city": "Paris"}')]


NOT_ARRAY_CALLS = {
    "plain_text": "The weather is fine.",
    "a_list_answer": "[1, 2] are the numbers.",
    "unknown_function": '[{"name": "rm_rf", "arguments": {}}]',
    "one_bad_call_of_two": '[{"name": "get_time", "arguments": {}}, {"name": 7}]',
    "empty_list": "[]",
    "trailing_text": '[{"name": "get_time", "arguments": {}}] done',
    "truncated": '[{"name": "get_time", "argu',
    "deeply_nested": "[" * 100_000,
}


@pytest.mark.parametrize("text", NOT_ARRAY_CALLS.values(), ids=NOT_ARRAY_CALLS.keys())
@pytest.mark.parametrize("parser", [GraniteParser, Phi4MiniJsonParser])
def test_json_list_parsers_give_back_what_is_not_a_valid_call_list_as_content(
    parser: type[ToolCallParser], text: str
) -> None:
    marked = "functools" + text if parser is Phi4MiniJsonParser else text
    assert _parse(parser(NAMES), _pieces(marked, 4)) == [Content(marked)]  # type: ignore[call-arg]


def test_phi4_mini_json_needs_its_marker_and_streams_other_text_at_once() -> None:
    parser = Phi4MiniJsonParser(NAMES)
    assert parser.feed(" func") == []
    assert parser.feed("tion") == [Content(" function")]
    assert _parse(Phi4MiniJsonParser(NAMES), ['[{"name": "get_time", "arguments": {}}]']) == [
        Content('[{"name": "get_time", "arguments": {}}]')
    ]


def test_smollm2_template_has_no_tool_support(tokenizers: dict[str | None, Tokenizer]) -> None:
    tokenizer = tokenizers[None]
    assert not tokenizer.chat_template_reads_tools
    assert format_of_template(tokenizer.chat_template or "") is None


def test_every_registered_format_is_detected_from_a_vendored_template() -> None:
    detected = {format_of_template(path.read_text()) for path in TEMPLATES.glob("*.jinja")}
    assert detected == set(PARSERS)


def test_hermes_streams_text_before_a_call_and_holds_back_a_possible_tag() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed("Let me check. <tool") == [Content("Let me check. ")]
    assert parser.feed('_call>\n{"name": "get_weather", ') == []
    assert parser.feed('"arguments": {"city": "Oslo"}}\n</tool_call>') == [
        Call("get_weather", '{"city": "Oslo"}')
    ]
    assert parser.finish() == []


def test_hermes_releases_held_text_that_turns_out_not_to_be_a_tag() -> None:
    parser = HermesParser(NAMES)
    assert parser.feed("a <to") == [Content("a ")]
    assert parser.feed("p> b") == [Content("<top> b")]


def test_hermes_accepts_a_call_left_open_at_the_end_of_generation() -> None:
    events = _parse(HermesParser(NAMES), ['<tool_call>{"name": "get_time", "arguments": {}}'])
    assert events == [Call("get_time", "{}")]


def test_hermes_accepts_arguments_spelt_as_a_json_string() -> None:
    text = '<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>'
    assert _parse(HermesParser(NAMES), [text]) == [Call("get_time", '{"city": "Rome"}')]


# Hostile corpus: each is model output that looks like a call and is not one; each must come
# back as the very text the model wrote, as content.
NOT_HERMES_CALLS = {
    "malformed_json": '<tool_call>{"name": "get_time", "arguments": {</tool_call>',
    "unknown_function": '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
    "no_name": '<tool_call>{"arguments": {}}</tool_call>',
    "name_not_a_string": '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
    "arguments_not_an_object": '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
    "arguments_string_not_json": '<tool_call>{"name": "get_time", "arguments": "{"}</tool_call>',
    "not_an_object": "<tool_call>[1, 2]</tool_call>",
    "unclosed_and_malformed": '<tool_call>{"name": "get_ti',
    "deeply_nested": "<tool_call>" + "[" * 100_000 + "</tool_call>",
}


@pytest.mark.parametrize("text", NOT_HERMES_CALLS.values(), ids=NOT_HERMES_CALLS.keys())
def test_hermes_gives_back_what_is_not_a_valid_call_as_content(text: str) -> None:
    assert _parse(HermesParser(NAMES), _pieces(text, 3)) == [Content(text)]


NOT_LLAMA_CALLS = {
    "plain_text": "The weather is fine.",
    "json_not_a_call": '{"answer": 42}',
    "unknown_function": '{"name": "rm_rf", "parameters": {}}',
    "trailing_text": '{"name": "get_time", "parameters": {}} and more',
    "truncated": '{"name": "get_time", "parame',
    "deeply_nested": "[" * 100_000,
}


@pytest.mark.parametrize("text", NOT_LLAMA_CALLS.values(), ids=NOT_LLAMA_CALLS.keys())
def test_llama3_json_gives_back_what_is_not_a_valid_call_as_content(text: str) -> None:
    assert _parse(Llama3JsonParser(NAMES), _pieces(text, 4)) == [Content(text)]


def test_llama3_json_reads_calls_separated_by_semicolons() -> None:
    text = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    assert _parse(Llama3JsonParser(NAMES), [text]) == [
        Call("get_time", "{}"),
        Call("get_weather", "{}"),
    ]


def test_llama3_json_streams_plain_text_as_soon_as_it_is_not_a_call() -> None:
    parser = Llama3JsonParser(NAMES)
    assert parser.feed("  ") == []
    assert parser.feed("Hi") == [Content("  Hi")]
    assert parser.feed(" there") == [Content(" there")]


GEMMA4_ARGUMENTS = {
    "city": 'São Paulo, "SP": {north}',  # commas, colons, quotes and braces inside a string
    "days": 3,
    "threshold": -1.5,
    "metric": True,
    "hours": [6, 12, 18],
    "where": {"lat": 1.25, "names": ["a", "b,c"], "exact": False},
}


def _gemma4_reply(tokenizer: Tokenizer, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The model's part of the assistant turn the template renders for `calls`: after the
    turn's opening, up to the `<|tool_response>` stop token."""
    assistant = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": f"call_{i}", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    whole = tokenizer.apply_chat_template(
        [*QUESTION, assistant], add_generation_prompt=False, tools=TOOLS
    )
    return whole.rpartition("<|turn>model\n")[2].removesuffix("<|tool_response>")


@pytest.mark.parametrize("size", [1, 2, 3, 7, 10_000])
def test_gemma4_parser_reads_the_calls_its_template_renders(
    tokenizers: dict[str, Tokenizer], size: int
) -> None:
    tokenizer = tokenizers["gemma4_tools_minimal.jinja"]
    assert format_of_template(tokenizer.chat_template or "") == "gemma4"
    calls = [("get_weather", GEMMA4_ARGUMENTS), ("get_time", {"city": "Zürich"})]
    reply = _gemma4_reply(tokenizer, calls)
    assert reply.startswith('<|tool_call>call:get_weather{city:<|"|>São Paulo')
    events = _parse(Gemma4Parser(NAMES), _pieces(reply, size))
    assert [(c.name, json.loads(c.arguments)) for c in events if isinstance(c, Call)] == calls
    assert not [e for e in events if isinstance(e, Content)]


def test_gemma4_streams_text_before_a_call_and_holds_back_a_possible_tag() -> None:
    parser = Gemma4Parser(NAMES)
    assert parser.feed("Let me look.<|tool") == [Content("Let me look.")]
    assert parser.feed('_call>call:get_time{city:<|"|>Oslo<|"|>}') == []
    assert parser.feed("<tool_call|>") == [Call("get_time", '{"city": "Oslo"}')]
    assert parser.feed(" <|toolbox") == [Content(" <|toolbox")]
    assert parser.finish() == []


def test_gemma4_accepts_a_call_left_open_at_the_end_of_generation() -> None:
    text = '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}'
    assert _parse(Gemma4Parser(NAMES), [text]) == [Call("get_weather", '{"city": "Rome"}')]


NOT_GEMMA4_CALLS = {
    "unknown function": '<|tool_call>call:get_stock{city:<|"|>Rome<|"|>}<tool_call|>',
    "no call prefix": '<|tool_call>get_time{city:<|"|>Rome<|"|>}<tool_call|>',
    "no braces": "<|tool_call>call:get_time<tool_call|>",
    "unterminated string": '<|tool_call>call:get_time{city:<|"|>Rome}<tool_call|>',
    "unclosed object": "<|tool_call>call:get_time{where:{lat:1}<tool_call|>",
    "key without value": "<|tool_call>call:get_time{city}<tool_call|>",
    "missing comma": "<|tool_call>call:get_time{a:1 b:2}<tool_call|>",
    "empty value": "<|tool_call>call:get_time{city:,days:2}<tool_call|>",
    "deep nesting": "<|tool_call>call:get_time{a:" + "[" * 5000 + "]" * 5000 + "}<tool_call|>",
}


@pytest.mark.parametrize("text", NOT_GEMMA4_CALLS.values(), ids=NOT_GEMMA4_CALLS.keys())
def test_gemma4_gives_back_what_is_not_a_valid_call_as_content(text: str) -> None:
    assert _parse(Gemma4Parser(NAMES), [text]) == [Content(text)]
