"""The tokenizer rebuilt from the GGUF, checked against transformers' GGUF tokenizer.

transformers (test-only) builds its tokenizer from the same GGUF metadata, so ids and chat
template renderings must be identical on every input here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from appliance.engine.errors import InvalidRequestError, ModelLoadError
from appliance.engine.tokenizer import Tokenizer

CORPUS = [
    "",
    "Hello, world!",
    "12345",
    "The year 2024 had 366 days; π≈3.14159.",
    " leading space and trailing space ",
    "multiple   spaces\tand\ttabs\n\nand blank lines\n   \n",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어",
    "emoji: 😀👍🏽👨‍👩‍👧‍👦🇫🇷 and ❤️",
    "def f(x: int) -> int:\n    return x ** 2  # square\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }',
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after end",
    "don't won't I'm you're we've they'll she'd",
    "URL: https://example.com/path?q=1&r=2#frag",
    "(٣٤٥)(¹²³)(1½)",
    "\u200b zero width, \u00a0 nbsp, \r\n crlf",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi there!"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
    ],
    [
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "Why did the chicken cross the road?"},
        {"role": "user", "content": "Why? 🤔"},
    ],
    [{"role": "user", "content": "  whitespace\n\n and unicode: 日本  "}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(smollm2_dir)


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)


def _tokenizer_with_template(smollm2_dir: Path, template: str) -> Tokenizer:
    base = Tokenizer.from_model_dir(smollm2_dir)
    return Tokenizer(
        base._backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        add_bos_token=False,
        chat_template=template,
    )


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers_gguf_tokenizer(
    tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", CORPUS)
def test_encode_with_special_tokens_matches_transformers(
    tokenizer: Tokenizer, hf_tokenizer: Any, text: str
) -> None:
    assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text)


@pytest.mark.parametrize("text", CORPUS)
def test_decode_of_encode_round_trips_text(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_one_token_each(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("12345")

    assert [tokenizer.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_pre_tokenizer_splits_digits_individually_before_byte_level(smollm2_dir: Path) -> None:
    pre = Tokenizer.from_model_dir(smollm2_dir)._backend.pre_tokenizer

    pieces = [piece for piece, _ in pre.pre_tokenize_str(" 123 abc")]

    assert pieces == ["Ġ", "1", "2", "3", "Ġabc"]


def test_numerals_after_space_split_like_llama_cpp_smollm_not_like_gpt2(smollm2_dir: Path) -> None:
    """Where the GGUF's `tokenizer.ggml.pre = smollm` matters beyond ASCII digits.

    llama.cpp (and SmolLM2's own tokenizer.json) isolate every \\p{N} character before GPT-2's
    split, so " ½" is two pieces. transformers 5.23's GGUF converter has no "smollm" entry and
    falls back to GPT-2's split, giving the single piece "Ġ½": that is why this text is not in
    the parity corpus.
    """
    pre = Tokenizer.from_model_dir(smollm2_dir)._backend.pre_tokenizer

    pieces = [piece for piece, _ in pre.pre_tokenize_str(" ½ ①②")]

    assert pieces == ["Ġ", "Â½", "Ġ", "âĳł", "âĳ¡"]


def test_special_token_text_encodes_to_its_id(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("<|im_start|>") == [1]


def test_decode_skips_special_tokens_by_default(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>")

    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_special_ids_and_vocab_match_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert tokenizer.bos_token_id == hf_tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({hf_tokenizer.eos_token_id}) == frozenset({2})
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert set(hf_tokenizer.all_special_ids) <= tokenizer.all_special_ids
    assert tokenizer.all_special_ids == frozenset(range(17))


def test_encode_adds_no_bos_when_model_says_not_to(tokenizer: Tokenizer) -> None:
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_template_matches_transformers(
    tokenizer: Tokenizer,
    hf_tokenizer: Any,
    conversation: list[dict[str, Any]],
    add_generation_prompt: bool,
) -> None:
    expected = hf_tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )

    rendered = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt
    )

    assert rendered == expected


def test_chat_template_without_system_message_adds_default_system_prompt(
    tokenizer: Tokenizer,
) -> None:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])

    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__ }}",
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
        "{{ messages.append({'role': 'x'}) }}",
        "{% if ''.__class__ %}leak{% endif %}",
    ],
)
def test_malicious_chat_template_is_refused_by_sandbox(smollm2_dir: Path, template: str) -> None:
    tokenizer = _tokenizer_with_template(smollm2_dir, template)

    with pytest.raises(InvalidRequestError, match=r"sandbox forbids"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_raise_exception_gives_invalid_request_without_content(
    smollm2_dir: Path,
) -> None:
    template = "{{ raise_exception('bad role: ' + messages[0]['content']) }}"
    tokenizer = _tokenizer_with_template(smollm2_dir, template)

    with pytest.raises(InvalidRequestError) as excinfo:
        tokenizer.apply_chat_template([{"role": "user", "content": "SECRET-PROMPT"}])

    assert "SECRET-PROMPT" not in str(excinfo.value)


def test_template_failing_on_content_type_gives_invalid_request_without_content(
    tokenizer: Tokenizer,
) -> None:
    # The SmolLM2 template concatenates content as a string; a list of parts cannot be.
    messages = [{"role": "user", "content": [{"type": "text", "text": "SECRET-PROMPT"}]}]

    with pytest.raises(InvalidRequestError) as excinfo:
        tokenizer.apply_chat_template(messages)

    assert "SECRET-PROMPT" not in str(excinfo.value)


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "not a list",
        ["not a dict"],
        [{"content": "no role"}],
        [{"role": 3, "content": "role not a string"}],
        [{"role": "user", "content": object()}],
    ],
)
def test_malformed_messages_raise_invalid_request(tokenizer: Tokenizer, messages: Any) -> None:
    with pytest.raises(InvalidRequestError):
        tokenizer.apply_chat_template(messages)


def test_template_sees_undefined_keys_as_falsy_like_transformers(smollm2_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% if m.tool_calls %}T{% else %}{{ m.content }}{% endif %}"
        "{% endfor %}"
    )
    tokenizer = _tokenizer_with_template(smollm2_dir, template)

    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_template_syntax_error_is_model_load_error(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "generation_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(
        '{"eos_token": "<|im_end|>", "chat_template": "{% for %}"}'
    )

    with pytest.raises(ModelLoadError, match=r"does not compile"):
        Tokenizer.from_model_dir(tmp_path)


def test_from_model_dir_without_tokenizer_json_is_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_eos_token_ids_include_generation_config_ids(smollm2_dir: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((smollm2_dir / name).read_bytes())
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [0, 2]}')

    assert Tokenizer.from_model_dir(tmp_path).eos_token_ids == frozenset({0, 2})


@pytest.mark.parametrize("text", CORPUS)
def test_token_bytes_join_to_the_utf8_of_the_text(tokenizer: Tokenizer, text: str) -> None:
    # Byte-level BPE: a token may be part of a character, but the bytes always add up.
    ids = tokenizer.encode(text)
    assert b"".join(tokenizer.token_bytes(i) for i in ids) == text.encode()


def test_token_bytes_of_a_token_inside_a_character_is_that_part(tokenizer: Tokenizer) -> None:
    parts = [tokenizer.token_bytes(i) for i in tokenizer.encode("🤖")]
    assert len(parts) > 1  # the emoji takes several tokens, none of them valid UTF-8 alone
    assert b"".join(parts) == "🤖".encode()


def test_token_bytes_of_special_and_unknown_ids(tokenizer: Tokenizer) -> None:
    [end] = tokenizer.encode("<|im_end|>")
    assert tokenizer.token_bytes(end) == b"<|im_end|>"
    assert tokenizer.token_bytes(tokenizer.vocab_size + 10) == b""


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_byte_pieces_of_every_token_decode_as_decode_does(
    tokenizer: Tokenizer, skip_special_tokens: bool
) -> None:
    # Every id of the vocabulary (special ones included) and a few past it.
    pieces = tokenizer.byte_pieces(skip_special_tokens=skip_special_tokens)
    assert pieces is not None
    for token_id in range(tokenizer.vocab_size + 3):
        expected = tokenizer.decode([token_id], skip_special_tokens=skip_special_tokens)
        assert pieces[token_id].decode("utf-8", "replace") == expected, token_id


def test_byte_pieces_of_a_token_inside_a_character_is_that_part(tokenizer: Tokenizer) -> None:
    pieces = tokenizer.byte_pieces()
    assert pieces is not None
    assert b"".join(pieces[i] for i in tokenizer.encode("🤖")) == "🤖".encode()


def test_byte_pieces_drop_special_tokens_only_when_skipped(tokenizer: Tokenizer) -> None:
    [end] = tokenizer.encode("<|im_end|>")
    assert tokenizer.byte_pieces(skip_special_tokens=True)[end] == b""  # type: ignore[index]
    assert tokenizer.byte_pieces(skip_special_tokens=False)[end] == b"<|im_end|>"  # type: ignore[index]


def test_no_byte_pieces_for_a_decoder_that_is_not_bytewise() -> None:
    # Word pieces joined with spaces (no decoder): decode is not the tokens' bytes joined.
    backend = BackendTokenizer(models.WordLevel({"a": 0, "b": 1}, unk_token="a"))
    tokenizer = Tokenizer(
        backend, bos_token=None, eos_token=None, add_bos_token=False, chat_template=None
    )
    assert tokenizer.decode([0, 1]) == "a b"
    assert tokenizer.byte_pieces() is None


def test_encode_chat_is_the_rendered_template_without_an_extra_bos(
    tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    messages = CONVERSATIONS[1]
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    assert tokenizer.encode_chat(messages) == list(expected)


def _model_dir_with(smollm2_dir: Path, out: Path, **files: str) -> Path:
    """SmolLM2's tokenizer files in `out`, plus `files` (name with '.' for '_dot_')."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((smollm2_dir / name).read_bytes())
    for name, text in files.items():
        (out / name.replace("_dot_", ".")).write_text(text)
    return out


def test_chat_template_jinja_wins_over_tokenizer_config_as_in_transformers(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    model_dir = _model_dir_with(smollm2_dir, tmp_path, chat_template_dot_jinja=template)
    messages = [{"role": "user", "content": "Hi"}]

    ours = Tokenizer.from_model_dir(model_dir).apply_chat_template(messages)
    theirs = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs == "[user] Hi\n"


def test_a_chat_template_jinja_that_does_not_compile_is_named(
    smollm2_dir: Path, tmp_path: Path
) -> None:
    model_dir = _model_dir_with(smollm2_dir, tmp_path, chat_template_dot_jinja="{% for %}")
    with pytest.raises(ModelLoadError, match=r"chat_template\.jinja does not compile"):
        Tokenizer.from_model_dir(model_dir)


def test_chat_template_kwargs_reach_the_template(smollm2_dir: Path) -> None:
    template = "{% if enable_thinking is false %}no{% else %}yes{% endif %}:{{ depth.a[0] }}"
    tokenizer = _tokenizer_with_template(smollm2_dir, template)
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = {"enable_thinking": False, "depth": {"a": [7]}}
    assert tokenizer.apply_chat_template(messages, template_kwargs=kwargs) == "no:7"
    assert tokenizer.apply_chat_template(messages, template_kwargs={"depth": {"a": [1]}}) == (
        "yes:1"
    )


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tools": []}, "may not set tools"),
        ({"bos_token": "x"}, "may not set bos_token"),
        ({"raise_exception": 1, "namespace": 2}, "may not set namespace, raise_exception"),
        ({"x": {"a": [[[1]]]}}, "nested deeper than 4"),
        ({"x": "y" * 4100}, "larger than 4096 bytes"),
        ({"x": object()}, "JSON values only"),
    ],
)
def test_chat_template_kwargs_breaking_a_rule_are_refused(
    tokenizer: Tokenizer, kwargs: dict[str, Any], words: str
) -> None:
    with pytest.raises(InvalidRequestError, match=words) as refused:
        tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], template_kwargs=kwargs)
    assert refused.value.param == "chat_template_kwargs"
