"""The text parsers of a model's output (appliance.api.tool_parsers, reasoning_parsers and
parsed_output) attacked as a user who steers the model's output would: any text, fed in any
split, must parse without an exception, a stream must give what the whole response gives, no
text may be lost, every call must be strict JSON a response can carry, and hostile output must
parse in time linear in its length, however finely it is streamed.

The hostile corpus at the end is named after the defects it found; each failed before its fix.
Property tests draw text from the formats' own markers, parts of them, JSON fragments and
characters that break naive code (NUL, lone surrogates, huge numbers): a parser's contract is
about where markers fall, which random text alone would almost never hit."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from itertools import accumulate, pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.api.chat import _parsed_chunks
from appliance.api.parsed_output import ParsedOutput, WholeOutput, whole_output
from appliance.api.reasoning_parsers import (
    REASONING_PARSERS,
    Reasoning,
    ReasoningEvent,
    ReasoningParser,
    ThinkTagParser,
)
from appliance.api.tool_parsers import (
    PARSERS,
    Call,
    Content,
    Event,
    ForcedCallsParser,
    Gemma4Parser,
    HermesParser,
    ToolCallParser,
)
from appliance.api.tools import ChoiceCalls, ToolUse
from appliance.engine.outputs import RequestOutput
from appliance.engine.sequence import RequestId
from appliance.json_limits import MAX_NESTING_DEPTH

NAMES = frozenset({"get_time", "get_weather"})

TOOL_PARSERS: dict[str, Callable[[], ToolCallParser]] = {
    **{name: (lambda factory=factory: factory(NAMES)) for name, factory in PARSERS.items()},
    "forced_required": lambda: ForcedCallsParser(NAMES, None),
    "forced_named": lambda: ForcedCallsParser(NAMES, "get_time"),
}
MAKE_REASONING: dict[str, Callable[[], ReasoningParser]] = {
    f"{name}_thinking_{thinking}": (
        lambda factory=factory, thinking=thinking: factory(thinking=thinking)
    )
    for name, factory in REASONING_PARSERS.items()
    for thinking in (True, False)
}

# Calls as JSON: valid ones, and ones that broke a parser (huge, non-finite or surrogate
# numbers and strings, nesting past the limit), for every format that writes JSON.
BODIES = [
    '{"name": "get_time", "arguments": {"city": "Oslo"}}',
    '{"name": "get_weather", "parameters": {}}',
    '{"name": "get_time", "arguments": "{\\"a\\": 1}"}',
    '{"name": "rm", "arguments": {}}',
    '{"name": "get_time", "arguments": {"a": NaN}}',
    '{"name": "get_time", "arguments": {"a": -1e999}}',
    '{"name": "get_time", "arguments": {"a": "\\ud800"}}',
    '{"name": "get_time", "arguments": {"a": ' + "7" * 5000 + "}}",
    '{"name": "get_time", "arguments": ' + '{"a": ' * 70 + "{}" + "}" * 70 + "}",
]
GEMMA4_ARGUMENTS = [
    'city:<|"|>Oslo<|"|>', "a:{b:[1,2]}", "a:NaN", "a:1e999", "a:" + "7" * 5000,
    "a:" + "[" * 70 + "]" * 70, "a", "",
]  # fmt: skip

# Each format's markers and whole structures, by the name of the parsers that read them.
MARKERS = {
    "hermes": ["<tool_call>", "</tool_call>", *(f"<tool_call>\n{b}\n</tool_call>" for b in BODIES)],
    "gemma4": [
        "<|tool_call>", "<tool_call|>", "call:get_time", '<|"|>',
        *(f"<|tool_call>call:get_time{{{a}}}<tool_call|>" for a in GEMMA4_ARGUMENTS),
    ],
    "llama3_json": ["<|python_tag|>", ";", *BODIES],
    "granite": ["<|tool_call|>", "<tool_call>", *(f"[{b}]" for b in BODIES)],
    "phi4_mini_json": ["functools", *(f"functools[{b}]" for b in BODIES)],
    "forced": [*BODIES, *(f"[{b}]" for b in BODIES)],
    "qwen3": ["<think>", "</think>", "<think>\n", "\n</think>\n\n"],
    "gemma4_thinking": ["<|channel>", "thought\n", "<channel|>", "<|channel>thought\n"],
}  # fmt: skip
# How a reasoning format's output opens: a thought starts the output or not at all.
OPENINGS = {
    "qwen3": ["", "<think>", "<think>\n", "\n<think>\n\n", "\n"],
    "gemma4_thinking": ["", "<|channel>", "<|channel>thought\n", "<|channel>thought"],
}
FRAGMENTS = [
    "{", "}", "[", "]", '"', ":", ",", "call:", "a:", "\\",
    "\n", "\n\n", " ", "\t", "\x00", "\ud800", "\udfff", "é", "😀",
]  # fmt: skip
ALL_MARKERS = [marker for markers in MARKERS.values() for marker in markers]


def _texts(*formats: str) -> st.SearchStrategy[list[str]]:
    """Texts as lists of parts: the markers and structures of `formats` (markers also cut
    short), any format's, hostile fragments and any characters, so that a format's markers
    meet often."""
    own = [marker for name in formats for marker in MARKERS[name]]
    own += [m[:cut] for m in own if len(m) < 20 for cut in (1, len(m) // 2, len(m) - 1)]
    own += ["\n", "\n\n", " x", "x\n"]
    part = st.one_of(
        st.sampled_from(own), st.sampled_from(ALL_MARKERS + FRAGMENTS), st.text(max_size=4)
    )
    return st.lists(part, max_size=24)


def _format_of(parser: str) -> str:
    if parser.startswith("forced"):
        return "forced"
    if parser.startswith("gemma4_thinking"):
        return "gemma4_thinking"
    return parser.removesuffix("_thinking_True").removesuffix("_thinking_False")


FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _pieces(text: str, cuts: Sequence[int]) -> list[str]:
    """`text` cut at `cuts` (positions, any order, repeats giving empty pieces)."""
    bounds = [0, *sorted(cuts), len(text)]
    return [text[a:b] for a, b in pairwise(bounds)]


@st.composite
def split_texts(draw: st.DrawFn, *formats: str) -> tuple[str, list[str]]:
    """A text (`_texts`, after an opening of the first format, if it reasons), and its pieces
    as a stream might deliver them: cut between some parts (where a marker starts or ends) and
    anywhere else."""
    opening = draw(st.sampled_from(OPENINGS.get(formats[0], [""]) if formats else [""]))
    parts = [opening, *draw(_texts(*formats))]
    text = "".join(parts)
    ends = list(accumulate(len(part) for part in parts))
    cut_after = draw(st.lists(st.booleans(), min_size=len(parts), max_size=len(parts)))
    cuts = [end for end, cut in zip(ends, cut_after, strict=True) if cut]
    cuts += draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 2))
    return text, _pieces(text, cuts)


def _merged(events: Sequence[Event | ReasoningEvent]) -> list[Event | ReasoningEvent]:
    """Adjacent text events of one kind joined: how text is split depends on the pieces, what
    it says must not."""
    merged: list[Event | ReasoningEvent] = []
    for event in events:
        if isinstance(event, Call) or not merged or type(merged[-1]) is not type(event):
            merged.append(event)
        else:
            merged[-1] = type(event)(merged[-1].text + event.text)  # type: ignore[union-attr]
    return merged


def _fed(parser: ToolCallParser | ReasoningParser, pieces: Sequence[str]) -> list:
    return [e for piece in pieces for e in parser.feed(piece)] + parser.finish()


def _refuse(name: str) -> object:
    raise ValueError(name)


def assert_strict_json_object(arguments: str) -> None:
    """What a client's JSON parser accepts: an object, no NaN or Infinity, and UTF-8 text."""
    value = json.loads(arguments, parse_constant=_refuse)
    assert isinstance(value, dict)
    arguments.encode()


