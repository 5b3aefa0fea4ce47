"""The tokenizer of a GGUF file, rebuilt as a `tokenizers` byte-level BPE tokenizer.

Mirrors what llama.cpp does with the `tokenizer.ggml.*` metadata (and what transformers' GGUF
tokenizer converter builds), so the rebuilt `tokenizer.json` encodes exactly as the model was
trained. Key names follow https://github.com/ggml-org/ggml/blob/master/docs/gguf.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

from appliance.engine.errors import ModelLoadError

# llama.cpp's token types (llama_token_type): 3 is CONTROL, 4 is USER_DEFINED.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# The split llama.cpp applies before byte-level BPE for `tokenizer.ggml.pre` values whose HF
# tokenizer.json uses a regex other than GPT-2's (llama.cpp src/llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table that byte-level BPE vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table = {byte: chr(byte) for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


def _pre_tokenizer_for(pre: str | None, gguf_path: Path) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for `tokenizer.ggml.pre`, as a `tokenizers` object."""
    if pre == "smollm":
        # llama.cpp splits every \p{N} on its own, then applies GPT-2's regex; SmolLM2's own
        # tokenizer.json says the same as Digits(individual) + ByteLevel(use_regex).
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    if pre in (None, "default", "gpt-2", "gpt2"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"):
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    # Guessing another split would silently tokenize differently from training: refuse instead.
    raise ModelLoadError(
        f"{gguf_path} uses the pre-tokenizer {pre!r}, which this importer does not know; "
        "import the model from its original safetensors and tokenizer.json instead"
    )


def build_tokenizer(fields: dict[str, Any], gguf_path: Path) -> BackendTokenizer:
    """Rebuild the byte-level BPE tokenizer from the `tokenizer.ggml.*` arrays.

    Mirrors transformers' GGUF tokenizer builder: tokens not spelled in the byte-level alphabet
    are respelled byte by byte; CONTROL tokens become special added tokens; USER_DEFINED tokens
    (like `<think>`) become added tokens that are matched whole but are not special, so decoding
    with skip_special_tokens keeps them.
    """
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    merges = fields.get("tokenizer.ggml.merges")
    if model != "gpt2" or not tokens or not merges:
        raise ModelLoadError(
            f"{gguf_path} has a {model!r} tokenizer; only byte-level BPE ('gpt2', with tokens and "
            "merges) can be imported: use the model's original tokenizer.json instead"
        )
    alphabet = _byte_level_alphabet()
    spelling = set(alphabet.values())
    vocab = {
        token
        if set(token) <= spelling
        else "".join(alphabet[byte] for byte in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    backend = BackendTokenizer(
        models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False)
    )
    backend.pre_tokenizer = _pre_tokenizer_for(fields.get("tokenizer.ggml.pre"), gguf_path)
    backend.decoder = decoders.ByteLevel()
    token_types = fields.get("tokenizer.ggml.token_type") or []
    backend.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == _TOKEN_TYPE_CONTROL and set(token) <= spelling
        ]
    )
    backend.add_tokens(
        [
            AddedToken(token, special=False, normalized=False)
            for token, token_type in zip(tokens, token_types, strict=False)
            if token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab
        ]
    )
    bos_id = fields.get("tokenizer.ggml.bos_token_id")
    if fields.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
        )
    return backend


def build_tokenizer_config(fields: dict[str, Any]) -> dict[str, Any]:
    tokens = fields["tokenizer.ggml.tokens"]

    def token_for(gguf_key: str) -> str | None:
        token_id = fields.get(f"tokenizer.ggml.{gguf_key}")
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": token_for("bos_token_id"),
        "eos_token": token_for("eos_token_id"),
        "pad_token": token_for("padding_token_id"),
        "unk_token": token_for("unknown_token_id"),
        "chat_template": fields.get("tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": fields.get("llama.context_length", 2048),
    }
