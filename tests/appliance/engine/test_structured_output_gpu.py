"""Structured outputs on a GPU: the bitmask copied from pinned memory and applied to CUDA
logits equals the CPU result, and an engine on CUDA (Triton kernels, CUDA graphs) keeps a
random model's greedy output inside its grammar. Self-contained: a byte-level tokenizer built
here and random weights, no model files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.sampling_params import SamplingParams, StructuredOutput
from appliance.engine.structured_output import GrammarCompiler, TokenMasks
from appliance.engine.tokenizer import Tokenizer
from appliance.engine.warmup import random_model

pytestmark = pytest.mark.gpu

VOCAB = 320  # 256 byte tokens, EOS, and ids no text maps to (as a model's padded vocabulary)
EOS = 256


def _byte_tokenizer_json() -> str:
    """A byte-level BPE without merges: one token per byte, then EOS."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = BackendTokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer.to_str()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    text = _byte_tokenizer_json()
    return GrammarCompiler(lambda: text, VOCAB, [EOS])


def test_masks_applied_on_cuda_equal_the_cpu_result(compiler: GrammarCompiler) -> None:
    specs = [StructuredOutput("regex", "[0-9]+"), StructuredOutput("json_object")]
    grammars = [compiler.grammar(specs[0]), None, compiler.grammar(specs[1])]
    masks = TokenMasks.for_rows(grammars, VOCAB)
    assert masks is not None
    masks.fill()
    logits = torch.randn(3, VOCAB)
    on_cuda = masks.apply(logits.cuda()).cpu()
    assert torch.equal(on_cuda, masks.apply(logits))
    assert torch.isneginf(on_cuda[0]).sum() == VOCAB - 10  # the ten digits remain


def test_an_engine_on_cuda_keeps_greedy_output_inside_the_grammar(
    tmp_path: Path,
) -> None:
    (tmp_path / "tokenizer.json").write_text(_byte_tokenizer_json())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "vocab_size": VOCAB,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine_config = EngineConfig(
        model_dir=tmp_path, device="cuda", max_model_len=512, gpu_memory_utilization=0.2
    )
    tokenizer = Tokenizer.from_model_dir(tmp_path)
    engine = Engine.build(engine_config, random_model(engine_config), tokenizer)
    pattern = r"[a-f]{3}-[0-9]{2,4}"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = [
        SamplingParams(
            max_tokens=40, temperature=0.0, structured=StructuredOutput("regex", pattern)
        ),
        SamplingParams(
            max_tokens=60,
            temperature=1.0,
            seed=3,
            structured=StructuredOutput("json_schema", json.dumps(schema)),
        ),
        SamplingParams(max_tokens=20, temperature=0.0),  # unconstrained, in the same batch
    ]
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9]]
    regex_out, json_out, free_out = engine.generate(prompts, params)
    assert re.fullmatch(pattern, regex_out.text) and regex_out.finish_reason == "stop"
    if json_out.finish_reason == "stop":
        assert isinstance(json.loads(json_out.text)["n"], int)
    assert len(free_out.token_ids) == 20 or free_out.finish_reason == "stop"