# Tool-call parsers.


@pytest.mark.parametrize("parser", TOOL_PARSERS, ids=TOOL_PARSERS.keys())
@FUZZ
@given(data=st.data())
def test_a_tool_parser_streamed_in_any_split_gives_what_the_whole_text_gives(
    parser: str, data: st.DataObject
) -> None:
    text, pieces = data.draw(split_texts(_format_of(parser)))
    whole = _merged(_fed(TOOL_PARSERS[parser](), [text]))
    assert _merged(_fed(TOOL_PARSERS[parser](), pieces)) == whole
    for event in whole:
        assert isinstance(event, Content | Call)
        if isinstance(event, Call):
            assert event.name in NAMES
            assert_strict_json_object(event.arguments)
    if not any(isinstance(e, Call) for e in whole):
        # Nothing the model wrote is lost: what is not a call is content, as written.
        assert "".join(e.text for e in whole if isinstance(e, Content)) == text


# Reasoning parsers.


@pytest.mark.parametrize("parser", MAKE_REASONING, ids=MAKE_REASONING.keys())
@FUZZ
@given(data=st.data())
def test_a_reasoning_parser_streamed_in_any_split_gives_what_the_whole_text_gives(
    parser: str, data: st.DataObject
) -> None:
    text, pieces = data.draw(split_texts(_format_of(parser)))
    whole = _merged(_fed(MAKE_REASONING[parser](), [text]))
    assert _merged(_fed(MAKE_REASONING[parser](), pieces)) == whole
    assert all(isinstance(e, Reasoning | Content) and e.text for e in whole)
    # A thought comes before the answer, once.
    assert [type(e) for e in whole] in ([], [Reasoning], [Content], [Reasoning, Content])


