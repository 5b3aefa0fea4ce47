"""The engine's preload (appliance.boot.engine_preload): the server's own imports leave torch to
it, so that it overlaps the audit log, attestation and key release; and on a GPU, once it has
run, the engine's first steps spawn no subprocess and import nothing more of torch's compiler
stack. How it meets the gate (never on the GPUs before a passing verdict set them ready, a
failure failing the load) is in test_boot_gate.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.appliance.engine.test_warmup import TINY_LLAMA

ROOT = Path(__file__).resolve().parents[3]

_NO_TORCH_BEFORE_THE_PRELOAD = """
import sys
import appliance.__main__, appliance.app, appliance.boot.startup, appliance.boot.key_release
before = sorted(m for m in ("torch", "numpy", "triton") if m in sys.modules)
from appliance.boot.engine_preload import EnginePreload
from appliance.engine.engine_settings import EngineSettings
preload = EnginePreload.start(EngineSettings())
preload.cancel()
preload.wait()
print(before, "torch" in sys.modules, "kernels.reference" in sys.modules, preload.device_s)
"""


def _run(code: str, *args: str) -> str:
    """`code` in a fresh Python (this checkout on its path, Triton's cache where the settings
    put it); the last line it printed."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    environment.pop("TRITON_CACHE_DIR", None)
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_the_server_imports_no_torch_before_the_preload_does() -> None:
    """A fresh process imports the command, the app and the start-up sequence without torch
    (were it imported there, nothing would be left for the preload to overlap); then the
    preload imports torch and the CPU's kernels, and a cancelled one stops after that."""
    assert _run(_NO_TORCH_BEFORE_THE_PRELOAD) == "[] True True None"


# The start-up's early checks (step 1: StartUp.prepare, as the app is built) on a settings
# file's model and engine: the model's config.json and the engine's device, for a device named
# right (a GPU's included: whether this machine has it is the load's to say) and one not.
_EARLY_CHECKS = """
import json, sys
from appliance.boot.startup import engine_config
from appliance.config import Settings
from appliance.engine.errors import EngineConfigError

checked = []
for device in ("cpu", "cuda:1", "gpu"):
    settings = Settings.model_validate({**json.loads(sys.argv[1]), "engine": {"device": device}})
    try:
        checked.append(engine_config(settings).dtype_name)
    except EngineConfigError as exc:
        checked.append(str(exc))
print(json.dumps([checked, sorted(m for m in ("torch", "triton", "numpy") if m in sys.modules)]))
"""


def test_the_start_up_s_early_checks_import_no_torch(tmp_path: Path, smollm2_dir: Path) -> None:
    """The engine's config is checked, the model's config.json parsed, and a device Inferno does
    not run on refused, all without torch: the app is built, listens and attests while the
    preload imports it, instead of waiting on importlib's lock for the preload's imports."""
    settings = {
        "model": {"dir": str(smollm2_dir)},
        "server": {"insecure_http": True},
        "audit": {"origin": "inferno.test/boot", "data_dir": str(tmp_path / "audit")},
        "auth": {"local_issuer": "demo", "local_issuer_key_file": str(tmp_path / "k.pem")},
        "appliance": {"profile": "development"},
        "tee": {"mode": "insecure-dev"},
    }
    checked, imported = json.loads(_run(_EARLY_CHECKS, json.dumps(settings)))
    assert checked == [
        "float32",
        "bfloat16",
        "device 'gpu': Inferno runs on cpu, cuda or cuda:N",
    ]
    assert imported == []


_GPU_ENGINE_BEFORE_THE_VERDICT = """
import sys, torch
from appliance.boot.engine_preload import EnginePreload
from appliance.engine.engine_settings import EngineSettings
from triton.runtime.cache import triton_key

def driver_loaded():  # libcuda is mapped by the first call into the CUDA driver
    with open("/proc/self/maps") as maps:
        return "libcuda.so" in maps.read()

loaded_before = driver_loaded()
preload = EnginePreload.start(EngineSettings(device="cuda", triton_cache_dir=sys.argv[1]))
preload.cancel()  # the gate closed: stage 2 never comes
preload.wait()
print(torch.cuda.is_initialized(), driver_loaded() and not loaded_before,
      "kernels.triton_ops" in sys.modules, triton_key.cache_info().currsize, preload.device_s)
"""


def test_before_the_verdict_a_gpu_engine_s_preload_reaches_no_gpu(tmp_path: Path) -> None:
    """Stage 1 for a CUDA engine, on any machine: Triton's kernels imported and Triton's hash
    of itself computed, while torch made no CUDA context and the CUDA driver library was not
    loaded by the preload (on the GPU machine too: nothing called into the driver)."""
    result = _run(_GPU_ENGINE_BEFORE_THE_VERDICT, str(tmp_path / "triton-cache"))
    assert result == "False False True 1 None"


