"""`inferno warmup`: the engine built from a model's config.json with random weights, the
workload run, and (on a GPU) Triton's cache filled so that a second start compiles nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.__main__ import main
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.warmup import cached_kernels, random_model, warm_up

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}


@pytest.fixture
def config_only_model(tmp_path: Path) -> Path:
    """A model directory with nothing but its architecture: warm-up needs no weights."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    return model_dir


def _settings(tmp_path: Path, model_dir: Path, device: str, cache: Path) -> Path:
    path = tmp_path / "inferno.toml"
    path.write_text(
        f'appliance.profile = "development"\n[model]\ndir = "{model_dir}"\n'
        f'[engine]\ndevice = "{device}"\nmax_num_batched_tokens = 64\nmax_num_seqs = 8\n'
        f'triton_cache_dir = "{cache}"\ngpu_memory_utilization = 0.3\n'
        f'[tee]\nmode = "insecure-dev"\n[audit]\norigin = "test/audit"\n'
        f'data_dir = "{tmp_path / "audit"}"\n[auth]\nlocal_issuer = "demo"\n'
        f'local_issuer_key_file = "{tmp_path / "issuer.pem"}"\n'
        "[server]\ninsecure_http = true\n"
    )
    return path


def test_random_model_has_the_architecture_and_finite_weights(config_only_model: Path) -> None:
    model = random_model(EngineConfig(model_dir=config_only_model, device="cpu"))
    qkv = model.layers[0].self_attn.qkv_proj.weight
    assert qkv.shape == (64 + 2 * 2 * 16, 64)  # 4 query heads, 2 KV heads of 16
    assert torch.isfinite(qkv).all() and qkv.std() > 0.01
    assert torch.equal(model.norm.weight, torch.ones(64))


def _cpu_config(model_dir: Path, **changes: object) -> EngineConfig:
    """A small warm-up on the CPU: steps of 64 tokens, 64 KV blocks, one torch thread."""
    settings = {"max_num_batched_tokens": 64, "num_kv_blocks": 64, "num_cpu_threads": 1}
    return EngineConfig(model_dir=model_dir, device="cpu", **{**settings, **changes})


def test_warm_up_runs_every_workload_step_on_the_cpu(config_only_model: Path) -> None:
    report = warm_up(_cpu_config(config_only_model))
    # The CPU path compiles nothing; the workload still ran end to end (chunked prefill of a
    # prompt longer than one step's budget included).
    assert report.compiled == 0 and report.workload_s > 0


def test_warm_up_captures_every_graph_at_build_even_with_the_server_s_config(
    config_only_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`inferno warmup` builds from the server's engine config, which defers the graphs until
    the server is ready: the warm-up must capture them at build all the same, or the kernels
    only their captures launch would be compiled by the served engine, after it is ready."""
    built_with: list[bool] = []
    load = Engine.load

    def recording(config: EngineConfig, *args, **kwargs) -> Engine:
        built_with.append(config.capture_graphs_when_idle)
        return load(config, *args, **kwargs)

    monkeypatch.setattr(Engine, "load", recording)
    config = _cpu_config(config_only_model, capture_graphs_when_idle=True)
    warm_up(config)
    assert built_with == [False]


def test_warm_up_fits_its_prompts_into_a_short_context(config_only_model: Path) -> None:
    """Its longest fixed prompt is 257 tokens: a 256-token context shortens it, in the batch
    of all prompts too (which once refused it: ContextLengthExceededError)."""
    report = warm_up(_cpu_config(config_only_model, max_model_len=256))
    assert report.workload_s > 0


def test_cached_kernels_counts_cache_keys(tmp_path: Path) -> None:
    assert cached_kernels(tmp_path / "absent") == 0
    for key in ("AAAA", "BBBB"):
        (tmp_path / key).mkdir()
    (tmp_path / "stray-file").write_text("")
    assert cached_kernels(tmp_path) == 2


def test_warmup_command_refuses_the_cpu(
    tmp_path: Path, config_only_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = _settings(tmp_path, config_only_model, "cpu", tmp_path / "cache")
    assert main(["warmup", "--config", str(settings)]) == 2
    assert 'engine.device = "cpu"' in capsys.readouterr().err


@pytest.mark.gpu
def test_a_warmed_cache_makes_the_next_start_compile_and_profile_nothing(
    tmp_path: Path, config_only_model: Path
) -> None:
    cache = tmp_path / "triton-cache"
    settings = _settings(tmp_path, config_only_model, "cuda", cache)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_CACHE_DIR"}

    def compiled(profile: str) -> int:
        # A new process each time: Triton also keeps compiled kernels in memory.
        result = subprocess.run(
            [sys.executable, "-m", "appliance", "warmup", "--config", str(settings)],
            capture_output=True, text=True, env=env, check=True, timeout=600,
        )  # fmt: skip
        match = re.search(r"Triton compiled (\d+) kernels", result.stdout)
        assert match, result.stdout + result.stderr
        assert f"the engine's memory profile: {profile} the cache" in result.stdout
        return int(match.group(1))

    first = compiled("measured and kept in")
    assert first > 0 and cached_kernels(cache) >= first
    assert len(list(cache.glob("inferno-memory-profile-*.json"))) == 1
    assert compiled("read from") == 0


def test_warm_up_runs_the_workload_split_over_two_processes(config_only_model: Path) -> None:
    """`engine.tensor_parallel_size = 2`: every rank draws its own part of the random weights
    (no checkpoint), runs the workload, and the workers are gone after."""
    config = _cpu_config(
        config_only_model,
        tensor_parallel_size=2,
        max_num_seqs=8,
    )
    report = warm_up(config)
    assert report.workload_s > 0
    assert not torch.distributed.is_initialized()  # the group was closed