# Both in turn, as a response carries them.


def _parsed_output(reasoning: str | None, tools: str | None, parallel: bool) -> ParsedOutput:
    calls = None
    if tools is not None:
        calls = ChoiceCalls(ToolUse([], NAMES, tools, parallel))
    return ParsedOutput(None if reasoning is None else MAKE_REASONING[reasoning](), calls)


def _streamed(output: ParsedOutput, pieces: Sequence[str]) -> WholeOutput:
    events = [
        e
        for i, piece in enumerate(pieces)
        for e in output.events(piece, (), finished=i == len(pieces) - 1)
    ]
    return whole_output(events, output.calls)


def _comparable(output: WholeOutput) -> tuple:
    """The output less its calls' ids (random)."""
    return output.reasoning, output.content, [(c.name, c.arguments) for c in output.calls]


@FUZZ
@given(
    reasoning=st.sampled_from([None, *MAKE_REASONING]),
    tools=st.sampled_from([None, *PARSERS]),
    parallel=st.booleans(),
    data=st.data(),
)
def test_a_streamed_response_says_what_the_whole_response_says(
    reasoning: str | None, tools: str | None, parallel: bool, data: st.DataObject
) -> None:
    formats = [_format_of(name) for name in (reasoning, tools) if name is not None]
    text, pieces = data.draw(split_texts(*formats))
    whole = _parsed_output(reasoning, tools, parallel).whole(text, ())
    streamed = _streamed(_parsed_output(reasoning, tools, parallel), [*pieces, ""])
    assert _comparable(streamed) == _comparable(whole)
    assert parallel or len(whole.calls) <= 1


# Well-formed output of each format, cut in two at every position and fed a character at a
# time: a marker split anywhere is still found.

WELL_FORMED_CALLS = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    ),
    "llama3_json": (
        '<|python_tag|>{"name": "get_time", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_weather", "parameters": {}}'
    ),
    "granite": '<|tool_call|> [{"name": "get_time", "arguments": {"city": "Oslo"}}]',
    "phi4_mini_json": 'functools[{"name": "get_time", "arguments": {"city": "Oslo"}}]',
    "gemma4": (
        'Looking.<|tool_call>call:get_time{city:<|"|>Oslo<|"|>,days:[1,2]}<tool_call|>'
        "<|tool_call>call:get_weather{}<tool_call|>"
    ),
}
WELL_FORMED_THOUGHTS = {
    "qwen3_thinking_True": "<think>\n\nTwo and two.\n\n</think>\n\nFour.",
    "gemma4_thinking_True": "<|channel>thought\nTwo and two.<channel|>Four.",
}


def _every_split(text: str) -> list[list[str]]:
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("parser", WELL_FORMED_CALLS)
def test_calls_split_at_every_position_are_still_read(parser: str) -> None:
    text = WELL_FORMED_CALLS[parser]
    whole = _merged(_fed(TOOL_PARSERS[parser](), [text]))
    assert any(isinstance(e, Call) for e in whole)
    for pieces in _every_split(text):
        assert _merged(_fed(TOOL_PARSERS[parser](), pieces)) == whole


@pytest.mark.parametrize("parser", WELL_FORMED_THOUGHTS)
def test_a_thought_split_at_every_position_is_still_read(parser: str) -> None:
    text = WELL_FORMED_THOUGHTS[parser]
    for pieces in [[text], *_every_split(text)]:
        parsed = _merged(_fed(MAKE_REASONING[parser](), pieces))
        assert parsed == [Reasoning("Two and two."), Content("Four.")]


