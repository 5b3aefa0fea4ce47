"""The engine's config (appliance.engine.engine_config): what it refuses as it is made, without
torch (the start-up's early checks), and what it refuses only when the engine's load asks torch
for the device (whether this machine has it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from appliance.engine.engine_config import EngineConfig, automatic_cpu_threads
from appliance.engine.errors import EngineConfigError


@pytest.mark.parametrize("device", ["mps", "tpu", "gpu", "cuda:", "cuda:x", "cuda0", "cpu:0"])
def test_a_device_inferno_does_not_run_on_is_refused_as_the_config_is_made(
    tmp_path: Path, device: str
) -> None:
    with pytest.raises(EngineConfigError, match=f"device '{device}': Inferno runs on cpu, cuda"):
        EngineConfig(model_dir=tmp_path, device=device)


def test_unknown_dtype_is_refused_naming_the_choices(tmp_path: Path) -> None:
    # The engine's config is its settings section: refused as it is made, before any load.
    with pytest.raises(ValidationError, match="float32"):
        EngineConfig(model_dir=tmp_path, dtype="int3")


@pytest.mark.parametrize(
    ("device", "dtype", "on_gpu", "dtype_name"),
    [
        ("cpu", None, False, "float32"),
        ("cuda", None, True, "bfloat16"),
        ("cuda:1", None, True, "bfloat16"),
        ("cuda:1", "float16", True, "float16"),
    ],
)
def test_a_device_s_kind_and_its_default_dtype_are_known_without_asking_torch(
    tmp_path: Path, device: str, dtype: str | None, on_gpu: bool, dtype_name: str
) -> None:
    config = EngineConfig(model_dir=tmp_path, device=device, dtype=dtype)
    assert (config.on_gpu, config.dtype_name) == (on_gpu, dtype_name)
    assert config.torch_dtype == getattr(torch, dtype_name)


def test_a_cuda_device_where_there_is_none_is_refused_when_the_load_asks_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = EngineConfig(model_dir=tmp_path, device="cuda")  # made: the name is right
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(EngineConfigError, match="device 'cuda': no CUDA GPU is available here"):
        _ = config.torch_device


def test_a_gpu_index_past_this_machine_s_last_gpu_is_refused_when_the_load_asks_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert EngineConfig(model_dir=tmp_path, device="cuda:1").torch_device == torch.device("cuda:1")
    with pytest.raises(EngineConfigError, match=r"this machine has 2 CUDA GPU\(s\), cuda:0 to"):
        _ = EngineConfig(model_dir=tmp_path, device="cuda:2").torch_device


@pytest.mark.parametrize(("num_cpus", "num_threads"), [(1, 1), (2, 1), (16, 15)])
def test_automatic_threads_leave_one_cpu_to_the_rest_of_the_machine(
    num_cpus: int, num_threads: int
) -> None:
    assert automatic_cpu_threads(num_cpus) == num_threads
