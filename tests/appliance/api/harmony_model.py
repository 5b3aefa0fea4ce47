"""A tiny gpt-oss model directory for the API's harmony tests: config.json of a two-layer
GptOssForCausalLM (so the server picks harmony by architecture, as for the real model), a
tokenizer.json with o200k_harmony's ids and tokens, and the end-of-sequence ids gpt-oss's
generation_config.json gives.

The tokenizer is built from the harmony library's own vocabulary: every o200k_base token as
byte-level BPE, then harmony's special tokens at their ids. It has no merges: it decodes every
id exactly as the real tokenizer.json does (all the engine's detokenizer needs of it here), but
encodes text byte by byte. Prompts and scripted replies are the library's own token ids."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from openai_harmony import HarmonyEncoding
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from appliance.api.harmony import NUM_O200K_RANKS
from appliance.engine.tokenizer import _BYTE_LEVEL_ALPHABET

VOCAB_SIZE = 201_088  # gpt-oss's embedding rows: o200k_base, then harmony's special tokens
END_OF_TEXT, RETURN, CALL = 199_999, 200_002, 200_012

TINY_GPT_OSS = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention"],
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "torch_dtype": "float32",
}


def harmony_tokenizer(encoding: HarmonyEncoding) -> Tokenizer:
    # Byte-level BPE writes each byte as one character: the engine's own table, inverted.
    alphabet = {byte: char for char, byte in _BYTE_LEVEL_ALPHABET.items()}
    vocab = {}
    for rank in range(NUM_O200K_RANKS):
        data = encoding.decode([rank], errors="surrogateescape").encode("utf-8", "surrogateescape")
        vocab["".join(alphabet[b] for b in data)] = rank
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    # Added in id order, they take harmony's ids (checked by the caller's tests).
    tokenizer.add_special_tokens(
        [encoding.decode_utf8([token]) for token in range(NUM_O200K_RANKS, VOCAB_SIZE)]
    )
    return tokenizer


def write_harmony_model(encoding: HarmonyEncoding, directory: Path) -> Path:
    """The tiny gpt-oss model's files in `directory`; its weights file holds a placeholder that
    the server digests for the audit log and never loads (a scripted model stands in)."""
    (directory / "config.json").write_text(json.dumps(TINY_GPT_OSS))
    save_file({"placeholder": torch.zeros(1)}, directory / "model.safetensors")
    harmony_tokenizer(encoding).save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|startoftext|>", "eos_token": "<|return|>"})
    )
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [RETURN, END_OF_TEXT, CALL]})
    )
    return directory