# Time: 200 KB of hostile output, one character per delta. Linear, each parses in about 0.2 s
# on a slow shared CPU: the bound leaves ten times that, and still fails the quadratic time
# (everything held rescanned or copied per delta) that each took before its fix. Timed in the
# thread's CPU time, so that other work on a shared machine does not count.

HOSTILE_LENGTH = 200_000
TIME_BOUND_S = 2.0


def _hostile(pattern: str, prefix: str = "") -> str:
    return prefix + pattern * ((HOSTILE_LENGTH - len(prefix)) // len(pattern))


HOSTILE_STREAMS = {  # name: (parser, text)
    "hermes_call_never_closed": ("hermes", _hostile('{"a":', "<tool_call>")),
    "hermes_repeated_openers": ("hermes", _hostile("<tool_call>")),
    "hermes_partial_closers": ("hermes", _hostile("</tool_cal", "<tool_call>")),
    "gemma4_call_never_closed": ("gemma4", _hostile("a:[", "<|tool_call>")),
    "llama3_json_whitespace": ("llama3_json", _hostile(" \n")),
    "llama3_json_nesting": ("llama3_json", _hostile('{"a":')),
    "granite_marker_then_whitespace": ("granite", _hostile(" ", "<|tool_call|>")),
    "phi4_mini_json_marker_then_whitespace": ("phi4_mini_json", _hostile("\n", "functools")),
    "forced_calls": ("forced_required", _hostile('[{"a":')),
    "qwen3_newlines_in_a_thought": ("qwen3_thinking_True", _hostile("\n", "<think>a")),
    "qwen3_newlines_before_a_thought": ("qwen3_thinking_True", _hostile("\n")),
    "qwen3_partial_closers": ("qwen3_thinking_True", _hostile("</think", "<think>")),
    "gemma4_partial_closers": ("gemma4_thinking_True", _hostile("<channel", "<|channel>thought\n")),
}


@pytest.mark.parametrize("name", HOSTILE_STREAMS)
def test_hostile_output_streamed_a_character_at_a_time_parses_in_linear_time(name: str) -> None:
    parser_name, text = HOSTILE_STREAMS[name]
    parser = {**TOOL_PARSERS, **MAKE_REASONING}[parser_name]()
    started = time.thread_time()
    for char in text:
        parser.feed(char)
    parser.finish()
    assert time.thread_time() - started < TIME_BOUND_S


def test_a_response_of_whitespace_between_calls_streams_in_linear_time() -> None:
    # ChoiceCalls holds whitespace that may come before a call: it joined and scanned all of
    # it again for every piece.
    output = _parsed_output("qwen3_thinking_False", "hermes", True)
    started = time.thread_time()
    for _ in range(HOSTILE_LENGTH):
        output.events(" ", (), finished=False)
    whole = whole_output(output.events("", (), finished=True), output.calls)
    assert time.thread_time() - started < 2 * TIME_BOUND_S  # two parsers per delta
    assert whole.content == " " * HOSTILE_LENGTH


# Hostile corpus: output that crashed a parser (a 500), made it send a call no client can read,
# or made a stream disagree with the whole response. Each is named after its defect.

CALL = '{{"name": "get_time", "arguments": {}}}'
HUGE_INTEGER = "1" * 5000  # past Python's 4,300-digit limit: int() raises ValueError


HUGE_INTEGER_CALLS = {  # name: (parser, text)
    "hermes": ("hermes", f"<tool_call>{CALL.format(HUGE_INTEGER)}</tool_call>"),
    "hermes_string_arguments": (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": "' + HUGE_INTEGER + '"}',
    ),
    "llama3_json": ("llama3_json", CALL.format('{"a": ' + HUGE_INTEGER + "}")),
    "granite": ("granite", f"[{CALL.format(HUGE_INTEGER)}]"),
    "phi4_mini_json": ("phi4_mini_json", f"functools[{HUGE_INTEGER}]"),
    "forced_named": ("forced_named", '{"a": ' + HUGE_INTEGER + "}"),
    "forced_required": ("forced_required", f"[{HUGE_INTEGER}]"),
}


@pytest.mark.parametrize("name", HUGE_INTEGER_CALLS)
def test_an_integer_past_pythons_digit_limit_is_content_not_a_crash(name: str) -> None:
    parser, text = HUGE_INTEGER_CALLS[name]
    assert _merged(_fed(TOOL_PARSERS[parser](), [text])) == [Content(text)]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_arguments_with_a_number_json_cannot_spell_are_content_not_a_call(value: str) -> None:
    # json.loads reads these, json.dumps writes NaN and Infinity back: not JSON, so a client's
    # parser would fail on the call's arguments.
    text = f'<tool_call>{{"name": "get_time", "arguments": {{"a": {value}}}}}</tool_call>'
    assert _fed(HermesParser(NAMES), [text]) == [Content(text)]


def test_arguments_with_a_lone_surrogate_escape_are_sent_as_ascii_json() -> None:
    # The model may write the escape `\ud800`; json.dumps(ensure_ascii=False) put the lone
    # surrogate itself in the arguments, which UTF-8 cannot encode: the response failed (500)
    # as it was sent.
    text = '<tool_call>{"name": "get_time", "arguments": {"city": "Z\\u00fcrich \\ud800"}}'
    [call] = _fed(HermesParser(NAMES), [text])
    assert call == Call("get_time", '{"city": "Z\\u00fcrich \\ud800"}')
    assert_strict_json_object(call.arguments)


def _nested_arguments(depth: int) -> str:
    return '{"a": ' * (depth - 1) + "{}" + "}" * (depth - 1)


@pytest.mark.parametrize("depth", [MAX_NESTING_DEPTH - 1, MAX_NESTING_DEPTH, 900, 995, 2000])
def test_arguments_nested_past_the_limit_are_content_whatever_the_stack(depth: int) -> None:
    # Python's JSON reads by recursion: near the recursion limit whether a call was read
    # depended on how deep the caller's stack was, so a stream and a whole response could
    # disagree. The appliance's limit on any JSON from outside now decides, at any depth.
    text = f'<tool_call>{{"name": "get_time", "arguments": {_nested_arguments(depth)}}}'
    events = _fed(HermesParser(NAMES), [text])
    # The call object itself is the first level.
    assert (events == [Content(text)]) == (depth + 1 > MAX_NESTING_DEPTH)


@pytest.mark.parametrize("depth", [MAX_NESTING_DEPTH, MAX_NESTING_DEPTH + 1, 600, 5000])
def test_gemma4_arguments_nested_past_the_limit_are_content(depth: int) -> None:
    arguments = "a:" + "[" * (depth - 1) + "]" * (depth - 1)
    text = f"<|tool_call>call:get_time{{{arguments}}}<tool_call|>"
    events = _fed(Gemma4Parser(NAMES), [text])
    assert (events == [Content(text)]) == (depth > MAX_NESTING_DEPTH)


@pytest.mark.parametrize("opening", ["<think>\n", "<think>", ""])
def test_newlines_opening_a_thought_are_dropped_however_the_stream_splits_them(
    opening: str,
) -> None:
    # The newlines after `<think>` were dropped only if they came in the same piece as the
    # tag: a stream of `<think>\n`, `\n`, `Two` said "\nTwo" where the whole said "Two".
    text = f"{opening}\n\nTwo.\n</think>\n\nFour."
    expected = [Reasoning("Two."), Content("Four.")]
    assert _merged(_fed(ThinkTagParser(thinking=True), [text])) == expected
    for size in (1, 2, 3):
        pieces = [text[i : i + size] for i in range(0, len(text), size)]
        assert _merged(_fed(ThinkTagParser(thinking=True), pieces)) == expected


def test_a_reply_of_many_calls_streams_its_chunks_numbered_in_order_in_linear_time() -> None:
    # Chat's stream numbered each call by finding it in the list of all calls so far: time
    # quadratic in the number of calls (10,000 took about 5 s).
    num_calls = 10_000
    output = _parsed_output(None, "hermes", True)
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    numbers = []
    started = time.thread_time()
    for i in range(num_calls):
        finish_reason = "stop" if i == num_calls - 1 else None
        out = RequestOutput(RequestId("r"), call, [], None, None, finish_reason, None, 1, 1, 0)
        for chunk in _parsed_chunks(0, output, out, None):
            if chunk.delta.tool_calls and "id" in chunk.delta.tool_calls[0]:
                numbers.append(chunk.delta.tool_calls[0]["index"])
    assert time.thread_time() - started < 2 * TIME_BOUND_S
    assert numbers == list(range(num_calls))
