"""Streaming detokenization: deltas concatenate to the full decode and never split a character."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as BackendTokenizer

from appliance.engine.detokenizer import (
    ByteDetokenizer,
    Detokenizer,
    IncrementalDetokenizer,
    detokenizer_for,
)
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


# The bytewise detokenizer (byte-level BPE): the same deltas as the window's, token for token.


def _deltas(detokenizer: Detokenizer, ids: list[int]) -> list[str]:
    return [detokenizer.add(token_id) for token_id in ids] + [detokenizer.flush()]


def _assert_bytewise_equals_window(tokenizer: Tokenizer, ids: list[int]) -> None:
    for skip_special_tokens in (True, False):
        bytewise = detokenizer_for(tokenizer, skip_special_tokens=skip_special_tokens)
        assert isinstance(bytewise, ByteDetokenizer)
        window = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)

        deltas = _deltas(bytewise, ids)

        assert deltas == _deltas(window, ids)
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("text", TEXTS)
def test_bytewise_deltas_are_the_window_deltas(tokenizer: Tokenizer, text: str) -> None:
    _assert_bytewise_equals_window(tokenizer, tokenizer.encode(text))


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(min_value=0, max_value=49151 + 4), max_size=40))
def test_bytewise_deltas_are_the_window_deltas_for_arbitrary_ids(
    tokenizer: Tokenizer, ids: list[int]
) -> None:
    # Special ids, ids past the vocabulary and partial characters, as a sampled model can give.
    _assert_bytewise_equals_window(tokenizer, ids)


@pytest.fixture(scope="module")
def byte_token_ids(llama3_style_tokenizer: Tokenizer) -> dict[int, int]:
    """The Llama-3-style tokenizer's one-byte tokens (all 256, unlike SmolLM2's): byte to id."""
    tokenizer = llama3_style_tokenizer
    pieces = tokenizer.byte_pieces()
    assert pieces is not None
    ids = {pieces[i][0]: i for i in range(tokenizer.vocab_size) if len(pieces[i]) == 1}
    assert len(ids) == 256
    return ids


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    data=st.lists(
        st.one_of(
            st.binary(max_size=4),
            # Invalid UTF-8 where decoders are known to differ: surrogates, past U+10FFFF,
            # overlong forms, truncated and stray continuation bytes.
            st.sampled_from(
                [b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xf0\x9f"]
            ),
            st.sampled_from([b"\x80", b"\xbf", b"\xe2\x82", b"\xef\xbf\xbd", "é😀".encode()]),
        ),
        max_size=12,
    )
)
def test_bytewise_deltas_are_the_window_deltas_for_arbitrary_bytes(
    llama3_style_tokenizer: Tokenizer, byte_token_ids: dict[int, int], data: list[bytes]
) -> None:
    # One token per byte: Python's lossy UTF-8 decode must replace exactly what the tokenizers
    # library's (Rust's from_utf8_lossy) replaces, one U+FFFD per maximal invalid subpart.
    ids = [byte_token_ids[b] for b in b"".join(data)]
    _assert_bytewise_equals_window(llama3_style_tokenizer, ids)


LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"]


@pytest.fixture(scope="module")
def llama3_style_tokenizer() -> Tokenizer:
    """A small byte-level BPE spelled as Llama 3's is (GPT-2's byte alphabet, its special
    tokens), plus added tokens of each kind the decoder treats differently: a special token
    spelled in the byte alphabet ("Ġ" decodes to a space), one outside it, and a plain added
    token outside it (decoded as its own UTF-8)."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=500,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=LLAMA3_SPECIAL,
        show_progress=False,
    )
    backend.train_from_iterator(TEXTS * 4, trainer)
    backend.add_special_tokens(
        [AddedToken("<Ġsep>", special=True), AddedToken("<✓ tool>", special=True)]
    )
    backend.add_tokens([AddedToken("héllo wörld", special=False)])
    return Tokenizer(
        backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        add_bos_token=True,
        chat_template=None,
    )


@pytest.mark.parametrize(
    "text",
    [
        *TEXTS,
        "<|start_header_id|>assistant<|end_header_id|>\n\nhéllo wörld<Ġsep>x<✓ tool>😀<|eot_id|>",
        "héllo wörldhéllo wörld 👨‍👩‍👧‍👦<Ġsep><Ġsep>",
    ],
)
def test_bytewise_deltas_are_the_window_deltas_llama3_style(
    llama3_style_tokenizer: Tokenizer, text: str
) -> None:
    ids = llama3_style_tokenizer.encode(text, add_special_tokens=True)
    _assert_bytewise_equals_window(llama3_style_tokenizer, ids)


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(ids=st.lists(st.integers(min_value=0, max_value=510), max_size=30))
def test_bytewise_deltas_are_the_window_deltas_llama3_style_arbitrary_ids(
    llama3_style_tokenizer: Tokenizer, ids: list[int]
) -> None:
    _assert_bytewise_equals_window(llama3_style_tokenizer, ids)


def test_bytewise_detokenizer_holds_a_split_character_until_complete(
    tokenizer: Tokenizer,
) -> None:
    ids = tokenizer.encode("😀")
    detokenizer = detokenizer_for(tokenizer)

    assert [detokenizer.add(token_id) for token_id in ids] == [""] * (len(ids) - 1) + ["😀"]
    assert detokenizer.flush() == ""


def test_sentencepiece_byte_fallback_streams_by_window() -> None:
    # SentencePiece's decoders (byte fallback, a stripped leading space) are not bytewise: the
    # window detokenizer serves them, and a character spelled in <0x..> tokens is held whole.
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁": 257, "▁hi": 258}
    backend = BackendTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    sentencepiece = Tokenizer(
        backend, bos_token=None, eos_token=None, add_bos_token=False, chat_template=None
    )
    ids = sentencepiece.encode("hi 😀")
    assert ids[-4:] == [1 + b for b in "😀".encode()]

    detokenizer = detokenizer_for(sentencepiece)
    deltas = _deltas(detokenizer, ids)

    assert isinstance(detokenizer, IncrementalDetokenizer)
    assert deltas[-5:] == ["", "", "", "😀", ""]
    assert "".join(deltas) == sentencepiece.decode(ids) == "hi 😀"