# In a fresh process whose Triton cache `inferno warmup`'s workload filled: the preload (both
# stages, a model drawn meanwhile as the load would decrypt one), then the engine built and one
# of the warm-up's own requests run, watching for subprocesses and for modules imported there.
_FIRST_STEPS_AFTER_THE_PRELOAD = """
import json, sys
from pathlib import Path
from appliance.boot.engine_preload import EnginePreload
from appliance.engine.engine import Engine
from appliance.engine.engine_config import EngineConfig
from appliance.engine.engine_settings import EngineSettings
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.warmup import random_model

settings = EngineSettings.model_validate(json.loads(sys.argv[1]))
config = EngineConfig(model_dir=Path(sys.argv[2]), **settings.model_dump())
spawned = []

def note(event, args):
    if event == "subprocess.Popen":
        command = args[1] if isinstance(args[1], (list, tuple)) else [args[1]]
        spawned.append([str(arg) for arg in command])

sys.addaudithook(note)
preload = EnginePreload.start(settings)
preload.warm_device(config)
model = random_model(config)
preload.wait()
by_preload, spawned[:] = list(spawned), []
imported = set(sys.modules)
engine = Engine.build(config, model, None)
greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
engine.generate([list(range(2, 9))], greedy)
engine.close()
heavy = ("torch._dynamo", "torch._inductor", "sympy", "torch.distributed.fsdp",
         "torch._higher_order_ops.triton_kernel_wrap", "triton.compiler", "triton.backends")
new = sorted(m for m in set(sys.modules) - imported if m.startswith(heavy))
print(json.dumps({"by_preload": by_preload, "spawned": spawned, "imported": new}))
"""

# What Triton may run at its first launch with a warm cache: lookups, never a compiler (a C
# compiler would mean the cache lacked the launcher stubs `inferno warmup` builds; ptxas
# without --version, a kernel missing from it).
_LOOKUPS = ("ldconfig -p", "--version", "file -b")


@pytest.mark.gpu
def test_after_the_preload_the_engine_s_first_steps_spawn_and_import_nothing(
    tmp_path: Path,
) -> None:
    """Triton's subprocesses (`ldconfig -p`, `ptxas --version`) and the modules torch and
    Triton import at the first launch all happen in the preload, off the start's critical
    path: the engine's build and first request then spawn nothing and import none of them.
    With the cache `inferno warmup` filled, even the preload compiles nothing: its
    subprocesses are lookups alone (the assertion's message lists them)."""
    from appliance.engine.engine_config import EngineConfig
    from appliance.engine.warmup import warm_up

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(TINY_LLAMA))
    settings = {
        "device": "cuda",
        "max_model_len": 256,
        "num_kv_blocks": 64,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 64,
        "triton_cache_dir": str(tmp_path / "triton-cache"),
    }
    warm_up(EngineConfig(model_dir=model_dir, **settings))  # fills the cache, in this process
    result = json.loads(_run(_FIRST_STEPS_AFTER_THE_PRELOAD, json.dumps(settings), str(model_dir)))
    assert (result["spawned"], result["imported"]) == ([], [])
    compiles = [argv for argv in result["by_preload"] if not any(
        lookup in " ".join(argv) for lookup in _LOOKUPS
    )]  # fmt: skip
    assert compiles == [], result["by_preload"]


def test_once_set_ready_a_gpu_engine_s_context_is_made_at_once_and_its_failure_fails_the_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`warm_device` makes the engine's GPU's primary context through CUDA's driver in a thread
    of its own (torch may still be importing); a driver that fails there fails the load, as
    any error of the preload does. Stand-ins here: no GPU, and stage 2's torch work left out."""
    from appliance.boot import cuda_driver, engine_preload
    from appliance.boot.cuda_driver import CudaDriverError
    from appliance.boot.engine_preload import EnginePreload, PreloadError
    from appliance.engine.engine_config import EngineConfig
    from appliance.engine.engine_settings import EngineSettings

    retained: list[int] = []
    monkeypatch.setattr(engine_preload, "_warm_device", lambda config: None)
    monkeypatch.setattr(cuda_driver, "retain_primary_context", retained.append)
    config = EngineConfig(model_dir=tmp_path, device="cuda:1")
    preload = EnginePreload.start(EngineSettings())
    preload.warm_device(config)
    preload.wait()
    assert retained == [1]

    def out_of_memory(ordinal: int) -> None:
        raise CudaDriverError(
            "CUDA's driver failed in cuDevicePrimaryCtxRetain: CUDA_ERROR_OUT_OF_MEMORY"
        )

    monkeypatch.setattr(cuda_driver, "retain_primary_context", out_of_memory)
    failing = EnginePreload.start(EngineSettings())
    failing.warm_device(config)
    with pytest.raises(PreloadError, match="cuDevicePrimaryCtxRetain: CUDA_ERROR_OUT_OF_MEMORY"):
        failing.wait()
