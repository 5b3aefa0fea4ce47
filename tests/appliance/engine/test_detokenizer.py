"""Streaming detokenization: deltas concatenate to the full decode and never split a character."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine.detokenizer import IncrementalDetokenizer
from appliance.engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "emoji 😀👍🏽👨‍👩‍👧‍👦🇫🇷 end",
    "日本語のテキストと中文和한국어",
    "accents: naïve café Straße déjà vu",
    "mixed 12345 🤖 ∑∫√ ← → ✓",
    "<|im_start|>assistant\nSure! 🎉<|im_end|>",
    "  leading spaces and trailing  ",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_dir)


def _stream(tokenizer: Tokenizer, ids: list[int], *, skip_special_tokens: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add(token_id) for token_id in ids]
    deltas.append(detokenizer.flush())
    assert detokenizer.text == "".join(deltas)
    return deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(
    tokenizer: Tokenizer, text: str, skip_special_tokens: bool
) -> None:
    ids = tokenizer.encode(text)

    deltas = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)

    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_never_contain_replacement_character(tokenizer: Tokenizer, text: str) -> None:
    deltas = _stream(tokenizer, tokenizer.encode(text), skip_special_tokens=True)

    assert not [delta for delta in deltas if "\ufffd" in delta]


def test_emoji_split_over_tokens_is_held_back_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("😀")
    assert len(ids) > 1, "the test needs an emoji that spans several tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)

    deltas = [detokenizer.add(token_id) for token_id in ids]

    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "😀"
    assert detokenizer.flush() == ""


def test_flush_emits_incomplete_character_at_end_of_stream(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 😀")[:-1]
    detokenizer = IncrementalDetokenizer(tokenizer)
    streamed = "".join(detokenizer.add(token_id) for token_id in ids)

    tail = detokenizer.flush()

    assert streamed == "ok"
    assert streamed + tail == tokenizer.decode(ids)
    assert tail.endswith("\ufffd")


def test_skipped_special_tokens_emit_nothing(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)

    assert detokenizer.add(1) == ""
    assert detokenizer.add(tokenizer.encode("hi")[0]) == "hi"
    assert detokenizer.text == "hi"


def test_window_stays_bounded_on_long_streams(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)

    for token_id in tokenizer.encode("word " * 500 + "日本語 😀 " * 100):
        detokenizer.add(token_id)
        # Only the tokens of the last delta and any held-back ones are kept for decoding.
        assert len(detokenizer._window) <= 8


def test_most_tokens_cost_one_decode(tokenizer: Tokenizer) -> None:
    # The server's CPU per streamed token (PERFORMANCE.md, W3): the text of the window already
    # emitted is kept, not decoded again for every token (two decodes each before).
    ids = tokenizer.encode("word " * 300 + "日本語 😀 " * 50)
    num_decodes = 0
    decode = tokenizer.decode

    def counting_decode(token_ids: list[int], *, skip_special_tokens: bool = True) -> str:
        nonlocal num_decodes
        num_decodes += 1
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    counting = types.SimpleNamespace(decode=counting_decode)
    detokenizer = IncrementalDetokenizer(counting)  # type: ignore[arg-type]
    text = "".join(detokenizer.add(token_id) for token_id in ids) + detokenizer.flush()

    assert text == decode(ids)
    assert num_decodes <= 1.3 * len(ids)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(text=st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=60))
def test_streamed_text_equals_decode_for_arbitrary_text(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    full = tokenizer.decode(ids)

    deltas = _stream(tokenizer, ids, skip_special_tokens=True)

    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not [delta for delta in deltas if "\ufffd" in delta]


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40))
def test_streamed_text_equals_decode_for_arbitrary_token_ids(
    tokenizer: Tokenizer, ids: list[int]
) -> None:
    # Random ids can spell invalid UTF-8, as a sampled model can: the contract still holds.
    for skip_special_tokens in (True, False):
        full = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

        deltas = _stream(tokenizer, ids, skip_special_tokens=skip_special_tokens)

        assert "".join(deltas) == full
