"""gpt-oss's output parser (appliance.api.harmony.HarmonyOutput) attacked as a user who steers
the model's output would: any token ids (headers out of order, stray and reserved special
tokens, broken JSON arguments), fed in any split, must parse without an exception; a stream
must give what the whole response gives; the calls must be the ones the library's own message
list holds; and output of many messages must parse in time linear in its length."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai_harmony import HarmonyEncoding, HarmonyError, Role, StreamableParser

from appliance.api.harmony import HarmonyFormat
from appliance.api.parsed_output import WholeOutput, whole_output
from appliance.api.tool_parsers import call_from
from appliance.api.tools import ToolUse
from tests.appliance.api.test_output_parsers_fuzz import assert_strict_json_object

NAMES = frozenset({"get_time", "get_weather"})
VOCABULARY_SIZE = 201_088  # gpt-oss's embedding rows: o200k_base, harmony's and reserved tokens


@pytest.fixture(scope="module")
def harmony() -> HarmonyFormat:
    return HarmonyFormat.load()


def _tool_use(parallel: bool) -> ToolUse:
    return ToolUse([], NAMES, "harmony", parallel)


# The pieces of harmony output, as text (special tokens spelt out), and ones that break it.
FRAGMENTS = [
    "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>",
    "<|call|>", "assistant", "analysis", "final", "commentary", " to=functions.get_time",
    " to=functions.get_weather", " to=functions.rm", " to=browser.search", " <|constrain|>json",
    '{"city": "Oslo"}', "{}", '{"a": NaN}', '{"a": "\\ud800"}', '{"a": ' + "9" * 5000 + "}",
    '{"a": ' * 70 + "1" + "}" * 70, "[1]", "{", "Hello", "\n", " ",
    "<|channel|>analysis<|message|>Thinking.<|end|>",
    "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
    '<|message|>{"city": "Oslo"}<|call|>',
    "<|start|>assistant<|channel|>final<|message|>Sunny.<|return|>",
]  # fmt: skip


@st.composite
def token_streams(draw: st.DrawFn, encoding: HarmonyEncoding) -> tuple[list[int], list[list[int]]]:
    """Token ids of harmony fragments and of any ids at all, and their pieces as a stream
    might deliver them."""
    parts = draw(
        st.lists(
            st.one_of(
                st.sampled_from(FRAGMENTS).map(
                    lambda text: encoding.encode(text, allowed_special="all")
                ),
                st.lists(st.integers(0, VOCABULARY_SIZE - 1), max_size=3),
            ),
            max_size=16,
        )
    )
    tokens = [token for part in parts for token in part]
    cuts = sorted(draw(st.lists(st.integers(0, len(tokens)), max_size=len(tokens) + 2)))
    bounds = [0, *cuts, len(tokens)]
    return tokens, [tokens[a:b] for a, b in pairwise(bounds)]


def _streamed(harmony: HarmonyFormat, pieces: Sequence[list[int]], parallel: bool) -> WholeOutput:
    output = harmony.output(_tool_use(parallel))
    events = [
        e
        for i, piece in enumerate(pieces)
        for e in output.events("", piece, finished=i == len(pieces) - 1)
    ]
    return whole_output(events, output.calls)


def _library_calls(encoding: HarmonyEncoding, tokens: list[int]) -> list[tuple[str, str]]:
    """The calls in the library's own list of the messages complete when the output ends or
    first breaks the format, less the text the library gives a special token out of place:
    the reference that the parser's reading of each message as it comes must match."""
    stray = {encoding.decode([t]) for t in tokens if encoding.is_special_token(t)}
    parser = StreamableParser(encoding, Role.ASSISTANT)
    try:
        for token in tokens:
            parser.process(token)
        parser.process_eos()
    except HarmonyError:
        pass
    calls = []
    for message in parser.messages:
        recipient = message.recipient or ""
        arguments = "".join(getattr(part, "text", "") for part in message.content)
        for special in stray:
            arguments = arguments.replace(special, "")
        name = recipient.removeprefix("functions.")
        if recipient.startswith("functions.") and (
            call := call_from({"name": name, "arguments": arguments}, "arguments", NAMES)
        ):
            calls.append((call.name, call.arguments))
    return calls


def test_fuzz_harmony_output(harmony: HarmonyFormat) -> None:
    encoding = harmony._encoding

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(stream=token_streams(encoding), parallel=st.booleans())
    def check(stream: tuple[list[int], list[list[int]]], parallel: bool) -> None:
        tokens, pieces = stream
        whole = harmony.output(_tool_use(parallel)).whole("", tokens)
        streamed = _streamed(harmony, [*pieces, []], parallel)
        assert (streamed.reasoning, streamed.content) == (whole.reasoning, whole.content)
        calls = [(c.name, c.arguments) for c in whole.calls]
        assert [(c.name, c.arguments) for c in streamed.calls] == calls
        for _, arguments in calls:
            assert_strict_json_object(arguments)
        library = _library_calls(encoding, tokens)
        assert calls == (library if parallel else library[:1])
        assert "<|" not in (whole.content or "") + (whole.reasoning or "")

    check()


def test_an_output_of_many_short_messages_streams_in_linear_time(harmony: HarmonyFormat) -> None:
    # The parser read the library's list of every complete message at each message's end: the
    # list is rebuilt (each message decoded and sent through JSON) on every read, so 3,000
    # messages took over 30 s (and gpt-oss's output may hold as many); now about 1 s on a slow
    # shared CPU.
    encoding = harmony._encoding
    message = "<|start|>assistant<|channel|>analysis<|message|>x<|end|>"
    call = (
        "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json"
        '<|message|>{"city": "Oslo"}<|call|>'
    )
    tokens = encoding.encode((message + call) * 1500, allowed_special="all")
    output = harmony.output(_tool_use(True))
    started = time.thread_time()
    for token in tokens:
        output.events("", [token], finished=False)
    output.events("", [], finished=True)
    assert time.thread_time() - started < 10.0
    assert len(output.calls) == 1500
    assert json.loads(output.calls[-1].arguments) == {"city": "Oslo"}


def test_a_special_token_out_of_place_in_a_call_never_reaches_the_content(
    harmony: HarmonyFormat,
) -> None:
    # The library keeps a stray special token in a message's text as the token's own text: a
    # call's text was read whole from the library, so a call not taken (an unknown function)
    # put `<|start|>` in the content, where a streamed message drops it.
    encoding = harmony._encoding
    call = (
        "<|channel|>commentary to=functions.{} <|constrain|>json"
        '<|message|>{{"city": <|start|>"Oslo"}}<|call|>'
    )
    for name, expected in (("rm", '{"city": "Oslo"}'), ("get_time", None)):
        tokens = encoding.encode(call.format(name), allowed_special="all")
        whole = harmony.output(_tool_use(True)).whole("", tokens)
        assert whole.content == expected
        assert [c.arguments for c in whole.calls] == ([] if expected else ['{"city": "Oslo"}'])
