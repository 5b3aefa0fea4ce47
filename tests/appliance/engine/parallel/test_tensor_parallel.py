"""Tensor parallelism on the CPU (gloo): rank 0 plus spawned workers give the logits one process
gives (float32, within 1e-5), for prefill, decode steps, decode bursts and chunked prefill; a
worker killed mid-generation stops the engine with an error that names it, in bounded time."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.errors import EngineConfigError
from appliance.engine.models.loader import load_model
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.tokenizer import Tokenizer
from kernels.backend import kernel_ops_for
from tests.appliance.engine.models.conftest import build_hf_model, save_checkpoint

TOLERANCE = 1e-5
# Settings shared by both engines of a comparison: a small step budget, so that the 40-token
# prompt below is prefilled in chunks; decode bursts where no request asks for log-probabilities.
SETTINGS = {
    "num_kv_blocks": 64,
    "max_num_batched_tokens": 16,
    "max_decode_burst": 4,
    "num_cpu_threads": 1,
}
# Tiny models of the engine's tests, with what each adds: GQA and untied lm_head with llama3
# rope scaling; tied embeddings (the vocab-parallel embedding is the lm_head); q/k/v and o_proj
# biases (o_proj's bias is added by rank 0 alone); Phi-3's projections stored fused, which each
# rank reads whole and splits; and an FP8 KV cache, each rank storing its KV heads with the
# layer's scales (per tensor, so every rank holds the same ones: here the checkpoint's, not 1,
# so a rank that missed them would show).
VARIANTS = ["llama3.1", "smollm2-tied", "llama-attention-bias", "phi3-longrope", "llama3.1-fp8-kv"]
FP8_KV_SCALES = {"k_scale": 0.05, "v_scale": 0.02}


def build_engine(
    model_dir: Path, tensor_parallel_size: int, tokenizer: Tokenizer | None = None, **settings
) -> Engine:
    """As Engine.from_config builds one, with or without a tokenizer."""
    config = EngineConfig(
        model_dir=model_dir, tensor_parallel_size=tensor_parallel_size, **{**SETTINGS, **settings}
    )
    group = config.start_workers()
    try:
        model = load_model(
            model_dir,
            ops=kernel_ops_for(torch.device("cpu")),
            shard=None if group is None else group.plan,
        )
        return Engine.build(config, model, tokenizer, group=group)
    except BaseException:
        if group is not None:
            group.close()
        raise


class Recorder:
    """Every logits tensor rank 0's runner computes, in order."""

    def __init__(self, engine: Engine):
        self.logits: list[torch.Tensor] = []
        compute_logits = engine.runner.model.compute_logits

        def recording(hidden: torch.Tensor, **options: bool) -> torch.Tensor:
            logits = compute_logits(hidden, **options)
            self.logits.append(logits.clone())
            return logits

        engine.runner.model.compute_logits = recording  # type: ignore[method-assign]

    def take(self) -> list[torch.Tensor]:
        taken, self.logits = self.logits, []
        return taken


@pytest.fixture(scope="module", params=VARIANTS)
def engines(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Engine, Engine]]:
    """(one process, two processes) around the same tiny checkpoint, built once per variant."""
    variant, fp8_kv, _ = request.param.partition("-fp8-kv")
    model_dir = save_checkpoint(build_hf_model(variant), tmp_path_factory.mktemp("tp"))
    settings = {}
    if fp8_kv:
        _add_kv_scales(model_dir / "model.safetensors")
        settings["kv_cache_dtype"] = "fp8_e4m3"
    single = build_engine(model_dir, 1, **settings)
    parallel = build_engine(model_dir, 2, **settings)
    yield single, parallel
    parallel.close()


def _add_kv_scales(path: Path) -> None:
    tensors = load_file(path)
    num_layers = len({name.split(".")[2] for name in tensors if name.startswith("model.layers.")})
    for layer in range(num_layers):
        for name, value in FP8_KV_SCALES.items():
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor(value)
    save_file(tensors, path, metadata={"format": "pt"})


def compare(
    engines: tuple[Engine, Engine],
    prompts: list[list[int]],
    params: SamplingParams,
    *,
    scale_by_logits: bool = False,
) -> int:
    """Run the same requests on both engines; assert equal tokens and logits within TOLERANCE
    (times the largest logit's magnitude, with `scale_by_logits`); the number of logits tensors
    compared."""
    recorded, tokens = [], []
    for engine in engines:
        recorder = Recorder(engine)
        tokens.append([c.token_ids for c in engine.generate(prompts, params)])
        recorded.append(recorder.take())
    single, parallel = recorded
    assert tokens[0] == tokens[1]
    assert [t.shape for t in single] == [t.shape for t in parallel]
    for expected, got in zip(single, parallel, strict=True):
        scale = expected.abs().max().item() if scale_by_logits else 1.0
        torch.testing.assert_close(got, expected, rtol=0, atol=TOLERANCE * scale)
    return len(single)


def prompt_ids(length: int, offset: int = 3) -> list[int]:
    return [(offset + 7 * i) % 250 + 1 for i in range(length)]


def test_prefill_logits_at_every_prompt_position_match_one_process(engines) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2, logprobs=2)
    assert compare(engines, [prompt_ids(12)], params) >= 2  # prompt rows, then the sampled row


def test_decode_steps_match_one_process(engines) -> None:
    # Logprobs keep every step a single step (no bursts).
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1)
    assert compare(engines, [prompt_ids(5), prompt_ids(9, offset=40)], params) == 8


def test_chunked_prefill_matches_one_process(engines) -> None:
    # 40 prompt tokens in steps of 16 tokens: three chunks, the last one beside a decode.
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    assert compare(engines, [prompt_ids(40), prompt_ids(6, offset=90)], params) >= 5


def test_decode_bursts_match_one_process(engines) -> None:
    """Bursts feed each step's sampled ids, on rank 0's device, to the next step."""
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    assert compare(engines, [prompt_ids(5), prompt_ids(7, offset=11)], params) == 9


def test_a_split_the_heads_do_not_allow_is_refused_before_any_worker_starts(
    smollm2_dir: Path,
) -> None:
    with pytest.raises(EngineConfigError, match=r"does not divide the model's num_attention_heads"):
        EngineConfig(model_dir=smollm2_dir, tensor_parallel_size=2).start_workers()


def test_async_scheduling_matches_one_synchronous_process(engines) -> None:
    """The workers take each step's token ids from rank 0's device, where asynchronous
    scheduling writes the tokens the host has not seen yet: the same tokens as one process
    stepping synchronously, with chunked prefill, bursts, log-probabilities and a stop."""
    single, parallel = engines
    prompts = [prompt_ids(40), prompt_ids(5, offset=11), prompt_ids(9, offset=40)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    params = [greedy, SamplingParams(temperature=0.0, max_tokens=7, logprobs=1), greedy]
    expected = [c.token_ids for c in single.generate(prompts, params)]
    stop = expected[2][5]
    params[2] = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=(stop,)
    )
    expected[2] = expected[2][: expected[2].index(stop) + 1]
    # One tensor-parallel engine per process: this one's setting is switched for the test.
    parallel.async_scheduling = True
    try:
        assert [c.token_ids for c in parallel.generate(prompts, params)] == expected
    finally:
        parallel.async_scheduling = False
